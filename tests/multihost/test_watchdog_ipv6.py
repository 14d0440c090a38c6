"""The watchdog on an interface with IPv6 addresses only (issue 30): its heartbeats go over IPv6 between two
hosts, so a healthy job that runs for several times the silent-peer limit is not ended, and a stopped rank
is named within the limit. Each host gets a second link, hvdp6, with only an fd77:0:0:77::<n>/64 address;
HVDP_WATCHDOG_IFACE=hvdp6 puts the watchdog there, while Horovod's own traffic (Gloo) stays on hvdp0.
(Before, an interface without IPv4 made the watchdog listen on 127.0.0.1, which the other host cannot reach,
and every such job was ended after the limit.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.faults.test_pause import LIMIT
from tests.launch import HOROVODRUN, ROOT, env

pytestmark = pytest.mark.multihost

WORKER = ROOT / "tests" / "faults" / "pause_worker.py"


@pytest.fixture(scope="module")
def ipv6_link(cluster):
    return cluster.add_ipv6_link()


def start(cluster, ipv6_link, steps: int, log) -> subprocess.Popen:
    argv = [HOROVODRUN, "--gloo", "-np", "2", "-H", "hosta:1,hostb:1", "--network-interface", cluster.iface,
            sys.executable, str(WORKER), "--steps", str(steps)]
    return subprocess.Popen(cluster.host("hosta").prefix() + argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=env(HVDP_WATCHDOG_IFACE="hvdp6", HVDP_WATCHDOG_TIMEOUT=str(LIMIT)))


def watchdog_address(cluster, host: str, pid: int) -> str:
    """The address the UDP socket of process `pid` on `host` is bound to (`ss`, in the host's namespace)."""
    listed = subprocess.run(["ip", "netns", "exec", cluster.host(host).netns, "ss", "-H", "-u", "-l", "-n", "-p"],
                            capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in listed.splitlines() if f"pid={pid}," in line]
    return line.split()[3].rsplit(":", 1)[0].strip("[]")


def test_heartbeats_over_ipv6_keep_a_healthy_job_and_name_a_stopped_rank(cluster, ipv6_link, tmp_path):
    healthy_log, stopped_log = tmp_path / "healthy.log", tmp_path / "stopped.log"
    with healthy_log.open("w") as log:
        proc = start(cluster, ipv6_link, steps=60, log=log)  # about 15 s of training: 4x the limit
        code = proc.wait(timeout=240)
    out = healthy_log.read_text()
    assert code == 0, out[-4000:]
    assert len(set(re.findall(r"finished, weights ([0-9a-f]{64})", out))) == 1, out[-3000:]
    assert "stopped responding" not in out

    with stopped_log.open("w") as log:
        proc = start(cluster, ipv6_link, steps=10_000, log=log)
        try:
            deadline = time.monotonic() + 240
            while not re.search(r"pause_worker: step 5(?!\d)", stopped_log.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, stopped_log.read_text()[-3000:]
                time.sleep(0.2)
            out = stopped_log.read_text()
            pids = {int(r): int(p) for r, p in re.findall(r"pause_worker: rank (\d) pid (\d+)", out)}
            # each rank listens on its own host's IPv6 address, not on loopback and not on IPv4
            assert [watchdog_address(cluster, h, pids[r]) for r, h in ((0, "hosta"), (1, "hostb"))] == ipv6_link, \
                out[-3000:]
            os.kill(pids[1], signal.SIGSTOP)
            stopped_at = time.monotonic()
            code = proc.wait(timeout=LIMIT + 60)
            ended = time.monotonic()
        finally:
            proc.kill()
            subprocess.run(["pkill", "-KILL", "-f", str(WORKER)])
    out = stopped_log.read_text()
    assert code != 0 and "rank 1 (last heard" in out and "stopped responding" in out, out[-4000:]
    print(f"rank 1 named and the job ended {ended - stopped_at:.1f} s after it was stopped")
    assert ended - stopped_at < LIMIT + 30, ended - stopped_at
