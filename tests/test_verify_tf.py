"""`hvdp verify --framework keras|tensorflow` as a user runs it."""

import pytest

from tests.test_cli import _verdict, hvdp


@pytest.mark.parametrize("framework,args,size,leftover", [
    ("keras", ["--np", "2"], 2, 15),
    ("tensorflow", ["--np", "2", "--gloo", "--optimizer", "adam", "--accumulate", "2", "--lr", "0.005"], 2, 15),
    # alone: 3 passes per step, the epoch's last step one batch of 5 samples: its gradient must be their mean,
    # applied at the epoch's end (flush), not a third of it joined to a next step that never comes
    ("keras", ["--np", "1", "--optimizer", "adam", "--accumulate", "3", "--leftover", "5", "--lr", "0.005"], 1, 5),
])
def test_verify_passes(framework, args, size, leftover):
    # By default the data ends with a short step the ranks split unevenly (N*b - 1 samples), compared too.
    proc = hvdp("verify", "--framework", framework, *args)
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"], verdict
    assert verdict["framework"] == framework and verdict["size"] == size
    assert verdict["leftover"] == leftover and verdict["steps"] == 6, verdict
    assert verdict["max_abs_diff"] <= 1e-5 and verdict["replicas_identical"]
    assert verdict["optimizer_class"] == ("Adam" if "adam" in args else "SGD"), verdict


@pytest.mark.parametrize("args,ok", [
    # AdamW, 2 passes accumulated per step (eager on torch), the epoch's odd last pass a step of its own (flush)
    (["--np", "2", "--gloo", "--optimizer", "adamw", "--lr", "0.005", "--accumulate", "2"], True),
    # the broken variant: per-rank BatchNormalization statistics must FAIL (MPI). One FAIL case serves both
    # backends: the comparison (_keras_result) is the same code on each, only the training differs
    (["--np", "2", "--model", "tests.fixtures.keras_models:with_batchnorm"], False),
])
def test_verify_keras_on_the_torch_backend(args, ok):
    # fit on Keras's torch backend (gradients through horovod.torch) against one process on the same backend,
    # the epoch's short last step (15 samples split unevenly) included
    proc = hvdp("verify", "--framework", "keras", "--keras-backend", "torch", *args)
    verdict = _verdict(proc)
    assert verdict["framework"] == "keras" and verdict["keras_backend"] == "torch" and verdict["size"] == 2, verdict
    assert verdict["leftover"] == 15 and verdict["steps"] == 6, verdict
    if ok:
        assert proc.returncode == 0 and verdict["ok"], verdict
        assert verdict["max_abs_diff"] <= 1e-5 and verdict["replicas_identical"], verdict
        assert verdict["optimizer_class"] == "AdamW", verdict  # the one asked for, not SGD in its place
        assert "Keras on torch" in proc.stdout and "PASS" in proc.stdout
    else:
        assert proc.returncode != 0 and not verdict["ok"] and verdict["max_abs_diff"] > 1e-4, verdict
        assert "FAIL" in proc.stdout


def test_verify_keras_backend_refusals(capsys):
    from hvdp.tools import cli
    assert cli.main(["verify", "--framework=torch", "--keras-backend=torch"]) == 2
    assert "--keras-backend is for --framework keras only" in capsys.readouterr().err
