"""`hvdp verify` explains what it cannot prove: random layers are made deterministic for the check (and it says
which and why), and a FAIL names the weight that differs most and the likely causes it can see.

The model and data factories below are what the launched ranks load (`--model tests.test_verify_explain:NAME`);
they import only torch or Keras, inside the factory."""

import re

import pytest

from hvdp.tools import equivalence
from tests.test_cli import _verdict, hvdp


def torch_with_dropout():
    """Every kind of torch dropout, in training mode: the ranks draw their own masks."""
    from torch import nn
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Dropout2d(0.3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 16),
                         nn.AlphaDropout(0.2), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 4), nn.Dropout(0.0))


def keras_with_noise():
    """Keras's random layers: a random augmentation, SpatialDropout2D, GaussianNoise and Dropout."""
    import keras
    return keras.Sequential([keras.Input((4, 4, 2)), keras.layers.RandomFlip(seed=3), keras.layers.SpatialDropout2D(0.3),
                             keras.layers.GaussianNoise(0.2), keras.layers.Flatten(), keras.layers.Dense(8, "tanh"),
                             keras.layers.Dropout(0.5), keras.layers.Dense(4)])


def unseeded_data():
    """The DDP tutorial's mistake: data drawn from an unseeded random generator, so every rank makes its own."""
    import numpy as np
    return np.random.rand(200, 20).astype("float32"), np.random.randint(0, 4, 200)


def test_verify_makes_torch_dropout_deterministic_and_says_why():
    # Before: FAIL at 0.05 with no word of why (each rank draws its own dropout masks).
    proc = hvdp("verify", "--framework", "torch", "--np", "2", "--model", "tests.test_verify_explain:torch_with_dropout",
                "--input-shape", "1,6,6", "--optimizer", "adam")
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, proc.stdout + proc.stderr
    assert verdict["deterministic_layers"] == ["1 (Dropout2d p=0.3: eval mode)", "5 (AlphaDropout p=0.2: eval mode)",
                                               "7 (Dropout p=0.5: eval mode)"], verdict
    note = next(line for line in proc.stdout.splitlines() if "note: random layers made deterministic" in line)
    assert "7 (Dropout p=0.5: eval mode)" in note and "drawn on each rank from its own random stream" in note, note


def test_verify_makes_keras_random_layers_deterministic():
    proc = hvdp("verify", "--framework", "keras", "--np", "2", "--model", "tests.test_verify_explain:keras_with_noise",
                "--input-shape", "4,4,2")
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"] and verdict["max_abs_diff"] <= 1e-5, proc.stdout + proc.stderr
    kinds = [re.search(r"\((\w+)", entry).group(1) for entry in verdict["deterministic_layers"]]
    assert kinds == ["RandomFlip", "SpatialDropout2D", "GaussianNoise", "Dropout"], verdict["deterministic_layers"]
    assert "made deterministic" in proc.stdout


def test_verify_names_per_rank_data():
    # Each rank draws its own data (unseeded numpy): the FAIL says so (before, shard() refused it with a ConfigError
    # and verify ended in a traceback; before that shard() check, it FAILed with no word of why).
    proc = hvdp("verify", "--framework", "torch", "--np", "2", "--gloo", "--data", "tests.test_verify_explain:unseeded_data")
    verdict = _verdict(proc)
    assert proc.returncode == 1 and not verdict["ok"] and verdict["data_identical"] is False, verdict
    assert verdict["causes"][0].startswith("per-rank data:"), verdict["causes"]
    assert "likely cause: per-rank data: the training data differs between the ranks" in proc.stdout
    assert "rank(s) 1 made other data than rank 0; nothing was trained" in verdict["data_problem"], verdict


def _result(**fields):
    base = {"size": 2, "steps": 5, "data_identical": True, "data_problem": None, "plain_batchnorm": [],
            "unfrozen_after_prepare": [], "added_after_prepare": [], "no_grad": {}}
    return {**base, **fields}


@pytest.mark.parametrize("fields,expected", [
    ({}, []),
    ({"data_identical": False}, ["per-rank data"]),
    ({"data_problem": "in step 2 the ranks trained on samples ..."}, ["the samples"]),
    ({"plain_batchnorm": ["1"]}, ["BatchNorm without SyncBatchNorm"]),
    ({"plain_batchnorm": ["1"], "size": 1}, []),  # one rank normalises the whole batch
    ({"unfrozen_after_prepare": ["head.weight"]}, ["a parameter without a gradient hook"]),
    ({"added_after_prepare": ["mid.weight"]}, ["a parameter added after prepare()"]),
    ({"no_grad": {"experts.3.weight": 2}}, ["a parameter that got no gradient"]),
    ({"data_identical": False, "no_grad": {"w": 1}}, ["per-rank data", "a parameter that got no gradient"]),
])
def test_explain_names_the_causes_it_sees(fields, expected):
    causes = equivalence.explain(_result(**fields))
    assert [c.split(":")[0] for c in causes] == expected, causes
    for cause, value in zip(causes, fields.values()):
        if isinstance(value, list):
            assert value[0] in cause, cause  # the layer or parameter is named
