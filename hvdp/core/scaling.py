"""Learning-rate scaling for large effective batches: the linear rule with gradual warmup (Goyal et al. 2017).

With N ranks, per-rank batch b and k accumulated backward passes, one optimizer step sees N*k*b samples.
The base learning rate is the one tuned for batch b on one process; the rule multiplies it:

    linear  lr = base * N*k        (Goyal et al. 2017; what Horovod's examples do by hand)
    sqrt    lr = base * sqrt(N*k)  (Krizhevsky 2014; often better for Adam-like optimizers)
    none    lr = base

Adasum combines gradients so that no rescaling is needed: its multiplier is 1 whatever the rule.
op="sum" all-reduces the sum of the N ranks' gradients, already N times their average, so the rule's
factor is divided by N: linear gives k (not N*k, which would be N^2 times the intended step), sqrt gives
sqrt(N*k)/N. lr_scaling="none" leaves the rate as given whatever the op.
Warmup ramps linearly from the base rate to the scaled one over `warmup_steps` optimizer steps.
"""

from __future__ import annotations

import math

from hvdp.core.errors import ConfigError

LR_RULES = ("linear", "sqrt", "none")


def lr_multiplier(rule: str, size: int, *, backward_passes_per_step: int = 1, op: str = "average") -> float:
    """How much the base learning rate grows for `size` ranks each accumulating `backward_passes_per_step`.

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
        ConfigError: `rule` is not one of LR_RULES, or `size` or `backward_passes_per_step` is < 1.
    """
    if rule not in LR_RULES:
        raise ConfigError(f"unknown lr_scaling={rule!r}; choose one of {', '.join(LR_RULES)}")
    if size < 1 or backward_passes_per_step < 1:
        raise ConfigError(
            f"size ({size}) and backward_passes_per_step ({backward_passes_per_step}) must be >= 1")
    if op == "adasum" or rule == "none":
        return 1.0
    batches = size * backward_passes_per_step
    factor = float(batches) if rule == "linear" else math.sqrt(batches)
    return factor / size if op == "sum" else factor


def warmup_factor(step: int, warmup_steps: int, multiplier: float) -> float:
    """The fraction of the scaled rate to use at optimizer step `step` (0-based).

    Starts at 1/multiplier (the base rate) and grows linearly to 1 at `warmup_steps`; 1 from then on, and
    throughout without warmup.

    Args:
        step: the optimizer step, >= 0 (optimizer steps, not backward passes).
        warmup_steps: the length of the ramp in optimizer steps, >= 0; 0 means no warmup.
        multiplier: the scaled rate's multiplier (lr_multiplier's result); 1.0 means nothing to ramp.

    Returns:
        A float in [1/multiplier, 1].

    Raises:
        ConfigError: `step` or `warmup_steps` is negative.
    """
    if warmup_steps < 0 or step < 0:
        raise ConfigError(f"step ({step}) and warmup_steps ({warmup_steps}) must be >= 0")
    if warmup_steps == 0 or step >= warmup_steps or multiplier == 1.0:
        return 1.0
    start = 1.0 / multiplier
    return start + (1.0 - start) * step / warmup_steps


def scaled_lr(base_lr: float, step: int, *, multiplier: float, warmup_steps: int = 0) -> float:
    """The learning rate at optimizer step `step`: base_lr * multiplier * warmup_factor(...).

    Args:
        base_lr: the rate tuned for the per-rank batch on one process.
        step: the optimizer step, >= 0.
        multiplier: lr_multiplier's result.
        warmup_steps: the warmup length in optimizer steps (default 0: no warmup).

    Raises:
        ConfigError: from warmup_factor, for a negative `step` or `warmup_steps`.
    """
    return base_lr * multiplier * warmup_factor(step, warmup_steps, multiplier)


def rescale_lr(lr: float, old_multiplier: float, new_multiplier: float) -> float:
    """A rate scaled by `old_multiplier` (another world size) rescaled to `new_multiplier`: base x new.

    What a checkpoint resumed, or an elastic job re-formed, at another world size must do to the rate it
    restores: the saved rate is base x old_multiplier, and the job now runs with new_multiplier.

    Args:
        lr: the restored rate, base x `old_multiplier`.
        old_multiplier: the `lr_multiplier` of the world the rate was scaled for.
        new_multiplier: the `lr_multiplier` of this world.

    Returns:
        base x `new_multiplier`.

    Raises:
        ConfigError: if either multiplier is not > 0.
    """
    if old_multiplier <= 0 or new_multiplier <= 0:
        raise ConfigError(f"LR multipliers must be > 0, got {old_multiplier} and {new_multiplier}")
    return lr / old_multiplier * new_multiplier


__all__ = ["LR_RULES", "lr_multiplier", "warmup_factor", "scaled_lr", "rescale_lr"]
