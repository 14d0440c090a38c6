"""Two real hosts on one machine: network namespaces on a private bridge, each with its own sshd.

    switch namespace  hvdp-<pid>-sw : bridge br0, veth ends va, vb (no address: it only switches)
    host namespace    hvdp-<pid>-a  : interface hvdp0 = 10.77.0.1/24, hostname hosta, sshd on :22
    host namespace    hvdp-<pid>-b  : interface hvdp0 = 10.77.0.2/24, hostname hostb, sshd on :22

Nothing is added to the machine's own network namespace, so no address outside these namespaces is ever
used. The inner interface has the same name on every host, as on a cluster, so `--network-interface
hvdp0` / `btl_tcp_if_include=hvdp0` name it everywhere. Each host gets its own /etc/hosts and /etc/ssh
(files under /etc/netns/<ns>/, which `ip netns exec` bind-mounts over /etc) and its own UTS hostname
(`unshare --uts`), so name resolution and `hostname` behave as on separate machines. The ssh client
config there trusts the generated host keys and uses the generated client key: horovodrun and mpirun run
unchanged. Namespaces, sshds and /etc/netns entries are removed afterwards, even on failure, and a run
that crashed earlier (its pid in the name no longer alive) is cleaned up at the start of the next one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUBNET = "10.77.0"
IFACE = "hvdp0"
SUBNET6 = "fd77:0:0:77"  # a unique-local IPv6 prefix, for the IPv6-only link (Cluster.add_ipv6_link)
IFACE6 = "hvdp6"
NETNS_RUN = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
_NAME = re.compile(r"^hvdp-(\d+)-")


@dataclass
class Host:
    name: str       # host name, as given to -H and in hostfiles
    netns: str      # network namespace
    address: str    # its address on the private bridge

    def prefix(self) -> list[str]:
        """argv prefix that runs a command on this host: its network namespace, /etc and hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh"]


@dataclass
class Cluster:
    hosts: list[Host]
    switch: str                 # namespace holding the bridge
    workdir: Path               # keys, sshd configs and logs
    iface: str = IFACE
    sshds: list[subprocess.Popen] = field(default_factory=list)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def on(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run argv on `host` (as a user logged into it would) and wait."""
        return subprocess.run(self.host(host).prefix() + [str(a) for a in argv], **kw)

    def cut_link(self, host: str) -> None:
        """Take the host's link down, as if its cable were pulled: no FIN, no RST, packets just vanish."""
        _ip("-n", self.host(host).netns, "link", "set", self.iface, "down")

    def add_ipv6_link(self, iface: str = IFACE6) -> list[str]:
        """A second link on every host, `iface`, with IPv6 addresses only (SUBNET6::<n>/64, no IPv4), on a
        bridge of its own; returns the hosts' addresses on it. Removed with the namespaces."""
        _ip("-n", self.switch, "link", "add", "br6", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br6", "up")
        addresses = []
        for i, host in enumerate(self.hosts):
            end = "w" + host.name[-1]
            _ip("-n", self.switch, "link", "add", end, "type", "veth", "peer", "name", iface, "netns", host.netns)
            _ip("-n", self.switch, "link", "set", end, "master", "br6", "up")
            addresses.append(f"{SUBNET6}::{i + 1}")
            _ip("-n", host.netns, "addr", "add", f"{addresses[-1]}/64", "dev", iface, "nodad")  # usable at once
            _ip("-n", host.netns, "link", "set", iface, "up")
        return addresses

    def hostfile(self, slots: int = 1) -> Path:
        path = self.workdir / "hostfile"
        path.write_text("".join(f"{h.name} slots={slots}\n" for h in self.hosts))
        return path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _why_not() -> str | None:
    """Why this machine cannot run the multihost tests, or None if it can."""
    if os.geteuid() != 0:
        return f"multihost: needs root and ip netns (running as uid {os.geteuid()})"
    if not shutil.which("ip"):
        return "multihost: needs iproute2 (`ip` not found; `make setup` installs it as root)"
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if not sshd:
        return "multihost: needs openssh-server (sshd not found; `make setup` installs it as root)"
    if not shutil.which("ssh"):
        return "multihost: needs openssh-client (ssh not found; `make setup` installs it as root)"
    if not shutil.which("unshare"):
        return "multihost: needs util-linux (`unshare` not found)"
    probe = f"hvdp-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"multihost: needs root and ip netns (`ip netns add` failed: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def _remove(netns: str) -> None:
    """Kill what still runs in `netns` (our sshds and ranks), then delete it and its /etc/netns files."""
    listed = _ip("netns", "pids", netns, check=False)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def _clean_leftovers() -> None:
    """Namespaces of earlier runs whose pytest process is gone (a crash, a kill -9)."""
    names = {p.name for p in NETNS_RUN.glob("hvdp-*")} | {p.name for p in ETC_NETNS.glob("hvdp-*")}
    for name in sorted(names):
        match = _NAME.match(name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # that run is alive (another engineer's test session): leave it alone
        except ProcessLookupError:
            _remove(name)
        except PermissionError:
            continue


def _write_host_files(host: Host, hosts: list[Host], workdir: Path, key: Path) -> Path:
    """/etc/hosts and /etc/ssh for `host`, and the sshd config; returns the sshd config path."""
    etc = ETC_NETNS / host.netns
    (etc / "ssh").mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts))
    (etc / "hostname").write_text(host.name + "\n")
    (etc / "ssh" / "ssh_config").write_text(
        "Host *\n"
        f"  IdentityFile {key}\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n"
        "  LogLevel ERROR\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 10\n")
    hostkey = workdir / f"hostkey-{host.name}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)], check=True)
    config = workdir / f"sshd-{host.name}.conf"
    config.write_text(
        f"ListenAddress {host.address}\nPort 22\nHostKey {hostkey}\nPidFile {workdir}/sshd-{host.name}.pid\n"
        f"AuthorizedKeysFile {workdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PrintMotd no\nLogLevel ERROR\n")
    return config


def _wait_for_ssh(cluster: Cluster, timeout: float = 20) -> None:
    """Every host reaches every host by name over ssh, or the fixture fails naming the pair."""
    for src in cluster.hosts:
        for dst in cluster.hosts:
            deadline = time.monotonic() + timeout
            while True:
                proc = cluster.on(src.name, ["ssh", dst.name, "hostname"], capture_output=True, text=True,
                                  timeout=timeout)
                if proc.returncode == 0 and proc.stdout.strip() == dst.name:
                    break
                if time.monotonic() > deadline:
                    logs = "".join(p.name + ": " + p.read_text() for p in cluster.workdir.glob("sshd-*.log"))
                    raise RuntimeError(f"ssh from {src.name} to {dst.name} failed (exit {proc.returncode}): "
                                       f"{proc.stdout}{proc.stderr}\nsshd logs:\n{logs}")
                time.sleep(0.2)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two hosts, hosta and hostb, reachable from each other by name over ssh as root."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    _clean_leftovers()
    workdir = tmp_path_factory.mktemp("cluster")
    prefix = f"hvdp-{os.getpid()}-"
    hosts = [Host(name=f"host{c}", netns=prefix + c, address=f"{SUBNET}.{i + 1}") for i, c in enumerate("ab")]
    cluster = Cluster(hosts=hosts, switch=prefix + "sw", workdir=workdir)
    try:
        _ip("netns", "add", cluster.switch)
        _ip("-n", cluster.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", cluster.switch, "link", "set", "br0", "up")
        key = workdir / "client_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        shutil.copy(key.with_suffix(".pub"), workdir / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for host in hosts:
            end = "v" + host.name[-1]
            _ip("netns", "add", host.netns)
            _ip("-n", cluster.switch, "link", "add", end, "type", "veth", "peer", "name", IFACE,
                "netns", host.netns)
            _ip("-n", cluster.switch, "link", "set", end, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE)
            _ip("-n", host.netns, "link", "set", IFACE, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            config = _write_host_files(host, hosts, workdir, key)
            log = open(workdir / f"sshd-{host.name}.log", "w")
            cluster.sshds.append(subprocess.Popen(
                host.prefix() + [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdout=log, stderr=subprocess.STDOUT))
        _wait_for_ssh(cluster)
        yield cluster
    finally:
        for sshd in cluster.sshds:
            sshd.kill()
            sshd.wait()
        for host in hosts:
            _remove(host.netns)
        _remove(cluster.switch)
