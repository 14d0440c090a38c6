"""kill -9 at many moments, several of them inside a checkpoint save: every resumed run ends with weights
bit-identical to an uninterrupted run's, and no kill ever leaves a state that cannot resume."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launch import ROOT, env

WORKER = Path(__file__).with_name("ckpt_worker.py")


def launch(directory, out):
    return subprocess.Popen([sys.executable, str(WORKER), "--dir", str(directory), "--out", str(out)], cwd=ROOT,
                            env=env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def newest_step(directory):
    steps = [int(p.name[5:13]) for p in directory.glob("ckpt-*.pt")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    proc = launch(d / "ckpt", d / "final.pt")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return torch.load(d / "final.pt", weights_only=True)


# (where, after how many completed checkpoints): 'save' kills while a temp file of the next save exists.
POINTS = [("save", 0), ("save", 2), ("save", 4), ("save", 7), ("save", 10),
          ("between", 1), ("between", 3), ("between", 5), ("between", 8), ("between", 11)]


@pytest.mark.parametrize("where,after", POINTS)
def test_kill_then_resume_is_bit_identical(tmp_path, uninterrupted, where, after):
    directory, out = tmp_path / "ckpt", tmp_path / "final.pt"
    job = launch(directory, out)
    deadline = time.monotonic() + 120
    inside = False
    while job.poll() is None and time.monotonic() < deadline:
        if directory.is_dir() and newest_step(directory) >= after:
            if where == "between":
                break
            if any(directory.glob(".ckpt-*.tmp")):
                inside = True
                break
        time.sleep(0.001)
    assert job.poll() is None, "the job finished before the kill point: make the worker longer"
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    if where == "save":
        assert inside, "the kill should land inside a save"
    left = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    resumed = launch(directory, out)
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, f"could not resume after a kill ({where} {after}); left {left}:\n{log[-3000:]}"
    final = torch.load(out, weights_only=True)
    for name, value in uninterrupted.items():
        assert torch.equal(final[name], value), f"{name} differs after kill ({where} {after}); left {left}"
    assert not list(directory.glob(".ckpt-*.tmp")), "stale temp files must be cleaned by the next save"
