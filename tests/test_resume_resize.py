"""A checkpoint resumed at another world size (at an epoch boundary) runs at the new world's learning rate.

One chain per framework: np=2 trains an epoch and saves; one process resumes it (rate must be base x 1),
trains and saves; np=2 resumes that (rate must be base x 2). The TF chain also rebuilds the optimizer
from the config saved by the other world (DistributedOptimizer.from_config).
"""

from pathlib import Path

import pytest

from hvdp.core.scaling import lr_multiplier
from tests.launch import result_line, run

HERE = Path(__file__).parent
WORKERS = {"torch": HERE / "torch" / "worker_resize.py", "tensorflow": HERE / "tensorflow" / "worker_resize.py"}


def _launch(launcher, worker, load, save, np):
    proc = run(launcher, worker, str(load), str(save), np=np, timeout=300)
    assert proc.returncode == 0, f"{worker.name} np={np} exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return result_line(proc.stdout)


@pytest.mark.parametrize("framework", sorted(WORKERS))
def test_resume_at_another_world_size_rescales_lr(framework, tmp_path):
    worker = WORKERS[framework]
    first = _launch("gloo", worker, "-", tmp_path / "np2", np=2)
    assert first["lr"] == pytest.approx(first["base"] * lr_multiplier("linear", 2))
    alone = _launch("python", worker, tmp_path / "np2", tmp_path / "np1", np=1)
    again = _launch("gloo", worker, tmp_path / "np1", tmp_path / "np2-again", np=2)
    for r, size in ((alone, 1), (again, 2)):
        expected = r["base"] * lr_multiplier("linear", size)
        assert r["size"] == size and r["resumed_epoch"] == size  # np=1 resumes epoch 1, np=2 epoch 2
        for key in [k for k in r if k.endswith("lr") or k.endswith("lr_after_ramp")]:
            assert r[key] == pytest.approx(expected, rel=1e-6), (size, key, r)
