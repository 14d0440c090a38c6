"""The watchdog under a flood (issue 30): another process sends garbage datagrams to every port the job's
watchdogs bound, as fast as it can, for longer than the silent-peer limit. A healthy job (np=3) finishes
with identical replicas, and in a second job flooded alike a rank stopped during the flood is named within
the limit plus a margin. The two jobs run side by side under one flood.

What the flood costs: docs/troubleshooting.md ("Floods").
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.faults.test_pause import LIMIT, NP, Job, finish
from tests.launch import ROOT

FLOODER = Path(__file__).with_name("flooder.py")
FLOOD = 25  # seconds: 6x the silent-peer limit


def watchdog_ports(job: Job) -> list[int]:
    """The UDP ports the job's ranks bound (the watchdogs': Gloo uses TCP)."""
    ports = []
    for rank in range(NP):
        ports += [c.laddr.port for c in psutil.Process(job.rank_pid(rank)).net_connections(kind="udp")]
    assert len(ports) == NP, ports
    return ports


def test_a_flood_neither_ends_a_healthy_job_nor_hides_a_stopped_rank(tmp_path):
    healthy, stopped = Job("gloo", tmp_path, steps=80), Job("gloo", tmp_path / "b", steps=10_000)
    stopped.launcher = "gloo-stopped"
    flood = None
    try:
        for job in (healthy, stopped):
            job.wait_for_step(2)
        ports = watchdog_ports(healthy) + watchdog_ports(stopped)
        flood = subprocess.Popen([sys.executable, str(FLOODER), str(FLOOD), *map(str, ports)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(LIMIT + 1)  # the flood has gone on for longer than the limit: the jobs still train
        assert healthy.proc.poll() is None and stopped.proc.poll() is None, healthy.output()[-3000:]
        psutil.Process(stopped.rank_pid(1)).send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        results = finish([healthy, stopped], timeout=240)
        report = flood.communicate(timeout=FLOOD + 30)[0]
    finally:
        for job in (healthy, stopped):
            job.kill()
        if flood is not None:
            flood.kill()
            flood.wait()
    print(report)
    sent, seconds = map(float, re.search(r"flooder: (\d+) datagrams in ([\d.]+) s", report).groups())
    assert seconds >= FLOOD and sent / seconds > 20_000, report  # a flood, for longer than the limit
    out = healthy.output()
    assert results["gloo"][0] == 0, out[-4000:]
    assert len(set(re.findall(r"finished, weights ([0-9a-f]{64})", out))) == 1, out[-3000:]
    out = stopped.output()
    code, ended = results["gloo-stopped"]
    assert code not in (0, None) and "rank 1 (last heard" in out, out[-4000:]
    print(f"rank 1 named and the job ended {ended - stopped_at:.1f} s after it was stopped")
    assert ended - stopped_at < LIMIT + 30, ended - stopped_at
