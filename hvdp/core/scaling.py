"""Learning-rate scaling for large effective batches: the linear rule with gradual warmup (Goyal et al. 2017).

With N ranks, per-rank batch b and k accumulated backward passes, one optimizer step sees N*k*b samples.
The base learning rate is the one tuned for batch b on one process. The effective rate, the step taken
along the *average* gradient, grows by the rule:

    linear  base * N*k        (Goyal et al. 2017; what Horovod's examples do by hand)
    sqrt    base * sqrt(N*k)  (Krizhevsky 2014; often better for Adam-like optimizers)
    none    base

Warmup ramps the effective rate linearly from the base rate (step 0) to the rule's (step warmup_steps).
What the optimizer is given is the effective rate divided by how much larger the reduced gradient is than
the average: op="sum" all-reduces the sum of the N ranks' gradients, N times their average, so its rate is
the effective one / N (linear: base * k; not base * N*k, which would be N^2 times the intended step), and
its warmup ramp still runs from base to the rule's effective rate. Adasum combines gradients so that no
rescaling is needed: base, no ramp, whatever the rule. lr_scaling="none" leaves the rate as given
whatever the op.

learning_rate() is the one formula: the step hooks, checkpoint loading, an elastic reset and the
TensorFlow/Keras schedules all call it (a rate scaled for one world is rescaled for another through it).
"""

from __future__ import annotations

import math

from hvdp.core.errors import ConfigError

LR_RULES = ("linear", "sqrt", "none")
LR_OPS = ("average", "sum", "adasum")


def _factors(rule: str, size: int, passes: int, op: str) -> tuple[float, float]:
    """(the effective multiplier of the average gradient's rate, how much larger the reduced gradient is)."""
    if rule not in LR_RULES:
        raise ConfigError(f"unknown lr_scaling={rule!r}; choose one of {', '.join(LR_RULES)}")
    if op not in LR_OPS:
        raise ConfigError(f"unknown op={op!r}; choose one of {', '.join(LR_OPS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 \
            or isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"size ({size!r}) and backward_passes_per_step ({passes!r}) must be integers >= 1")
    if op == "adasum" or rule == "none":
        return 1.0, 1.0
    batches = size * passes
    return (float(batches) if rule == "linear" else math.sqrt(batches)), (float(size) if op == "sum" else 1.0)


def learning_rate(lr, step: int, *, rule: str, size: int, backward_passes_per_step: int = 1,
                  op: str = "average", warmup_steps: int = 0, scaled_by: float = 1.0):
    """The rate an optimizer takes at optimizer step `step` in a world of `size` ranks.

    The effective rate (along the average gradient) is base x the rule's multiplier (linear N*k, sqrt
    sqrt(N*k), none 1), ramped linearly from base x 1 at step 0 to it at `warmup_steps`; the rate returned
    is that divided by N for op="sum" (the summed gradient is N times the average). Adasum and
    lr_scaling="none": base throughout.

    `lr` may already carry a multiplier: a param group's rate holds its world's lr_multiplier, and one
    restored from a checkpoint or from another rank after an elastic reset holds the multiplier of the world
    it was scaled for (what the checkpoint recorded). `scaled_by` says which; the result is the same rate
    rescaled for this world. So `learning_rate(group_lr, s, ..., scaled_by=lr_multiplier(...this world))`
    is the warmup applied to a group's rate, and `learning_rate(saved, 0, ..., scaled_by=saved_multiplier)`
    a saved rate resumed at `size`.

    Args:
        lr: the rate: the base rate (tuned for the per-rank batch on one process) with scaled_by=1.0; or a
            float (or 0-dim tensor) scaled by `scaled_by`. A schedule's value at `step` works alike.
        step: the optimizer step (not backward passes), >= 0; only the warmup depends on it.
        rule: "linear", "sqrt" or "none"; see LR_RULES.
        size: the number of ranks N, >= 1.
        backward_passes_per_step: k, the backward passes accumulated per optimizer step, >= 1 (default 1).
        op: the gradient reduction: "average" (default), "sum" or "adasum"; see LR_OPS.
        warmup_steps: the ramp's length in optimizer steps, >= 0 (default 0: none).
        scaled_by: the multiplier `lr` already carries, > 0 (default 1.0: `lr` is the base rate).

    Returns:
        The rate, of `lr`'s type; `lr` itself when it is already the rate of this world and step.

    Raises:
        ConfigError: an unknown `rule` or `op`; `size` or `backward_passes_per_step` < 1; `step` or
            `warmup_steps` < 0; `scaled_by` not > 0.
    """
    effective, reduction = _factors(rule, size, backward_passes_per_step, op)
    if warmup_steps < 0 or step < 0:
        raise ConfigError(f"step ({step}) and warmup_steps ({warmup_steps}) must be >= 0")
    if not scaled_by > 0:
        raise ConfigError(f"the multiplier a rate carries must be > 0, got {scaled_by}")
    if warmup_steps and step < warmup_steps:
        effective = 1.0 + (effective - 1.0) * step / warmup_steps
    factor = effective / reduction
    return lr if factor == scaled_by else lr * (factor / scaled_by)


def lr_multiplier(rule: str, size: int, *, backward_passes_per_step: int = 1, op: str = "average") -> float:
    """What a base rate is multiplied by for `size` ranks each accumulating `backward_passes_per_step`, after
    any warmup: learning_rate(1.0, ...) past the ramp. A rate scaled for a world carries this multiplier.

    Args:
        rule: "linear" (x size*k), "sqrt" (x sqrt(size*k)) or "none" (x 1); see LR_RULES.
        size: the number of ranks, >= 1.
        backward_passes_per_step: k, the backward passes accumulated per optimizer step, >= 1 (default 1).
        op: the gradient reduction. "average" (default) applies the rule; "sum" divides the rule's factor
            by `size`, because the summed gradient is already `size` times the average; "adasum" needs no
            rescaling, so its multiplier is 1 whatever the rule.

    Returns:
        The multiplier, a float > 0 (>= 1 unless op is "sum").

    Raises:
        ConfigError: an unknown `rule` or `op`, or `size` or `backward_passes_per_step` < 1.
    """
    return learning_rate(1.0, 0, rule=rule, size=size, backward_passes_per_step=backward_passes_per_step, op=op)


# Optimizers that adapt each parameter's step to its gradients' scale: the linear rule often overshoots them.
ADAPTIVE = ("adam", "adamw", "adamax", "nadam", "radam", "adagrad", "adadelta", "adafactor", "rmsprop", "lion",
            "lamb", "sparseadam", "ftrl")


class LRScalingWarning(UserWarning):
    """The linear rule met an adaptive optimizer (Adam...): silence it with
    warnings.filterwarnings("ignore", category=hvdp.core.scaling.LRScalingWarning)."""


def describe_scaling(base: float, *, rule: str, size: int, backward_passes_per_step: int = 1, op: str = "average",
                     warmup_steps: int = 0) -> str:
    """The line prepare()/DistributedOptimizer log on rank 0: what they did to the rate, in numbers.

    Args:
        base: the first param group's base rate, as the user gave it.
        rule: "linear", "sqrt" or "none".
        size: the number of ranks N.
        backward_passes_per_step: k.
        op: the reduction ("average", "sum" or "adasum").
        warmup_steps: the ramp's length in optimizer steps.

    Returns:
        e.g. "lr 0.03 -> 0.06 (lr_scaling='linear': x2 for 2 ranks x 1 pass, op='average'), warmup from 0.03
        over 5 steps".

    Raises:
        ConfigError: an unknown rule or op, or size/k < 1 (see learning_rate).
    """
    after = learning_rate(base, warmup_steps, rule=rule, size=size, backward_passes_per_step=backward_passes_per_step,
                          op=op, warmup_steps=warmup_steps)
    effective, _ = _factors(rule, size, backward_passes_per_step, op)
    why = (f"lr_scaling={rule!r}: x{effective:g} for {size} rank(s) x {backward_passes_per_step} pass(es)"
           if effective != 1.0 else f"lr_scaling={rule!r}" + (", op='adasum' needs none" if op == "adasum" else ""))
    if op == "sum" and effective != 1.0:
        why += f", / {size} for op='sum' (the summed gradient is {size} x the average)"
    ramp = (f", warmup from {learning_rate(base, 0, rule=rule, size=size, backward_passes_per_step=backward_passes_per_step, op=op, warmup_steps=warmup_steps):g} "
            f"over {warmup_steps} step(s)") if warmup_steps and effective != 1.0 else ""
    return f"lr {base:g} -> {after:g} ({why}){ramp}"


def adaptive_warning(optimizer_name: str, *, rule: str, size: int, backward_passes_per_step: int = 1,
                     op: str = "average") -> str | None:
    """The warning for the linear rule on an adaptive optimizer at more than one batch per step, or None.

    Args:
        optimizer_name: the optimizer's class name (Adam, AdamW, RMSprop...).
        rule: the lr_scaling rule.
        size: the number of ranks N.
        backward_passes_per_step: k.
        op: the reduction; Adasum needs no scaling, so no warning.
    """
    if rule != "linear" or op == "adasum" or size * backward_passes_per_step == 1 \
            or optimizer_name.lower() not in ADAPTIVE:
        return None
    return (f"{optimizer_name} with lr_scaling='linear' multiplies its rate by {size * backward_passes_per_step} "
            f"({size} rank(s) x {backward_passes_per_step} pass(es)); adaptive optimizers often train worse at that "
            f"rate: consider lr_scaling='sqrt' or a warmup (warmup_steps=...). To keep linear and silence this: "
            f"warnings.filterwarnings('ignore', category=hvdp.core.scaling.LRScalingWarning)")


__all__ = ["LR_RULES", "LR_OPS", "learning_rate", "lr_multiplier", "ADAPTIVE", "LRScalingWarning", "describe_scaling",
           "adaptive_warning"]
