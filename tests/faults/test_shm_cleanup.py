"""Nothing is left in /dev/shm when a rank dies at any point of the shared-memory allreduce's set-up or use
(issue 30): the segment never has a name (O_TMPFILE on /dev/shm, reopened by the other ranks through
/proc/<pid>/fd), so it goes with the last process that maps it. One rank is killed with SIGKILL at each point
(HVDP_SHM_KILL_AT, a hook in csrc/horovod/shm_operations.cc), then /dev/shm is listed.

Before, rank 0 shm_open()ed a named segment and unlinked it only after every rank had mapped it: a rank
killed in between (an LD_PRELOAD that SIGKILLs rank 1 in its shm_open) left /dev/shm/hvdp-shm-<pid>-<n>.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch import ROOT, env, launcher_cmd

WORKER = Path(__file__).with_name("shm_setup_worker.py")
# Each point of the set-up and use, on the rank that reaches it: rank 0 creates and sizes the segment, the
# others open rank 0's descriptor; every rank maps it, meets the others, and then runs allreduces in it.
POINTS = ["created:0", "allocated:0", "opened:1", "mapped:0", "mapped:1", "handshake:0", "handshake:1",
          "in-use:0", "in-use:1"]


def ours() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("hvdp")}


def launch(kill_at: str | None) -> subprocess.CompletedProcess:
    extra = {"HVDP_SHM_ALLREDUCE": "1", "HVDP_SHM_TIMEOUT_SECONDS": "10", "HOROVOD_LOG_LEVEL": "debug"}
    if kill_at:
        extra["HVDP_SHM_KILL_AT"] = kill_at
    return subprocess.run(launcher_cmd("mpirun") + [str(WORKER)], cwd=ROOT, env=env(**extra), capture_output=True,
                          text=True, timeout=180)


def test_the_segment_is_shared_and_never_named():
    before = ours()
    proc = launch(None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "shared-memory allreduce on for 2 ranks" in out, out[-3000:]  # rank 1 reached rank 0's segment
    assert out.count("shm_setup_worker: rank") == 2
    assert ours() == before


def test_a_rank_killed_at_any_point_leaves_nothing_in_dev_shm():
    before = ours()
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(POINTS, pool.map(launch, POINTS)))
    for point, proc in runs.items():
        out = proc.stdout + proc.stderr
        rank = point.split(":")[1]
        assert proc.returncode != 0 and f"process rank {rank} with PID" in out and "signal 9" in out, \
            (point, out[-3000:])
    left = ours() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"
