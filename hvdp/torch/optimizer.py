"""prepare(): the learning-rate scaling and warmup, Horovod's DistributedOptimizer, the step hooks and
current_lr(); _rescale_groups for a resumed or resized run."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from hvdp import _horovod
from hvdp.core.errors import ConfigError
from hvdp.core.scaling import lr_multiplier, rescale_lr, warmup_factor
from hvdp.core.watchdog import WAITING
from hvdp.core.world import elastic
from hvdp.torch.collectives import _check_same_model, broadcast
from hvdp.torch.runtime import COMPUTING, _plain, hvd, init
from hvdp.torch.sync_batchnorm import _convert_sync_batchnorm
from hvdp.torch.weights import _Batch, _gradient_hook

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


@dataclass(slots=True)
class _Schedule:
    """The LR scaling attached to a prepared optimizer; `step` counts optimizer steps taken."""

    multiplier: float
    warmup_steps: int
    rule: str = "linear"
    passes: int = 1         # backward passes (batches) per optimizer step
    op: str = "average"
    step: int = 0
    on_step: Any = None     # called with `passes` after each step (an ElasticState counting batches)
    depth: int = 0          # step() nests (Horovod's step calls the base step): act on the outer one
    saved: tuple = ()


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lr_scaling: str = "linear",
            warmup_steps: int = 0, compression: str = "none", op: str = "average",
            backward_passes_per_step: int = 1, sync_batchnorm: bool = False) -> torch.optim.Optimizer:
    """Make `optimizer` data-parallel; return the optimizer to use from now on.

    - scales every param group's learning rate by the rule (see hvdp.core.scaling) and, with
      `warmup_steps`, ramps it from the base rate over that many optimizer steps;
    - wraps it in Horovod's DistributedOptimizer (gradients averaged across ranks, fp16 compression or
      Adasum when asked); with `backward_passes_per_step=k` gradients of k backward passes are averaged
      (not summed), so k passes of batch b equal one pass of batch k*b;
    - broadcasts parameters, buffers and optimizer state from rank 0, so all replicas start identical.

    Every rank must call it, with the same model (it broadcasts, and first checks that every rank built the
    same parameter names and shapes). Calls init() if Horovod is not initialised yet. Under elastic
    horovodrun nothing is broadcast here: ElasticState.sync() does it with the ranks there are then.

    Gradient clipping: call `optimizer.synchronize()`, clip, then step inside
    `with optimizer.skip_synchronize(): optimizer.step()` (see docs/pytorch.md).

    Args:
        model: the module whose parameters `optimizer` updates; broadcast from rank 0.
        optimizer: a torch optimizer over `model`'s parameters, with the base learning rate (the one tuned
            for the per-rank batch on one process). Its param groups are scaled in place.
        lr_scaling: "linear" (default: x size*k), "sqrt" (x sqrt(size*k)) or "none"; ignored with "adasum".
        warmup_steps: optimizer steps over which the rate ramps from the base to the scaled one (default 0).
        compression: "none" (default) or "fp16" (gradients sent as float16).
        op: the gradient reduction: "average" (default), "sum", or "adasum" (needs the MPI controller).
        backward_passes_per_step: k >= 1 (default 1): backward passes accumulated per optimizer step.
        sync_batchnorm: replace the model's BatchNorm layers in place by SyncBatchNorm (default False).

    Returns:
        Horovod's DistributedOptimizer wrapping `optimizer`; call step() and zero_grad() on it.

    Raises:
        ConfigError: an unknown `op`, `compression` or `lr_scaling`; `backward_passes_per_step` not an
            integer >= 1; `warmup_steps` < 0; op="adasum" in a multi-rank job on Gloo.
        DivergenceError: the ranks built models of different parameter names or shapes (on every rank).
    """
    model = _plain(model)
    if op not in _OPS:
        raise ConfigError(f"op={op!r} is not one of {', '.join(_OPS)}")
    if compression not in _COMPRESSIONS:
        raise ConfigError(f"compression={compression!r} is not one of {', '.join(_COMPRESSIONS)}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not hvd.is_initialized():
        init()
    if op == "adasum" and hvd.size() > 1 and not hvd.mpi_enabled():
        raise ConfigError("op='adasum' needs Horovod's MPI controller, and this job runs on Gloo: launch "
                          "with `horovodrun` without --gloo (or mpirun), or use op='average'", rank=hvd.rank())
    if sync_batchnorm:
        _convert_sync_batchnorm(model)
    multiplier = lr_multiplier(lr_scaling, hvd.size(), backward_passes_per_step=backward_passes_per_step, op=op)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * multiplier
    # Each gradient is divided by k (k passes are averaged) and weighted at an epoch's uneven end (see
    # _Batch). A model prepared again (a new optimizer, a new k) must not keep the old hooks: they would compound.
    for handle in getattr(model, "_hvdp_accumulation_hooks", ()):
        handle.remove()
    _Batch.lookahead = max(_Batch.lookahead, backward_passes_per_step)
    model._hvdp_accumulation_hooks = [p.register_hook(_gradient_hook(backward_passes_per_step))
                                      for p in model.parameters() if p.requires_grad]
    dist = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=_COMPRESSIONS[compression],
        op=_OPS[op], backward_passes_per_step=backward_passes_per_step)
    if not elastic():
        _check_same_model(model)
        broadcast(model, dist)  # under elastic, ElasticState.sync() does it, with the ranks there are then
    schedule = _Schedule(multiplier=multiplier, warmup_steps=warmup_steps, rule=lr_scaling,
                         passes=backward_passes_per_step, op=op)
    dist.hvdp_schedule = schedule
    dist.zero_grad = types.MethodType(_zero_grad, dist)
    dist.register_step_pre_hook(_pre_step_hook)
    dist.register_step_post_hook(_post_step_hook)
    return dist


def _zero_grad(optimizer, set_to_none: bool = True):
    # Horovod's zero_grad() takes no arguments (horovod#4026), so `zero_grad(set_to_none=True)` raised
    # TypeError. Keep its race guard and pass the argument on to torch's Optimizer.zero_grad.
    if optimizer._handles:
        raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                             "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
    return torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)


def _pre_step_hook(optimizer, args, kwargs):
    # Horovod's step() calls the wrapped optimizer's step(), which runs the hooks again: act on the outer call.
    s = optimizer.hvdp_schedule
    if s.depth == 0:
        _horovod.progress(s.step, WAITING)
        factor = warmup_factor(s.step, s.warmup_steps, s.multiplier)
        if factor != 1.0:
            s.saved = tuple(g["lr"] for g in optimizer.param_groups)
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * factor
    s.depth += 1


def _post_step_hook(optimizer, args, kwargs):
    s = optimizer.hvdp_schedule
    s.depth = max(0, s.depth - 1)
    if s.depth:
        return
    for g, lr in zip(optimizer.param_groups, s.saved):
        g["lr"] = lr
    s.saved = ()
    s.step += 1
    if s.on_step is not None:
        s.on_step(s.passes)
    _horovod.progress(s.step, COMPUTING)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next step() will use (first param group), warmup included.

    Args:
        optimizer: the optimizer prepare() returned; for any other, its first group's "lr" as it is.
    """
    s = getattr(optimizer, "hvdp_schedule", None)
    lr = optimizer.param_groups[0]["lr"]
    return lr if s is None else lr * warmup_factor(s.step, s.warmup_steps, s.multiplier)


def _rescale_groups(optimizer: torch.optim.Optimizer, old_multiplier: float, new_multiplier: float) -> None:
    # A restored param group holds base x the multiplier of the world it was saved in; this world's differs.
    for group in optimizer.param_groups:
        group["lr"] = rescale_lr(group["lr"], old_multiplier, new_multiplier)
