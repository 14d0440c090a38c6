"""docs/launchers.md's MPIJob, played out with no Kubernetes: the image docker/sshd.Dockerfile builds, run as the
Kubeflow MPI Operator runs it, in three pods made of network-namespace hosts.

    pod        network namespace          address      runs (the manifest's own commands, as uid 1000)
    worker-0   the cluster fixture's a    10.77.0.1    /usr/sbin/sshd -De -f /home/app/.sshd_config
    worker-1   the cluster fixture's b    10.77.0.2    the same
    launcher   one more on the bridge     10.77.0.3    mpirun ... python examples/train_torch.py, in /workspace

What the operator does, done here: one ECDSA key pair (as its Secret holds) mounted read-only at the
manifest's sshAuthMountPath as id_rsa, id_rsa.pub and authorized_keys in every pod; the hostfile at
/etc/mpi/hostfile (one line per worker, slotsPerWorker slots) and OMPI_MCA_orte_default_hostfile naming it in
the launcher; each pod's hostname and the others' names in its /etc/hosts (the pods' DNS). Each pod is a
container of the image (`buildah from`), its root filesystem mounted and entered with chroot, with the image's
environment, user and working directory. The job is the manifest's at 2 workers instead of 4 (-np 2, one
thread each: this machine has 2 cores). Kubernetes itself (scheduling, the pod network, the operator's
controller) is not here; tests/test_kubernetes.py checks the manifest against the operator's CRD.

Runs under `make docker-test` (HVDP_DOCKER_TEST=1), after scripts/test_image.sh built localhost/hvdp:test (or
runs that script first); it needs root, buildah, ip netns and the apt mirror (openssh-server in the image's
build).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.launch import ROOT, result_line
from tests.multihost.conftest import SUBNET, _ip, _remove
from tests.test_kubernetes import manifest

BASE = os.environ.get("HVDP_IMAGE", "localhost/hvdp:test")
IMAGE = BASE + "-sshd"
WORKERS = 2

pytestmark = [pytest.mark.docker,
              pytest.mark.skipif(os.environ.get("HVDP_DOCKER_TEST") != "1" or shutil.which("buildah") is None,
                                 reason="make docker-test (HVDP_DOCKER_TEST=1, buildah): builds the sshd image on "
                                        "the one scripts/test_image.sh builds")]


def _buildah(*args: str, timeout: float = 1800) -> str:
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"buildah {' '.join(args)}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout.strip()


class Pod:
    """A container of IMAGE, its root filesystem mounted, with the operator's keys (and hostfile) in it."""

    def __init__(self, name: str, address: str, netns: str, keys: Path, hosts: str):
        self.name, self.address, self.netns = name, address, netns
        self.container = _buildah("from", "--quiet", IMAGE)
        self.root = Path(_buildah("mount", self.container))
        self.mounts: list[Path] = []
        (self.root / "etc" / "hosts").write_text(hosts)
        ssh = self.root / "home" / "app" / ".ssh"
        ssh.mkdir(exist_ok=True)
        self._mount(["--bind", str(keys), str(ssh)])
        self._mount(["-o", "remount,bind,ro", str(keys), str(ssh)], track=False)
        self._mount(["-t", "proc", "proc", str(self.root / "proc")])
        self._mount(["--rbind", "/dev", str(self.root / "dev")])

    def _mount(self, args: list[str], track: bool = True) -> None:
        subprocess.run(["mount", *args], check=True)
        if track:
            self.mounts.append(Path(args[-1]))

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """argv run in this pod: its network namespace and hostname, chroot into the image as uid 1000, the
        image's environment, in its working directory."""
        script = ('hostname "$1" && root="$2" && shift 2 && exec chroot --userspec=1000:1000 "$root" '
                  '/usr/bin/env -i "$@"')
        inner = [f"{k}={v}" for k, v in env.items()] + ["sh", "-c", 'cd /workspace && exec "$@"', "sh", *argv]
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", script, "sh",
                self.name, str(self.root), *inner]

    def close(self) -> None:
        for pid in os.listdir("/proc"):  # whatever still runs inside this pod's root (sshd, a stray rank)
            try:
                if pid.isdigit() and os.readlink(f"/proc/{pid}/root") == str(self.root):
                    os.kill(int(pid), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-R", "-l", str(path)], capture_output=True)
        subprocess.run(["buildah", "rm", self.container], capture_output=True)


@pytest.fixture(scope="module")
def image():
    if subprocess.run(["buildah", "inspect", "--type", "image", BASE], capture_output=True).returncode != 0:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "test_image.sh")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=3600)  # builds BASE, then tests it
        assert proc.returncode == 0, proc.stdout[-5000:]
    _buildah("bud", "--isolation", "chroot", "--layers", "--build-arg", f"BASE={BASE}", "-t", IMAGE,
             "-f", str(ROOT / "docker" / "sshd.Dockerfile"), str(ROOT / "docker"))
    config = json.loads(_buildah("inspect", "--type", "image", IMAGE))["OCIv1"]["config"]
    return dict(item.split("=", 1) for item in config.get("Env", []))


@pytest.fixture
def launcher_netns(cluster):
    """A third namespace on the cluster's bridge, 10.77.0.3, for the launcher pod."""
    netns = cluster.switch[:-len("sw")] + "l"
    _ip("netns", "add", netns)
    try:
        _ip("-n", cluster.switch, "link", "add", "vl", "type", "veth", "peer", "name", cluster.iface, "netns", netns)
        _ip("-n", cluster.switch, "link", "set", "vl", "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{SUBNET}.3/24", "dev", cluster.iface)
        _ip("-n", netns, "link", "set", cluster.iface, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        yield netns
    finally:
        _remove(netns)


def test_the_mpijob_trains_over_the_images_own_sshd_as_its_user(image, cluster, launcher_netns, tmp_path):
    spec = manifest()["spec"]
    [worker] = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    [launcher] = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    assert spec["sshAuthMountPath"] == "/home/app/.ssh"  # where Pod mounts the keys
    job = launcher["command"]
    job = [("2" if a == "4" and job[i - 1] == "-np" else "OMP_NUM_THREADS=1" if a.startswith("OMP_NUM_THREADS=")
            else a) for i, a in enumerate(job)]
    assert job[:3] == ["mpirun", "-np", "2"] and "OMP_NUM_THREADS=1" in job, job

    keys = tmp_path / "keys"  # the operator's Secret, as its volume lays it out
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-N", "", "-f", str(keys / "id_rsa")], check=True)
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    subprocess.run(["chown", "-R", "1000:1000", str(keys)], check=True)
    names = {f"worker-{i}": (cluster.hosts[i].netns, cluster.hosts[i].address) for i in range(WORKERS)}
    names["launcher"] = (launcher_netns, f"{SUBNET}.3")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, (_, addr) in names.items())
    pods, sshds = [], []
    try:
        for name, (netns, address) in names.items():
            pods.append(Pod(name, address, netns, keys, hosts))
        *workers, launch = pods
        (launch.root / "etc" / "mpi").mkdir(exist_ok=True)
        (launch.root / "etc" / "mpi" / "hostfile").write_text(
            "".join(f"{w.name} slots={spec['slotsPerWorker']}\n" for w in workers))
        env = {**image, "HOME": "/home/app", "USER": "app", "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile"}
        for w in workers:
            log = open(tmp_path / f"{w.name}.log", "w")
            sshds.append(subprocess.Popen(w.command(worker["command"], env), stdout=log, stderr=subprocess.STDOUT))

        def on_launcher(argv, timeout):
            return subprocess.run(launch.command(argv, env), capture_output=True, text=True, timeout=timeout)

        # ssh as the operator's launcher does: as app, port 2222 and no host-key questions from the image's config
        for w in workers:
            for _ in range(50):
                proc = on_launcher(["ssh", w.name, "id -un; hostname"], 30)
                if proc.returncode == 0:
                    break
                subprocess.run(["sleep", "0.2"])
            assert proc.stdout.split() == ["app", w.name], proc.stdout + proc.stderr + (
                tmp_path / f"{w.name}.log").read_text()
        proc = on_launcher(["mpirun", "-np", "2", "hostname"], 120)  # the ranks land on the workers
        assert sorted(proc.stdout.split()) == ["worker-0", "worker-1"], proc.stdout + proc.stderr
        proc = on_launcher(job, 900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        result = result_line(proc.stdout)  # check_consistency() in the example raised had the replicas diverged
        assert result["world_size"] == 2 and result["test_accuracy"] >= 0.97, result
    finally:
        for sshd in sshds:
            sshd.kill()
            sshd.wait()
        for pod in pods:
            pod.close()
