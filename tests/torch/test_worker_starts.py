"""Hundreds of DataLoader worker start-ups in ranks whose threads run (worker_starts.py), under a time limit.

Before issue 36's fix shard() forked its workers every epoch from a rank running Horovod's, MPI's and the
watchdog's threads; at np=2 under MPI that hung at epoch 245 of 400 (about 1,600 forks per rank): one worker
stuck in CPython's fork handler (PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept, waiting for a lock
another thread held at the fork), its rank waiting for a batch, the other in the epoch's allgather, and no
watchdog message. Now the workers start by forkserver, and map-style loaders keep theirs for the run.

`make soak` runs it with HVDP_SOAK_EPOCHS=400 per launch (about 3 minutes each at np=2); the default here is
30 epochs per launch (about 130 start-ups per rank).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import ROOT, env, launcher_cmd

WORKER = Path(__file__).with_name("worker_starts.py")
EPOCHS = int(os.environ.get("HVDP_SOAK_EPOCHS", "30"))


def expected_starts(epochs: int) -> int:
    """Worker start-ups per rank: 2 for the kept loader, 2 per epoch for the per-epoch loader and the stream,
    2 for each loader built anew every 4th epoch (kept for its one epoch)."""
    return 2 + 2 * epochs + 2 * epochs + 2 * (epochs // 4)


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_many_worker_start_ups_never_hang_and_read_every_sample_once(launcher, tmp_path):
    limit = 90 + 3 * EPOCHS  # ~1 s per epoch measured at np=2 on 2 shared cores; a hang waits forever
    out = tmp_path / "starts.json"
    cmd = launcher_cmd(launcher) + [str(WORKER), str(out), str(tmp_path), str(EPOCHS)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(WORKER)])  # Gloo's ranks run in sessions of their own
        output, _ = proc.communicate()
        pytest.fail(f"hung: still running after {limit} s ({time.monotonic() - start:.0f} s), "
                    f"{[len(p.read_text().splitlines()) for p in sorted(tmp_path.glob('starts-*'))]} worker "
                    f"start-ups per rank so far:\n{output[-3000:]}")
    stalled = "Horovod has been shut down" in output or "Missing ranks:" in output
    assert proc.returncode == 0 and out.exists(), (("hung: Horovod's stall shutdown ended it. " if stalled else "")
                                                   + output[-3000:])
    result = json.loads(out.read_text())
    assert result["wrong"] == 0, result["errors"]
    assert result["starts"] == [expected_starts(EPOCHS)] * 2, result
    assert "forks this rank's process" not in output, output[-3000:]  # hvdp itself never forks a threaded rank
