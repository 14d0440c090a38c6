import itertools
import math

import numpy as np
import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.scaling import learning_rate, lr_multiplier

BASE = 0.05


def reference_update(step, *, rule, op, k, warmup, size):
    """What one optimizer step moves the weights by, per unit of the ranks' *average* gradient, written from
    the rules as users read them (docs/pytorch.md's table), not from hvdp.core.scaling: the rule's rate for
    the global batch, reached by a straight line from the base rate over the warmup."""
    if rule == "none" or op == "adasum":
        target = 1.0
    else:
        target = {"linear": size * k, "sqrt": math.sqrt(size * k)}[rule]
    if rule == "none" and op == "sum":
        return BASE * size  # "none" leaves the rate alone, so the summed gradient moves N times as far
    return float(np.interp(step, [0, warmup], [BASE, BASE * target])) if warmup else BASE * target


def moved(rate, op, size):
    """The move per unit of average gradient when the optimizer applies `rate` to the reduced gradient."""
    return rate * (size if op == "sum" else 1)


RULES, OPS, KS, WARMUPS = ("linear", "sqrt", "none"), ("average", "sum", "adasum"), (1, 2, 3), (0, 1, 5)
RESIZES = [(1, 1), (2, 2), (4, 4), (2, 1), (1, 2), (8, 3), (3, 8), (4, 2)]


@pytest.mark.parametrize("rule,op,k,warmup", list(itertools.product(RULES, OPS, KS, WARMUPS)))
@pytest.mark.parametrize("saved,resumed", RESIZES)
def test_learning_rate_every_rule_op_accumulation_warmup_and_resize(rule, op, k, warmup, saved, resumed):
    """A run scales the base rate for `saved` ranks; its rate is saved and resumed at `resumed` ranks (the same
    world when equal). Every step's move along the average gradient is the reference's for that world."""
    kw = dict(rule=rule, backward_passes_per_step=k, op=op, warmup_steps=warmup)
    steps = sorted({0, 1, max(warmup - 1, 0), warmup, warmup + 3})
    for s in steps:
        rate = learning_rate(BASE, s, size=saved, **kw)
        assert moved(rate, op, saved) == pytest.approx(
            reference_update(s, rule=rule, op=op, k=k, warmup=warmup, size=saved), rel=1e-12), s
    # what a param group holds (the rate after warmup) and a checkpoint records with it: its multiplier
    group = learning_rate(BASE, 0, size=saved, rule=rule, backward_passes_per_step=k, op=op)
    carried = lr_multiplier(rule, saved, backward_passes_per_step=k, op=op)
    assert group == pytest.approx(BASE * carried, rel=1e-12)
    for s in steps:
        rate = learning_rate(group, s, size=resumed, scaled_by=carried, **kw)
        assert moved(rate, op, resumed) == pytest.approx(
            reference_update(s, rule=rule, op=op, k=k, warmup=warmup, size=resumed), rel=1e-12), (s, saved, resumed)


@pytest.mark.parametrize("rule,op,k", list(itertools.product(RULES, OPS, KS)))
@pytest.mark.parametrize("size", [1, 2, 4, 7])
def test_warmup_ramp_follows_the_effective_rate(rule, op, k, size):
    # issue 29: with op="sum" the ramp was skipped (linear) or ran backwards (sqrt): it goes from base (step 0)
    # up to the rule's effective rate, never down, whatever the reduction
    moves = [moved(learning_rate(BASE, s, rule=rule, size=size, backward_passes_per_step=k, op=op, warmup_steps=10),
                   op, size) for s in range(15)]
    if rule == "none" and op == "sum":
        assert moves == [BASE * size] * 15
        return
    assert moves[0] == pytest.approx(BASE)
    assert all(b >= a for a, b in zip(moves, moves[1:])), moves
    assert moves[10:] == [moves[-1]] * 5
    assert moves[-1] == pytest.approx(reference_update(99, rule=rule, op=op, k=k, warmup=10, size=size))


def test_a_rate_already_scaled_for_this_world_comes_back_unchanged():
    # the step hooks rely on it: past the warmup the group's rate is used as it is, bit for bit
    for rule, op, size, k in itertools.product(RULES, OPS, (1, 2, 3, 8), (1, 3)):
        m = lr_multiplier(rule, size, backward_passes_per_step=k, op=op)
        lr = BASE * m
        assert learning_rate(lr, 7, rule=rule, size=size, backward_passes_per_step=k, op=op, warmup_steps=5,
                             scaled_by=m) is lr


@pytest.mark.parametrize("rule,size,k,expected", [
    ("linear", 1, 1, 1.0), ("linear", 8, 1, 8.0), ("linear", 4, 2, 8.0),
    ("sqrt", 4, 1, 2.0), ("sqrt", 2, 8, 4.0), ("none", 64, 4, 1.0),
])
def test_lr_multiplier(rule, size, k, expected):
    assert lr_multiplier(rule, size, backward_passes_per_step=k) == pytest.approx(expected)


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


def test_adasum_needs_no_rescaling():
    assert lr_multiplier("linear", 8, op="adasum") == 1.0
    assert learning_rate(BASE, 0, rule="sqrt", size=8, op="adasum", warmup_steps=10) == BASE


@pytest.mark.parametrize("bad,match", [
    (dict(rule="cubic"), "unknown lr_scaling='cubic'"), (dict(op="max"), "unknown op='max'"),
    (dict(size=0), "size (0)"), (dict(backward_passes_per_step=0), "backward_passes_per_step (0)"),
    (dict(step=-1), "step (-1)"), (dict(warmup_steps=-2), "warmup_steps (-2)"),
    (dict(scaled_by=0.0), "must be > 0, got 0.0")])
def test_learning_rate_rejects(bad, match):
    kw = dict(rule="linear", size=2, step=0) | bad
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        learning_rate(BASE, kw.pop("step"), **kw)


# ------------------------------------------------------------------ what prepare() says it did to the rate

from hvdp.core.scaling import adaptive_warning, describe_scaling  # noqa: E402


@pytest.mark.parametrize("kw, line", [
    (dict(rule="linear", size=2, warmup_steps=5), "lr 0.03 -> 0.06 (lr_scaling='linear': x2 for 2 rank(s) x 1 pass(es)), "
                                                  "warmup from 0.03 over 5 step(s)"),
    (dict(rule="linear", size=4, op="sum"), "lr 0.03 -> 0.03 (lr_scaling='linear': x4 for 4 rank(s) x 1 pass(es), / 4 for "
                                            "op='sum' (the summed gradient is 4 x the average))"),
    (dict(rule="sqrt", size=2, backward_passes_per_step=2), "lr 0.03 -> 0.06 (lr_scaling='sqrt': x2 for 2 rank(s) x 2 pass(es))"),
    (dict(rule="none", size=8), "lr 0.03 -> 0.03 (lr_scaling='none')"),
    (dict(rule="linear", size=8, op="adasum", warmup_steps=3), "lr 0.03 -> 0.03 (lr_scaling='linear', op='adasum' needs none)"),
])
def test_the_rate_change_is_said_in_numbers(kw, line):
    assert describe_scaling(0.03, **kw) == line


@pytest.mark.parametrize("name, kw, warns", [
    ("Adam", dict(rule="linear", size=2), True),
    ("AdamW", dict(rule="linear", size=1, backward_passes_per_step=4), True),
    ("RMSprop", dict(rule="linear", size=8), True),
    ("SGD", dict(rule="linear", size=8), False),
    ("Adam", dict(rule="sqrt", size=8), False),
    ("Adam", dict(rule="linear", size=1), False),
    ("Adam", dict(rule="linear", size=8, op="adasum"), False),
])
def test_linear_scaling_of_an_adaptive_optimizer_is_warned_with_the_way_out(name, kw, warns):
    message = adaptive_warning(name, **kw)
    assert (message is not None) == warns
    if warns:
        assert name in message and "lr_scaling='sqrt'" in message and "LRScalingWarning" in message
