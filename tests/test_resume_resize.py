"""A checkpoint resumed at another world size (at an epoch boundary) runs at the new world's learning rate.

One chain per framework: np=2 trains an epoch and saves; one process resumes it (rate must be base x 1),
trains and saves; np=2 resumes that (rate must be base x 2). The TF chain also rebuilds the optimizer
from the config saved by the other world (DistributedOptimizer.from_config). The torch chain also runs one
model per torch LR scheduler (with a warmup), its state saved among the checkpoint's extras: every step of
every run must take the rate the uninterrupted schedule gives at that step, scaled for the world it runs in.
"""

import math
from pathlib import Path

import numpy as np

import pytest

from hvdp.core.scaling import lr_multiplier
from tests.launch import result_line, run

HERE = Path(__file__).parent
WORKERS = {"torch": HERE / "torch" / "worker_resize.py", "tensorflow": HERE / "tensorflow" / "worker_resize.py"}


def _launch(launcher, worker, load, save, np):
    proc = run(launcher, worker, str(load), str(save), np=np, timeout=300)
    assert proc.returncode == 0, f"{worker.name} np={np} exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return result_line(proc.stdout)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """chain(framework): [(result, size)] of np=2 from scratch, then alone from its checkpoint, then np=2 from
    that one; launched once per framework for all the tests of this module."""
    done = {}

    def launch(framework):
        if framework not in done:
            tmp, worker = tmp_path_factory.mktemp(framework), WORKERS[framework]
            done[framework] = [(_launch("gloo", worker, "-", tmp / "np2", np=2), 2),
                               (_launch("python", worker, tmp / "np2", tmp / "np1", np=1), 1),
                               (_launch("gloo", worker, tmp / "np1", tmp / "np2-again", np=2), 2)]
        return done[framework]
    return launch


@pytest.mark.parametrize("framework", sorted(WORKERS))
def test_resume_at_another_world_size_rescales_lr(framework, chain):
    (first, _), (alone, _), (again, _) = chain(framework)
    assert first["lr"] == pytest.approx(first["base"] * lr_multiplier("linear", 2))
    for r, size in ((alone, 1), (again, 2)):
        expected = r["base"] * lr_multiplier("linear", size)
        assert r["size"] == size and r["resumed_epoch"] == size  # np=1 resumes epoch 1, np=2 epoch 2
        for key in [k for k in r if k.endswith("lr") or k.endswith("lr_after_ramp")]:
            assert r[key] == pytest.approx(expected, rel=1e-6), (size, key, r)


def scheduled(name, t, total):
    """torch's schedulers as their documentation defines them: the factor on the scaled rate at step t."""
    if name == "LambdaLR":
        return 1.0 / (1.0 + 0.25 * t)
    if name == "StepLR":
        return 0.5 ** (t // 3)
    if name == "CosineAnnealingLR":
        return (1 + math.cos(math.pi * t / total)) / 2
    assert name == "OneCycleLR"  # defaults: pct_start 0.3, cosine, div_factor 25, final_div_factor 1e4

    def cos(start, end, pct):
        return end + (start - end) / 2 * (math.cos(math.pi * pct) + 1)
    initial, peak = 1 / 25, 1.0
    up = 0.3 * total - 1
    return cos(initial, peak, t / up) if t <= up else cos(peak, initial / 1e4, (t - up) / (total - 1 - up))


def test_resumed_torch_schedulers_continue_at_the_new_worlds_rate(chain):
    """issue 29: LambdaLR saved at np=2 and loaded at np=1 was back at 2 x base after one scheduler.step()."""
    runs = chain("torch")
    steps = []
    for r, size in runs:
        assert r["size"] == size
        assert sorted(r["schedulers"]) == ["CosineAnnealingLR", "LambdaLR", "OneCycleLR", "StepLR"]
        for name, rates in r["schedulers"].items():
            for t, lr in rates:
                ramp = float(np.interp(t, [0, r["warmup"]], [1, size]))  # linear rule: base -> base x size
                expected = r["base"] * scheduled(name, t, r["total_steps"]) * ramp
                assert lr == pytest.approx(expected, rel=1e-6), (name, size, t, lr, expected)
            steps.append((name, [t for t, _ in rates]))
    # the steps continue across the resizes: 4 at np=2, 8 alone, 4 at np=2 again
    for name in runs[0][0]["schedulers"]:
        assert [t for n, ts in steps if n == name for t in ts] == list(range(16)), name


def test_resumed_tensorflow_and_keras_warmups_continue_at_the_new_worlds_rate(chain):
    """A warmup (a custom loop's DistributedOptimizer, and model.fit's with hvdp.keras.callbacks resuming its
    checkpoints) carried through np=2 -> 1 -> 2: every step moves the weight by the rate of the
    uninterrupted ramp at that step, scaled for the world it runs in."""
    runs = chain("tensorflow")
    for key in ("warmup_rates", "fit_rates"):
        steps = []
        for r, size in runs:
            for t, moved in r[key]:
                expected = r["base"] * float(np.interp(t, [0, r["warmup"]], [1, size]))
                assert moved == pytest.approx(expected, rel=1e-5), (key, size, t, moved, expected)
                steps.append(t)
        assert steps == list(range(16)), (key, steps)  # 4 steps at np=2, 8 alone, 4 at np=2 again
