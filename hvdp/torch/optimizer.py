"""prepare(): the learning-rate scaling and warmup (hvdp.core.scaling.learning_rate), Horovod's
DistributedOptimizer, the step() and synchronize() that apply the warmup and count steps, current_lr();
_rescale_groups and _rescale_scheduler_states for a resumed or resized run."""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch

from hvdp import _horovod, _stragglers
from hvdp.core.errors import ConfigError
from hvdp.core.scaling import learning_rate, lr_multiplier
from hvdp.core.watchdog import WAITING
from hvdp.core.world import elastic
from hvdp.torch.collectives import _check_same_model, broadcast
from hvdp.torch.runtime import COMPUTING, _plain, hvd, init
from hvdp.torch.sync_batchnorm import _convert_sync_batchnorm
from hvdp.torch.usage import _Usage
from hvdp.torch.weights import _Batch, _gradient_hook

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
# The rates a param group can hold: its own, and those torch's schedulers keep beside it (initial_lr, from which
# they compute; OneCycleLR's max_lr and min_lr). All are scaled for the world the group is in.
_GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")


@dataclass(slots=True)
class _Schedule:
    """The LR scaling attached to a prepared optimizer (hvdp.core.scaling.learning_rate's arguments).

    The param groups hold the rate scaled for `size` ranks after any warmup; each step() applies the warmup
    around the call. `step` counts optimizer steps taken.
    """

    rule: str
    op: str
    passes: int             # backward passes (batches) per optimizer step
    warmup_steps: int
    size: int               # the world the param groups' rates are scaled for
    step: int = 0
    on_step: Any = None     # called with `passes` once per optimizer step, taken or skipped (an ElasticState)
    fresh: bool = False     # gradients arrived since on_step was last called

    @property
    def multiplier(self) -> float:
        """The multiplier the param groups' rates carry (lr_multiplier of this schedule's world)."""
        return lr_multiplier(self.rule, self.size, backward_passes_per_step=self.passes, op=self.op)

    def rate(self, lr, *, step: int | None = None, size: int | None = None, scaled_by: float | None = None):
        """`lr`, carrying `scaled_by` (default: this schedule's multiplier), as the rate for `size` ranks (default:
        this schedule's) at optimizer `step` (default None: after the warmup)."""
        return learning_rate(lr, 0 if step is None else step, rule=self.rule, size=self.size if size is None else size,
                             backward_passes_per_step=self.passes, op=self.op,
                             warmup_steps=0 if step is None else self.warmup_steps,
                             scaled_by=self.multiplier if scaled_by is None else scaled_by)


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lr_scaling: str = "linear",
            warmup_steps: int = 0, compression: str = "none", op: str = "average",
            backward_passes_per_step: int = 1, sync_batchnorm: bool = False,
            shard_optimizer_state: bool = False) -> torch.optim.Optimizer:
    """Make `optimizer` data-parallel; return the optimizer to use from now on.

    - scales every param group's learning rate by the rule (hvdp.core.scaling.learning_rate; the table in
      docs/pytorch.md) and, with `warmup_steps`, ramps the effective rate from the base rate over that many
      optimizer steps, whatever the op (each step() applies the ramp around the call);
    - wraps it in Horovod's DistributedOptimizer (gradients averaged across ranks, fp16 compression or
      Adasum when asked); with `backward_passes_per_step=k` gradients of k backward passes are averaged
      (not summed), so k passes of batch b equal one pass of batch k*b;
    - broadcasts parameters, buffers and optimizer state from rank 0, so all replicas start identical.

    Every rank must call it, with the same model (it broadcasts, and first checks that every rank built the
    same parameter names and shapes). Calls init() if Horovod is not initialised yet. Under elastic
    horovodrun nothing is broadcast here: ElasticState.sync() does it with the ranks there are then.

    On rank 0 it logs (stderr, one line) what it did to the rate, e.g. "hvdp: lr 0.03 -> 0.06
    (lr_scaling='linear': x2 for 2 rank(s) x 1 pass(es))", and warns (hvdp.core.scaling.LRScalingWarning,
    which warnings.filterwarnings can silence) when the linear rule meets an adaptive optimizer (Adam,
    AdamW, RMSprop, Adagrad...). It neither copies nor moves the model: move it to device() before.

    Gradient clipping: call `optimizer.synchronize()`, clip, then step inside
    `with optimizer.skip_synchronize(): optimizer.step()` (see docs/pytorch.md). With
    shard_optimizer_state=True, call `optimizer.clip_grad_norm_(max_norm)` before step() instead.

    Args:
        model: the module whose parameters `optimizer` updates; broadcast from rank 0.
        optimizer: a torch optimizer over `model`'s parameters, with the base learning rate (the one tuned
            for the per-rank batch on one process). Its param groups are scaled in place.
        lr_scaling: "linear" (default: x size*k), "sqrt" (x sqrt(size*k)) or "none"; ignored with "adasum".
        warmup_steps: optimizer steps over which the effective rate ramps from the base to the scaled one
            (default 0).
        compression: "none" (default) or "fp16" (gradients sent as float16).
        op: the gradient reduction: "average" (default), "sum", or "adasum" (needs the MPI controller).
        backward_passes_per_step: k >= 1 (default 1): backward passes accumulated per optimizer step.
        sync_batchnorm: replace the model's BatchNorm layers in place by SyncBatchNorm (default False).
        shard_optimizer_state: ZeRO-1/2 (default False): gradients reduce-scattered, `optimizer` stepping only
            this rank's 1/N of the parameters (its state exists only for those), the updated parameters
            all-gathered; checkpoints hold the full state. See "Sharded optimizer state" in docs/pytorch.md.

    Returns:
        Horovod's DistributedOptimizer wrapping `optimizer` (with shard_optimizer_state, a
        hvdp.torch.sharded.ShardedOptimizer); call step() and zero_grad() on it.

    Raises:
        ConfigError: an unknown `op`, `compression` or `lr_scaling`; `backward_passes_per_step` not an
            integer >= 1; `warmup_steps` < 0; op="adasum" in a multi-rank job on Gloo; shard_optimizer_state
            with op="adasum"; shard_optimizer_state with an nn.Embedding/EmbeddingBag built with sparse=True.
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
    sparse = [name or type(m).__name__ for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if shard_optimizer_state and sparse:  # the shards are flat slices of dense gradients
        raise ConfigError(f"shard_optimizer_state=True needs dense gradients, and {', '.join(map(repr, sparse))} make(s) sparse "
                          f"ones (sparse=True): build them with sparse=False (SGD and Adagrad then take the same "
                          f"steps), or keep the allreduce path (shard_optimizer_state=False), which averages sparse "
                          f"gradients exactly", rank=hvd.rank())
    if shard_optimizer_state and op == "adasum":
        raise ConfigError("shard_optimizer_state=True works with op='average' or 'sum', not 'adasum'",
                          rank=hvd.rank())
    schedule = _Schedule(rule=lr_scaling, op=op, passes=backward_passes_per_step, warmup_steps=warmup_steps,
                         size=hvd.size())
    schedule.rate(1.0, scaled_by=1.0)  # an unknown lr_scaling: a ConfigError before anything is changed
    if sync_batchnorm:
        _convert_sync_batchnorm(model)
    _horovod.report_scaling(hvd.rank(), type(optimizer).__name__, optimizer.param_groups[0]["lr"], rule=lr_scaling,
                            size=hvd.size(), backward_passes_per_step=backward_passes_per_step, op=op,
                            warmup_steps=warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = schedule.rate(group["lr"], scaled_by=1.0)  # the base rate, scaled for this world
    # Each gradient is divided by k (k passes are averaged) and weighted at an epoch's uneven end (see
    # _Batch). A model prepared again (a new optimizer, a new k) must not keep the old hooks: they would compound.
    for handle in getattr(model, "_hvdp_accumulation_hooks", ()):
        handle.remove()
    _Batch.accumulating(backward_passes_per_step)
    hooks = model._hvdp_accumulation_hooks = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    if shard_optimizer_state:
        hooks += [p.register_hook(_gradient_hook(backward_passes_per_step, schedule)) for p in trainable]
        from hvdp.torch.sharded import ShardedOptimizer  # it builds on this module
        if not elastic():  # under elastic, ElasticState.sync() and entered() do it, with the ranks there are then
            _check_same_model(model)
            broadcast(model, optimizer)  # rank 0's weights, state and hyperparameters, before the state is sliced
        sharded = ShardedOptimizer(optimizer, schedule, op=_OPS[op], compression=_COMPRESSIONS[compression])
        model._hvdp_accumulation_hooks += sharded.hooks  # removed, as the others, if the model is prepared again
        return sharded
    dist = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=_COMPRESSIONS[compression],
        op=_OPS[op], backward_passes_per_step=backward_passes_per_step)
    # Parameters no rank used keep grad None; ones unfrozen or added later are hooked (hvdp.torch.usage).
    # Adasum reduces in its step(), parameter by parameter: it keeps Horovod's behaviour.
    usage = None if op == "adasum" else _Usage(dist, schedule, hooks, set(trainable))
    hooks += [p.register_hook(_gradient_hook(backward_passes_per_step, schedule, usage)) for p in trainable]
    dist._hvdp_usage = usage
    # Horovod builds its wrapper with the optimizer class's default arguments (AdamW(params): weight_decay=0.01),
    # which add_param_group() fills a new group from: the user's are those of the optimizer they built.
    dist.defaults = optimizer.defaults
    # ... and with empty state: the state the optimizer held (rank 0 restored it before prepare(), Horovod's
    # resume recipe) was dropped, and the broadcast below sent nothing. The parameters are the same objects.
    dist.state.update(optimizer.state)
    if not elastic():
        _check_same_model(model)
        broadcast(model, dist)  # under elastic, ElasticState.sync() does it, with the ranks there are then
    dist.hvdp_schedule = schedule
    # Instance attributes, so that only the outer calls act: Horovod's step() calls the wrapped optimizer's
    # class step() (Adasum once per parameter, during the backward pass), and its step() calls synchronize().
    dist.zero_grad = types.MethodType(_zero_grad, dist)
    dist.step = types.MethodType(_step, dist)
    if op != "adasum":  # Adasum's synchronize() does nothing; its step() reduces
        dist.synchronize = types.MethodType(_synchronize, dist)
        dist.add_param_group = types.MethodType(_add_param_group, dist)
    return dist


def _zero_grad(optimizer, set_to_none: bool = True):
    # Horovod's zero_grad() takes no arguments (horovod#4026), so `zero_grad(set_to_none=True)` raised
    # TypeError. Keep its race guard and pass the argument on to torch's Optimizer.zero_grad.
    usage = getattr(optimizer, "_hvdp_usage", None)
    if usage is not None:
        usage.abandon()
    if optimizer._handles:
        raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                             "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
    return torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)


def _step(optimizer, *args, **kwargs):
    """Horovod's step() at this step's rate (the warmup applied around it); counts the step."""
    s = optimizer.hvdp_schedule
    began = _stragglers.step_begin()  # hvdp (issue 47): the optimizer's update is this call less its collectives
    _horovod.progress(s.step, WAITING)
    groups = optimizer.param_groups
    kept = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = s.rate(g["lr"], step=s.step)
    usage = getattr(optimizer, "_hvdp_usage", None)
    # synchronize() ran and no gradient arrived since: step without Horovod's warning (synchronize is idempotent)
    done = usage is not None and optimizer._synchronized and not usage.fresh
    try:
        with optimizer.skip_synchronize() if done else contextlib.nullcontext():
            result = type(optimizer).step(optimizer, *args, **kwargs)
    finally:
        for g, lr in zip(groups, kept):
            g["lr"] = lr
    s.step += 1
    _counted(s)
    _horovod.progress(s.step, COMPUTING)
    _stragglers.step_end(hvd, began)  # every K steps, the straggler report (a collective: every rank is here)
    return result


def _synchronize(optimizer):
    """Horovod's synchronize() (the all-reduce of this step's gradients), then count the step: a step that
    GradScaler skips after it never calls step(), yet its batches were trained on.

    The parameters no rank used are left out and keep grad None (hvdp.torch.usage). Idempotent: called again
    with no gradient computed since (a logging helper, then the clipping recipe), it does nothing (Horovod's
    would all-reduce the averaged gradients once more)."""
    usage = optimizer._hvdp_usage
    if optimizer._synchronized and not usage.fresh and not optimizer._handles:
        return
    waiting = perf_counter()  # hvdp (issue 47): time in the gradient collectives
    unused = usage.before_synchronize()
    try:
        type(optimizer).synchronize(optimizer)
    finally:
        usage.after_synchronize(unused)
        _stragglers.collective_wait(waiting)
    _counted(optimizer.hvdp_schedule)


def _add_param_group(optimizer, param_group: dict) -> None:
    """torch's add_param_group, the new group's rate scaled for the world as prepare() scaled the others', and
    its parameters hooked now (their gradients all-reduced and weighted as the others')."""
    type(optimizer).add_param_group(optimizer, param_group)
    added = optimizer.param_groups[-1]
    added["lr"] = optimizer.hvdp_schedule.rate(added["lr"], scaled_by=1.0)
    optimizer._hvdp_usage.adopt()


def _counted(s: _Schedule) -> None:
    # once per optimizer step, taken or skipped: when the step's gradients are reduced (or it is taken)
    if s.fresh:
        s.fresh = False
        if s.on_step is not None:
            s.on_step(s.passes)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next step() will use (first param group), warmup included.

    Args:
        optimizer: the optimizer prepare() returned; for any other, its first group's "lr" as it is.
    """
    s = getattr(optimizer, "hvdp_schedule", None)
    lr = optimizer.param_groups[0]["lr"]
    return lr if s is None else s.rate(lr, step=s.step)


def _rescale_groups(optimizer: torch.optim.Optimizer, scaled_by: float, size: int) -> None:
    """Make the param groups' rates, scaled by `scaled_by` (for another world, or another rule or k), those of
    prepare()'s schedule at `size` ranks; the schedule is then for `size` ranks."""
    s = optimizer.hvdp_schedule
    for group in optimizer.param_groups:
        for key in _GROUP_RATES:
            if isinstance(group.get(key), (float, int, torch.Tensor)) and not isinstance(group[key], bool):
                group[key] = s.rate(group[key], size=size, scaled_by=scaled_by)
    s.size = size


def _rescale_scheduler_states(tree, scaled_by: float, schedule: _Schedule):
    """`tree` (a checkpoint's extras) with every torch LR scheduler's state_dict() in it rescaled as the param
    groups are: its base_lrs (from the groups' initial_lr), last rates, and CyclicLR's max_lrs."""
    if isinstance(tree, dict):
        if "last_epoch" in tree and ("base_lrs" in tree or "_last_lr" in tree):
            tree = dict(tree)
            for key in ("base_lrs", "_last_lr", "max_lrs"):
                if isinstance(tree.get(key), (list, tuple)):
                    tree[key] = [schedule.rate(v, scaled_by=scaled_by) if isinstance(v, (float, int, torch.Tensor))
                                 else v for v in tree[key]]
        return {k: _rescale_scheduler_states(v, scaled_by, schedule) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rescale_scheduler_states(v, scaled_by, schedule) for v in tree]
    return tree
