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


def test_verify_keras_catches_a_non_equivalent_model():
    # Per-rank BatchNormalization statistics differ from the big batch's: verify must say so and exit non-zero.
    proc = hvdp("verify", "--framework", "keras", "--np", "2", "--model", "tests.fixtures.keras_models:with_batchnorm")
    verdict = _verdict(proc)
    assert proc.returncode != 0 and not verdict["ok"] and verdict["max_abs_diff"] > 1e-4, verdict
    assert "FAIL" in proc.stdout
