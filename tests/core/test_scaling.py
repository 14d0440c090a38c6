import math

import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.scaling import lr_multiplier, scaled_lr, warmup_factor


@pytest.mark.parametrize("rule,size,k,expected", [
    ("linear", 1, 1, 1.0), ("linear", 8, 1, 8.0), ("linear", 4, 2, 8.0),
    ("sqrt", 4, 1, 2.0), ("sqrt", 2, 8, 4.0), ("none", 64, 4, 1.0),
])
def test_lr_multiplier(rule, size, k, expected):
    assert lr_multiplier(rule, size, backward_passes_per_step=k) == pytest.approx(expected)


def test_adasum_needs_no_rescaling():
    assert lr_multiplier("linear", 8, op="adasum") == 1.0


@pytest.mark.parametrize("bad", [dict(rule="cubic", size=2), dict(rule="linear", size=0),
                                 dict(rule="linear", size=2, backward_passes_per_step=0)])
def test_lr_multiplier_rejects(bad):
    with pytest.raises(ConfigError):
        lr_multiplier(**bad)


def test_warmup_goes_from_base_to_scaled_linearly():
    # Goyal et al.: 8 ranks, warmup over 100 steps: start at base (1/8 of scaled), end at scaled.
    factors = [warmup_factor(s, 100, 8.0) for s in range(0, 101)]
    assert factors[0] == pytest.approx(1 / 8)
    assert factors[50] == pytest.approx(1 / 8 + (7 / 8) * 0.5)
    assert factors[100] == 1.0
    assert all(b > a for a, b in zip(factors, factors[1:]))
    assert warmup_factor(1000, 100, 8.0) == 1.0


def test_scaled_lr_values():
    assert scaled_lr(0.1, 0, multiplier=4.0, warmup_steps=10) == pytest.approx(0.1)
    assert scaled_lr(0.1, 5, multiplier=4.0, warmup_steps=10) == pytest.approx(0.25)
    assert scaled_lr(0.1, 10, multiplier=4.0, warmup_steps=10) == pytest.approx(0.4)
    assert scaled_lr(0.1, 3, multiplier=4.0) == pytest.approx(0.4)
    assert scaled_lr(0.1, 3, multiplier=math.sqrt(2)) == pytest.approx(0.1 * math.sqrt(2))


def test_warmup_rejects_negative():
    with pytest.raises(ConfigError):
        warmup_factor(-1, 10, 2.0)


@pytest.mark.parametrize("rule, size, k, expected", [
    ("linear", 1, 1, 1.0), ("linear", 4, 1, 1.0), ("linear", 4, 2, 2.0), ("linear", 2, 3, 3.0),
    ("sqrt", 4, 1, 0.5), ("sqrt", 4, 4, 1.0), ("none", 4, 2, 1.0)])
def test_lr_multiplier_sum_counts_the_sum_once(rule, size, k, expected):
    # op="sum" already makes the gradient N times the average; the rule must not multiply by N again (issue 14)
    got = lr_multiplier(rule, size, backward_passes_per_step=k, op="sum")
    assert got == pytest.approx(expected)
    average = lr_multiplier(rule, size, backward_passes_per_step=k, op="average")
    if rule != "none":
        assert got * size == pytest.approx(average)  # same step: sum-gradient * got == average-gradient * average


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (4, 3)])
def test_rescale_lr_gives_base_times_the_new_multiplier(old, new):
    from hvdp.core.scaling import rescale_lr
    saved = 0.05 * lr_multiplier("linear", old)
    assert rescale_lr(saved, lr_multiplier("linear", old), lr_multiplier("linear", new)) == pytest.approx(
        0.05 * lr_multiplier("linear", new))
