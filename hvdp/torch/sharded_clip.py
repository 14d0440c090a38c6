"""torch.nn.utils's clipping functions guarded for hvdp.torch.sharded (ZeRO-2): between a sharded optimizer's
backward pass and its step() the averaged gradients are in the shards and the model's .grad are None, so
torch's own clip_grad_norm_(model.parameters()) would clip nothing, silently. Guarded, it clips the shards by the
norm across all of them (the optimizer's clip_grad_norm_), clip_grad_value_ clamps them, and a call that cannot
be right (part of the parameters, error_if_nonfinite=True, the scaling function imported by name) is a
ConfigError on every rank. ShardedOptimizer registers itself in LIVE and calls guard_clipping()."""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import TYPE_CHECKING

import torch

from hvdp.core.errors import ConfigError

if TYPE_CHECKING:
    from hvdp.torch.sharded import ShardedOptimizer

LIVE: weakref.WeakSet = weakref.WeakSet()  # every ShardedOptimizer, for the guarded clipping (_guarded)


def _reducing_optimizer(params: list) -> "ShardedOptimizer | None":
    """The sharded optimizer, if any, between its backward pass and its step() that holds one of `params`."""
    ids = {id(p) for p in params}
    for opt in list(LIVE):
        if (opt._started or opt._synchronized) and any(i in opt._bucket_of or i in opt._owned_of for i in ids):
            return opt
    return None


def _refuse_clip(opt: "ShardedOptimizer", why: str, call: str = "clip_grad_norm_") -> None:
    fix = ("Call optimizer.clip_grad_norm_(max_norm) instead (the global norm across the shards)"
           if call == "clip_grad_norm_" else "Give it every parameter of the optimizer (model.parameters())")
    raise ConfigError(f"torch.nn.utils.{call} {why} with shard_optimizer_state=True: the averaged gradients are "
                      f"in the shards and the model's .grad are None. {fix}", rank=opt._rank)


def _whole(opt: "ShardedOptimizer", params: list, call: str) -> None:
    """Refuse (ConfigError) a clip given part of `opt`'s parameters, or them with others that hold gradients."""
    mine = set(opt._bucket_of) | set(opt._owned_of)
    given = {id(p) for p in params}
    if not mine <= given:
        _refuse_clip(opt, f"on {len(mine & given)} of a sharded optimizer's {len(mine)} parameters", call)
    if any(p.grad is not None for p in params if id(p) not in mine):
        _refuse_clip(opt, "on a sharded optimizer's parameters together with others that hold gradients", call)


def _guarded(fn, on_sharded):
    """`fn` (a torch.nn.utils clipping function, called with the parameters first), calling
    `on_sharded(optimizer, params, arguments)` instead where those parameters are a sharded optimizer's in the
    middle of its step (after the backward pass, before step()): their gradients went to the shards (the
    model's are None), so torch's own would clip nothing, silently. `arguments`: the call's, defaults applied."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def guarded(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = _reducing_optimizer(params)
        if opt is None:
            return fn(params, *args, **kwargs)
        call = signature.bind(params, *args, **kwargs)
        call.apply_defaults()
        return on_sharded(opt, params, call.arguments)
    guarded.hvdp_guarded = True
    return guarded


def _clip_norm(opt: "ShardedOptimizer", params: list, arguments: dict) -> torch.Tensor:
    """clip_grad_norm_ on a sharded optimizer's parameters: given every parameter of it (model.parameters(): the
    clipping recipe of the allreduce path), its clip_grad_norm_ (the global norm across the shards; it reduces
    first if synchronize() has not run), returning that norm. Given part of them, them with another model's
    gradients, or error_if_nonfinite=True, ConfigError naming optimizer.clip_grad_norm_. Every rank runs the
    same call, so every rank clips, or raises; nothing collective is left half done."""
    _whole(opt, params, "clip_grad_norm_")
    if arguments.get("error_if_nonfinite"):
        _refuse_clip(opt, "with error_if_nonfinite=True")
    return opt.clip_grad_norm_(arguments["max_norm"], norm_type=float(arguments["norm_type"]))


def _clip_value(opt: "ShardedOptimizer", params: list, arguments: dict) -> None:
    """clip_grad_value_ on a sharded optimizer's parameters: given every parameter of it, its shard gradients
    clamped (reducing first if synchronize() has not run), element by element as torch clamps the full ones, so
    the result is the same; given part of them, ConfigError. No collective beyond the reduction every rank makes."""
    _whole(opt, params, "clip_grad_value_")
    value = float(arguments["clip_value"])
    if not opt._synchronized:
        opt.synchronize()
    with torch.no_grad():
        for g in opt._grads():
            g.clamp_(min=-value, max=value)


def _refuse_scaling(opt: "ShardedOptimizer", params: list, arguments: dict) -> None:
    """torch's _clip_grads_with_norm_ (what clip_grad_norm_ scales the gradients with) on a sharded optimizer's
    parameters: reached only through a clip_grad_norm_ imported by name from torch before the first sharded
    prepare() (the guarded one clips the shards itself), which found no gradient and would clip nothing."""
    _refuse_clip(opt, "imported by name from torch before the first sharded prepare() (or "
                 "torch.nn.utils.clip_grads_with_norm_) clips nothing")


def guard_clipping() -> None:
    """Put guarded versions (_guarded) of torch.nn.utils.clip_grad_norm_ and clip_grad_value_ and of the function
    clip_grad_norm_ scales with in their place (once per process)."""
    import torch.nn.utils.clip_grad as clip_grad
    if not getattr(torch.nn.utils.clip_grad_norm_, "hvdp_guarded", False):
        torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = _guarded(torch.nn.utils.clip_grad_norm_,
                                                                               _clip_norm)
    if not getattr(torch.nn.utils.clip_grad_value_, "hvdp_guarded", False):
        torch.nn.utils.clip_grad_value_ = clip_grad.clip_grad_value_ = _guarded(torch.nn.utils.clip_grad_value_,
                                                                                 _clip_value)
    scale = getattr(clip_grad, "_clip_grads_with_norm_", None)  # torch >= 2.6
    if scale is not None and not getattr(scale, "hvdp_guarded", False):
        clip_grad._clip_grads_with_norm_ = _guarded(scale, _refuse_scaling)
