"""`hvdp verify --framework keras|tensorflow` as a user runs it."""

import pytest

from tests.test_cli import _verdict, hvdp


@pytest.mark.parametrize("framework,args", [
    ("keras", ["--np", "2"]),
    ("tensorflow", ["--np", "2", "--gloo", "--optimizer", "adam", "--accumulate", "2", "--lr", "0.005"]),
])
def test_verify_passes(framework, args):
    proc = hvdp("verify", "--framework", framework, *args)
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"], verdict
    assert verdict["framework"] == framework and verdict["size"] == 2
    assert verdict["max_abs_diff"] <= 1e-5 and verdict["replicas_identical"]


def test_verify_keras_catches_a_non_equivalent_model():
    # Per-rank BatchNormalization statistics differ from the big batch's: verify must say so and exit non-zero.
    proc = hvdp("verify", "--framework", "keras", "--np", "2", "--model", "tests.fixtures.keras_models:with_batchnorm")
    verdict = _verdict(proc)
    assert proc.returncode != 0 and not verdict["ok"] and verdict["max_abs_diff"] > 1e-4, verdict
    assert "FAIL" in proc.stdout
