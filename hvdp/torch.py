"""PyTorch adapter: plain functions over the core and horovod.torch.

    import hvdp.torch as hvdp_torch
    world = hvdp_torch.init()
    optimizer = hvdp_torch.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = hvdp_torch.shard(train_set, batch_size=32)
    for epoch in range(epochs):
        for x, y in loader:               # a new order every epoch, no set_epoch to forget
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    metrics = hvdp_torch.evaluate(model, test_set)   # every test sample counted exactly once

Run the same script on every rank (horovodrun, mpirun, srun; plain python is a world of size 1). Functions
marked "every rank must call it" run a collective: a rank that skips one, or calls them in another order,
leaves the others waiting (hvdp's watchdog then ends the job). Errors are hvdp.core.errors classes
(ConfigError, SetupError, CheckpointError, DivergenceError, NonFiniteLossError), raised on every rank where
the check is collective. Importing this module imports torch and horovod.torch, and raises SetupError when
Horovod is missing or was built without PyTorch.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import math
import os
import random
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.utils.data

from hvdp import _horovod
from hvdp.core import checkpoint as ckpt
from hvdp.core import consistency
from hvdp.core import devices as _devices
from hvdp.core.errors import (CheckpointError, ConfigError, DataError, DivergenceError, HvdpError, NonFiniteLossError,
                              SetupError)
from hvdp.core.scaling import lr_multiplier, rescale_lr, warmup_factor
from hvdp.core.sharding import ShardPlan, StreamSplit, eval_bounds, eval_metrics, exact_weight, real_count
from hvdp.core.watchdog import WAITING
from hvdp.core.world import World, elastic

COMPUTING = "computing its forward/backward pass"

hvd = _horovod.import_horovod("torch")
from horovod.common.elastic import ObjectState  # noqa: E402  (after import_horovod's clear error)

_OPS = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def init(*, timeline: str | None = None, device: str | None = None, share_gpus: bool | None = None) -> World:
    """Initialise Horovod (horovodrun, mpirun, or plain python as size 1) and return this process's World.

    Every rank must call it (Horovod's init, the watchdog's address exchange and the CPU count are collective); a second
    call returns the World again. Before Horovod starts, hvdp's runtime defaults (hvdp.core.tuning) are set
    where the environment lacks them, and for 2+ ranks the watchdog starts (unless HVDP_WATCHDOG=0 or
    elastic mode). Unless OMP_NUM_THREADS is set, each rank gets an equal share of the CPUs it may use (its
    affinity and cgroup quota, split among the ranks on its host that share them; hvdp.core.cpus) for
    torch's intra-op threads (torch would otherwise start one thread per core in every rank).

    When torch sees GPUs, each rank takes its own: GPU local_rank % (GPUs it sees), made torch's current
    device (torch.cuda.set_device) and returned by device(); put the model and batches there
    (`model.to(hvdp_torch.device())`). The ranks check that no two of them got the same GPU.

    Args:
        timeline: write Horovod's timeline (Chrome trace of every collective) to this path; default None:
            no timeline.
        device: "auto" (the rank's GPU when torch sees one, else the CPU), "cpu", "cuda" (the rank's GPU,
            an error without one) or "cuda:N" (GPU N, for users who place ranks themselves); default None:
            HVDP_DEVICE, else "auto".
        share_gpus: allow several ranks on one GPU (default None: HVDP_SHARE_GPUS=1, else False: an error
            naming the ranks when a host has more ranks than GPUs).

    Returns:
        This process's World (rank, size, local_rank, local_size).

    Raises:
        SetupError: launched by mpirun or horovodrun's MPI mode, but Horovod was built without MPI.
        ConfigError: a malformed HVDP_SHM_*, HVDP_WATCHDOG_TIMEOUT, HVDP_DEVICE or HVDP_SHARE_GPUS; a device
            that cannot be had, or ranks sharing a GPU unasked (on every rank).
    """
    global _device
    first = not hvd.is_initialized()
    w = _horovod.init("torch", timeline)[1]
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(_horovod.threads())
    if first or device is not None or _device is None:
        req = _devices.request(device, share_gpus)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = _horovod.place(hvd, w, req, visible, _gpu_id)
        if index is None:
            _device = torch.device("cpu")
        else:
            torch.cuda.set_device(index)
            _device = torch.device("cuda", index)
    return w


_device: torch.device | None = None


def _gpu_id(index: int) -> str:
    """What identifies GPU `index` across processes: its UUID (the same GPU whatever CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}#{index}"


def device() -> torch.device:
    """This rank's device, chosen by init(): its own GPU (cuda:i) when torch sees GPUs, else the CPU.

    Raises:
        ConfigError: init() was not called yet.
    """
    if _device is None:
        raise ConfigError("hvdp.torch.device() is chosen by init(): call hvdp.torch.init() first")
    return _device


def world() -> World:
    """This process's World (rank, size, local_rank, local_size); call init() first (Horovod raises before)."""
    return World.from_horovod(hvd)


def _module_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its first parameter's or buffer's device (the CPU for a module with none)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------- optimizer

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


class _Batch:
    """The batch of shard()'s loader being trained on, for prepare()'s gradient hooks.

    Ranks average their mean gradients with equal weights, which is one process's step on the union batch
    only when every batch is full. At an epoch's end (a partial last global batch, split unevenly or topped
    up; a last step with fewer than k accumulated batches) each batch's gradient is multiplied by
    ShardPlan.gradient_weight(), so that the step is exactly the one process's mean over its samples.
    The loader sets `sampler` and `index` as it hands out each batch; the hooks ask for the factor.
    """

    sampler = None  # the ShardSampler (or a stream's _StreamSteps) of the batch handed out last, or None
    index = 0       # that batch's index in the sampler's iteration
    lookahead = 1   # the largest backward_passes_per_step prepared: how far a stream's loader reads ahead
    _cached: tuple = (None, -1, 0, 1.0)

    @classmethod
    def factor(cls, passes: int) -> float:
        if cls.sampler is None:
            return 1.0
        key = (cls.sampler, cls.index, passes)
        if cls._cached[:3] != key:  # once per batch, not once per parameter
            cls._cached = (*key, cls.sampler.gradient_weight(cls.index, passes))
        return cls._cached[3]


def _gradient_hook(passes: int) -> Callable:
    def hook(grad):
        weight = _Batch.factor(passes)
        if weight == 1.0:
            return grad / passes if passes > 1 else None  # None: the gradient as it is
        return grad * (weight / passes)
    return hook


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


# DDP's first bucket is 1 MiB so that communication starts early; the later ones 25 MiB.
_FIRST_BUCKET_BYTES, _BUCKET_BYTES = 1 << 20, 25 << 20


def compile(model: torch.nn.Module, *, bucket_bytes: int = _BUCKET_BYTES, backend: str | Callable = "inductor",
            **options: Any) -> torch.nn.Module:
    """torch.compile(model) whose backward pass hands gradients to Horovod while it runs.

    A model compiled whole has one backward node: every gradient is ready only when the whole backward pass
    has finished, so Horovod's all-reduce no longer overlaps it (measured: the first all-reduce starts at 97%
    of the backward pass, against 3% eager). Here the graph is split where about `bucket_bytes` of
    parameters have been counted from the output (the first piece 1 MiB), the split DDP's compiler makes for
    its buckets (torch._dynamo's DDPOptimizer), and each piece is compiled with `backend`: the gradients of
    the last layers are all-reduced while the first layers' backward still runs. Use the returned module for
    the forward pass; prepare(), save_checkpoint() and the other hvdp functions take either it or `model`.

    Args:
        model: the module to compile.
        bucket_bytes: parameter bytes per compiled piece (default 25 MiB, DDP's bucket size).
        backend: torch.compile's backend (default "inductor"); each piece is compiled with it.
        **options: passed on to torch.compile (mode, dynamic, fullgraph, ...).

    Returns:
        torch.compile's module (an OptimizedModule) over `model`.

    Raises:
        ConfigError: `bucket_bytes` < 1, or a backend torch.compile does not know.
        SetupError: this torch has no torch._dynamo.backends.distributed.DDPOptimizer (its graph splitter).
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
    try:
        from torch._dynamo import lookup_backend
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError as e:
        raise SetupError(f"torch {torch.__version__} has no torch._dynamo DDPOptimizer to split the compiled graph "
                         f"({e}); use torch.compile(model) (the all-reduce then starts after the backward pass)") from e
    try:
        compile_piece = lookup_backend(backend) if isinstance(backend, str) else backend
    except Exception as e:  # torch raises its InvalidBackend
        raise ConfigError(f"backend={backend!r} is not a torch.compile backend: {e}") from e
    splitter = DDPOptimizer(bucket_bytes_cap=bucket_bytes, backend_compile_fn=compile_piece,
                            first_bucket_cap=min(_FIRST_BUCKET_BYTES, bucket_bytes))
    return torch.compile(model, backend=splitter.compile_fn, **options)


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (its state_dict has no '_orig_mod.' prefix), or `model` itself."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch.nn.Module) else model


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next step() will use (first param group), warmup included.

    Args:
        optimizer: the optimizer prepare() returned; for any other, its first group's "lr" as it is.
    """
    s = getattr(optimizer, "hvdp_schedule", None)
    lr = optimizer.param_groups[0]["lr"]
    return lr if s is None else lr * warmup_factor(s.step, s.warmup_steps, s.multiplier)


def broadcast(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, root_rank: int = 0):
    """Copy parameters, buffers and (non-empty) optimizer state from `root_rank` to every rank.

    A fresh optimizer has no state on any rank, so only its hyperparameters are sent. (Horovod's
    broadcast_optimizer_state would first take a zero-gradient step to create state, which advances
    Adam's step count and applies weight decay once: the run would no longer match one process.)
    prepare() already calls it (except under elastic horovodrun, where ElasticState.sync() does).

    Every rank must call it, with the same model and optimizer structure.

    Args:
        model: the module whose state_dict (parameters and buffers) is overwritten with root_rank's.
        optimizer: also copy its state and hyperparameters (default None: the model only).
        root_rank: the rank whose values everyone gets (default 0).
    """
    model = _plain(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    if optimizer is None:
        return
    if optimizer.state_dict()["state"]:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for group, values in zip(optimizer.param_groups, hvd.broadcast_object(hyper, root_rank=root_rank, name="hvdp.hyper")):
        group.update(values)


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose training statistics are those of the global batch (all ranks together).

    Works on CPU and GPU (Horovod's own SyncBatchNorm is GPU-only). One all-reduce of (sum, sum of
    squares, count) per call; gradients flow back through it. In eval mode, before init() and in a world
    of size 1 it is plain BatchNorm. Takes torch's BatchNorm arguments (num_features, eps, momentum,
    affine, track_running_stats); prepare(sync_batchnorm=True) converts a model's BatchNorm layers.
    """

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` of shape (N, C, ...) over the global batch (training) or the running statistics.

        In training mode with 2+ ranks every rank must call it, the same number of times in the same
        order (one all-reduce each). Updates the running statistics from the global batch.

        Raises:
            ValueError: `x` has fewer than 2 dimensions.
        """
        if not self.training or not hvd.is_initialized() or hvd.size() == 1:
            return super().forward(x)
        self._check_input_dim(x)
        channels = x.size(1)
        dims = [0, *range(2, x.dim())]
        # Statistics in float32 at least (a bf16/fp16 input under autocast would lose them to rounding), on
        # the input's device; the variance clamped at 0 (E[x^2] - E[x]^2 can round below it).
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        count = torch.tensor([x.numel() // channels], dtype=xf.dtype, device=x.device)
        stats = hvd.allreduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]), op=hvd.Sum)
        n = stats[-1]
        mean = stats[:channels] / n
        var = (stats[channels:2 * channels] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * n / max(float(n) - 1, 1.0), alpha=m)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def _convert_sync_batchnorm(module: torch.nn.Module) -> None:
    """Replace BatchNorm layers in place by SyncBatchNorm, sharing parameters and buffers."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(child, SyncBatchNorm):
            sync = SyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                 child.track_running_stats)
            if child.affine:
                sync.weight, sync.bias = child.weight, child.bias
            if child.track_running_stats:
                sync.running_mean, sync.running_var = child.running_mean, child.running_var
                sync.num_batches_tracked = child.num_batches_tracked
            sync.train(child.training)
            setattr(module, name, sync)
        else:
            _convert_sync_batchnorm(child)


# ------------------------------------------------------------------------------------------------- data

class ShardSampler(torch.utils.data.Sampler):
    """A batch sampler yielding this rank's batches; each iteration starts the next epoch by itself.

    Its position is (epoch, offset): the next iteration runs `epoch` from `offset` samples into the
    epoch order. Under an ElasticState it also counts the optimizer steps of the iteration in progress,
    so that a commit records exactly what was trained on and a resized world carries on from there.
    shard() builds one; use it as a DataLoader's batch_sampler. len() is the number of batches left in
    the next iteration.

    Args:
        plan: the hvdp.core.sharding.ShardPlan of this rank; replaced by one for the new rank and size when
            an elastic reset changes them.
    """

    def __init__(self, plan: ShardPlan):
        self.plan = plan
        self.epoch, self.offset = 0, 0
        self._running: list[int] | None = None  # [epoch, offset, steps, steps trained] of this iteration

    def __len__(self) -> int:
        return self.plan.steps_for(self.plan.n - self.offset)

    def __iter__(self):
        self._follow_world()
        epoch, offset = self.epoch, self.offset
        self.epoch, self.offset = epoch + 1, 0
        self._running = [epoch, offset, self.plan.steps_for(self.plan.n - offset), 0]
        for batch in self.plan.batches(epoch, offset=offset):
            yield batch.tolist()

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (used when resuming a checkpoint).

        Args:
            epoch: the epoch to run next.
            step: batches of that epoch already done, at the current world size (default 0).
        """
        self.resume(int(epoch), self.plan.consumed(0, int(step)))

    def resume(self, epoch: int, offset: int) -> None:
        """Make the next iteration run `epoch` from `offset` samples into its order.

        Args:
            epoch: the epoch to run next.
            offset: samples of its epoch order already trained on, by a world of any size.
        """
        self.epoch, self.offset, self._running = epoch, offset, None

    def position(self) -> tuple[int, int]:
        """(epoch, offset) of the first sample not trained on yet, counting recorded steps."""
        if self._running is not None:
            epoch, offset, steps, trained = self._running
            if trained < steps:
                return epoch, self.plan.consumed(offset, trained)
        return self.epoch, self.offset

    def record_steps(self, batches: int) -> None:
        """Record that `batches` batches of the iteration in progress were trained on.

        Called after each optimizer step under an ElasticState; a no-op between iterations.
        """
        if self._running is not None:
            self._running[3] += batches

    def gradient_weight(self, index: int, passes: int = 1) -> float:
        """The weight of batch `index` of the iteration in progress when `passes` batches make one step
        (ShardPlan.gradient_weight): 1.0 for a full step, size*passes*real/(the step's real samples) otherwise."""
        offset = self._running[1] if self._running is not None else self.offset
        return self.plan.gradient_weight(index, offset, passes)

    def _follow_world(self) -> None:
        """Re-split the data when an elastic reset changed this rank's place in the world."""
        if hvd.is_initialized() and (hvd.rank(), hvd.size()) != (self.plan.rank, self.plan.size):
            self.plan = dataclasses.replace(self.plan, rank=hvd.rank(), size=hvd.size())


def shard(dataset: torch.utils.data.Dataset, *, batch_size: int, shuffle: bool = True, seed: int = 0,
          drop_last: bool = False, transform: Callable | None = None,
          **loader_kwargs: Any) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's share of `dataset`; `batch_size` is per rank.

    The epoch order depends only on (seed, epoch); ranks get disjoint slices of each global batch, so
    N ranks with batch b see at every step exactly what one process with batch N*b sees. Each iteration
    over the loader is the next epoch (no set_epoch to forget); every rank gets the same number of batches.
    Calls init() if Horovod is not initialised yet.

    A stream (a torch IterableDataset: WebDataset, a Hugging Face streaming dataset, a database cursor) is
    split the same way with the stream's own order as the epoch order: every rank and loader worker reads
    the whole stream, keeps its part, and applies `transform` to that part only. The ranks agree every few
    batches on how far their streams went, so all take the same number of steps, and a stream that ends
    early or differs on one rank is a DataError on every rank instead of a hang. Each iteration calls the
    dataset's set_epoch(epoch) if it has one (its shuffle per epoch); hvdp cannot reorder a stream. Resuming
    mid-epoch reads the stream again from its start and drops the steps already trained on.

    Args:
        dataset: a map-style dataset (len() and indexing), or a torch IterableDataset whose every copy yields
            the whole stream in the same order on every rank (do not split it by rank or worker yourself).
        batch_size: samples per rank per batch, from 1 to len(dataset) // size.
        shuffle: a new order every epoch (default True); False keeps the dataset's order. A stream keeps
            its own order (shuffle it in the stream, by epoch through set_epoch).
        seed: the seed of the epoch order (default 0); the same on every rank.
        drop_last: drop the last, partial global batch of each epoch (default False: split it evenly).
        transform: a stream's function applied to each of this rank's elements after the split, in the
            loader workers (decoding, augmentation: the elements of other ranks are never transformed);
            default None. A map-style dataset transforms in its __getitem__ (it reads only this rank's).
        loader_kwargs: passed to torch.utils.data.DataLoader (num_workers, collate_fn, pin_memory...), but
            not batch_size, shuffle or sampler; `generator` defaults to one seeded with seed + rank. A stream
            refuses persistent_workers=True (the workers would keep the first epoch's position).

    Returns:
        A DataLoader whose batch_sampler is a ShardSampler; for a stream, one that yields this rank's
        collated batches (its len() is known when the dataset has a len()).

    Raises:
        ConfigError: batch_size < 1, fewer samples than ranks, or batch_size larger than each rank's share;
            a map-style dataset without len(); `transform` with a map-style dataset; persistent_workers with
            a stream. For a stream the sample counts are checked as it is read, on every rank.
    """
    w = world() if hvd.is_initialized() else init()
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return _stream(dataset, StreamSplit(batch_size=batch_size, rank=w.rank, size=w.size, drop_last=drop_last),
                       transform, seed, loader_kwargs)
    if transform is not None:
        raise ConfigError("shard(transform=...) is for a stream (a torch IterableDataset); a map-style dataset "
                          "transforms in its __getitem__, which reads only this rank's samples")
    try:
        len(dataset)
    except TypeError:
        raise ConfigError(f"shard() needs len(dataset) for a map-style dataset; {type(dataset).__name__} has "
                          f"none: give it a __len__, or make it a torch.utils.data.IterableDataset (a stream)",
                          rank=w.rank) from None
    plan = ShardPlan(n=len(dataset), batch_size=batch_size, rank=w.rank, size=w.size, seed=seed,
                     shuffle=shuffle, drop_last=drop_last)
    # Its own generator: a DataLoader otherwise draws from the global RNG at every epoch start, which
    # would make a resumed run's dropout masks differ from an uninterrupted one's.
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed + w.rank))
    return _ShardLoader(dataset, batch_sampler=ShardSampler(plan), **loader_kwargs)


class _ShardLoader(torch.utils.data.DataLoader):
    """shard()'s DataLoader: as it hands out each batch it tells prepare()'s gradient hooks which one it is
    (_Batch), so that an epoch's uneven last step is weighted exactly. Workers prefetch ahead; what the
    loop receives is the batch it trains on."""

    def __iter__(self):
        yield from _handing_out(self.batch_sampler, enumerate(super().__iter__()))

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (load_checkpoint calls it)."""
        self.batch_sampler.set_position(epoch, step)


def _handing_out(sampler, batches):
    """Yield each (index, batch)'s batch, telling prepare()'s gradient hooks which one it is (_Batch)."""
    try:
        for index, batch in batches:
            _Batch.sampler, _Batch.index = sampler, index
            yield batch
    finally:
        if _Batch.sampler is sampler:
            _Batch.sampler = None


# A stream's ranks agree on how far they have read once per this many batches (one small allgather).
_STREAM_WINDOW = 8


def _stream(dataset, split: StreamSplit, transform, seed: int, loader_kwargs: dict) -> torch.utils.data.DataLoader:
    for name in ("batch_size", "shuffle", "sampler", "batch_sampler"):
        if name in loader_kwargs:
            raise ConfigError(f"shard() of a stream sets the DataLoader's {name} itself; leave it out")
    if loader_kwargs.get("persistent_workers"):
        raise ConfigError("shard() of a stream refuses persistent_workers=True: the workers would keep the first "
                          "epoch's position (each epoch starts the stream's workers again); leave it out")
    collate = loader_kwargs.pop("collate_fn", None) or torch.utils.data.default_collate
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed + split.rank))
    return _StreamLoader(_RankStream(dataset, split, transform, collate), **loader_kwargs)


def _as_is(item):
    return item


class _RankStream(torch.utils.data.IterableDataset):
    """What each loader worker iterates: this rank's batches of the stream (StreamSplit.batches), its
    elements transformed and collated, each with (step, count)."""

    def __init__(self, dataset, split: StreamSplit, transform, collate):
        self.dataset, self.split, self.transform, self.collate = dataset, split, transform, collate
        self.start_step = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for step, elements, count in self.split.batches(self.dataset, start_step=self.start_step, worker=worker,
                                                        workers=workers):
            if self.transform is not None:
                elements = [self.transform(e) for e in elements]
            yield self.collate(elements), (step, count)


class _StreamSteps:
    """The global sample counts of a stream iteration's batches, for prepare()'s gradient hooks (_Batch)."""

    def __init__(self, split: StreamSplit):
        self.split, self.counts = split, []

    def gradient_weight(self, index: int, passes: int = 1) -> float:
        first = index // passes * passes
        samples = sum(self.counts[first:first + passes])
        return exact_weight(real_count(self.counts[index], self.split.batch_size, self.split.size, self.split.rank),
                            samples, self.split.size, passes)


class _StreamLoader(torch.utils.data.DataLoader):
    """shard()'s DataLoader of a stream: its workers yield this rank's batches (_RankStream); here they are
    read ahead a window at a time, the ranks agree on each window's sample counts (so a rank whose stream
    ended early raises on every rank instead of leaving the others in an all-reduce), and each batch is
    handed out with its gradient weight known."""

    def __init__(self, stream: _RankStream, **kwargs):
        super().__init__(stream, batch_size=None, collate_fn=_as_is, **kwargs)
        self.epoch, self.start_step = 0, 0
        self._last_steps = None  # batches the previous iteration had (a one-shot stream has none after it)

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (load_checkpoint calls it)."""
        self.epoch, self.start_step = int(epoch), int(step)

    def __len__(self) -> int:
        try:
            n = len(self.dataset.dataset)
        except TypeError:
            raise TypeError(f"this stream ({type(self.dataset.dataset).__name__}) has no len(), so neither has "
                            f"its loader: count the batches as they come") from None
        split = self.dataset.split
        left = max(0, n - self.start_step * split.global_batch)
        full, rest = divmod(left, split.global_batch)
        return full + (1 if rest and not split.drop_last else 0)

    def __iter__(self):
        epoch, start = self.epoch, self.start_step
        self.epoch, self.start_step = epoch + 1, 0
        if hasattr(self.dataset.dataset, "set_epoch"):
            self.dataset.dataset.set_epoch(epoch)
        self.dataset.start_step = start  # the workers take a copy of it as the iteration starts them
        steps = _StreamSteps(self.dataset.split)
        yield from _handing_out(steps, self._batches(steps, super().__iter__(), epoch, start))

    def _batches(self, steps: _StreamSteps, source, epoch: int, start: int):
        window = max(_STREAM_WINDOW, _Batch.lookahead)
        ready, ended, index = [], False, 0
        while True:
            # read ahead until the step group of the next batch is known (its gradient weights need it)
            group_end = (index // _Batch.lookahead + 1) * _Batch.lookahead
            while not ended and len(steps.counts) < group_end:
                read = list(itertools.islice(source, window))
                ended = len(read) < window
                self._agree(read, ended, window, epoch, start, len(steps.counts))
                ready += [batch for batch, _ in read]
                steps.counts += [count for _, (_, count) in read]
            if index == len(steps.counts):
                self._last_steps = index
                return
            yield index, ready[0]
            ready.pop(0)
            index += 1

    def _agree(self, read: list, ended: bool, window: int, epoch: int, start: int, before: int) -> None:
        """Compare this window's reads across the ranks; raise the same error on every rank if they differ."""
        split = self.dataset.split
        counts = [count for _, (_, count) in read]
        row = torch.tensor([[len(read), int(ended)] + counts + [-1] * (window - len(read))], dtype=torch.int64)
        rows = hvd.allgather(row, name="hvdp.stream").tolist() if split.size > 1 else row.tolist()
        at = f"epoch {epoch}, step {start + before}"
        if any(r != rows[0] for r in rows):
            lengths = {rank: r[0] for rank, r in enumerate(rows)}
            short = min(lengths.values())
            if len(set(lengths.values())) > 1:
                early = sorted(rank for rank, n in lengths.items() if n == short)
                what = (f"the stream of rank(s) {early} ended after {start + before + short} steps of epoch {epoch}, "
                        f"while other ranks read on")
            else:
                odd = sorted(rank for rank, r in enumerate(rows) if r != rows[0])
                what = f"rank(s) {odd} read other sample counts than rank 0 near {at}"
            raise DataError(f"{what}: every rank reads the whole stream and keeps its part, so every rank's dataset "
                            f"must yield the same elements in the same order (the same files, the same seeded "
                            f"shuffle; not split by rank or by DataLoader worker itself)", rank=split.rank)
        if before == 0 and not read:
            if start:
                why = (f"nothing is left at the resume position ({at}): the stream ended before that step, or it "
                       f"does not start over when iterated again")
            elif self._last_steps:
                why = (f"the stream yielded nothing in epoch {epoch} after {self._last_steps} steps in the epoch "
                       f"before: it does not start over when iterated again (a generator or a cursor can be read "
                       f"once); give shard() a dataset whose __iter__ reads the stream from its start")
            else:
                why = f"the stream yielded no samples in epoch {epoch}"
            raise DataError(why, rank=split.rank)
        if before == 0 and start == 0 and counts[0] < split.size:
            raise ConfigError(f"the stream has {counts[0]} samples but the job has {split.size} ranks: every rank "
                              f"needs at least one sample; use more data or fewer ranks", rank=split.rank)


# ------------------------------------------------------------------------------------------ collectives

def barrier() -> None:
    """Wait until every rank gets here (Horovod's own barrier, through the controller).

    Every rank must call it; a no-op in a world of size 1. Call init() first.
    """
    if hvd.size() > 1:
        hvd.barrier()


def average(value: float | torch.Tensor, name: str | None = None) -> float:
    """The mean of a scalar over all ranks (for metrics and logging). Every rank must call it.

    Args:
        value: a number or a one-element tensor (detached; computed in float64).
        name: the all-reduce's name in Horovod (default None: Horovod's own); every rank must pass the same.

    Returns:
        The mean as a float, the same on every rank.
    """
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
    return float(hvd.allreduce(t, op=hvd.Average, name=name))


def check_finite(loss: torch.Tensor | float, step: int) -> None:
    """Raise NonFiniteLossError on every rank if the loss is NaN or inf on any rank (which is named).

    Every rank must call it, at the same steps. One 1-element allgather: call it every step, or every few
    steps where that cost shows.

    Args:
        loss: this rank's loss, a tensor (one element) or a float.
        step: the step number, shown in the message.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite on at least one rank (raised on every rank).
    """
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    bad = torch.tensor([0.0 if math.isfinite(value) else 1.0])
    flags = hvd.allgather(bad, name="hvdp.check_finite")
    if flags.any():
        ranks = [int(r) for r in torch.nonzero(flags).flatten()]
        raise NonFiniteLossError(
            f"loss is not finite at step {step} on rank(s) {ranks} (loss on this rank: {value}); "
            f"lower the learning rate, enable warmup, or check the data", rank=hvd.rank())


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: torch.utils.data.Dataset, *, batch_size: int = 256,
             loss_fn=torch.nn.functional.cross_entropy) -> dict[str, float]:
    """Loss and accuracy of a classifier over `dataset`, counting every sample exactly once on any world size.

    Each rank scores a contiguous, unpadded slice; the sums are all-reduced. Every rank must call it, with
    the same dataset. Runs under torch.no_grad() with the model in eval mode, then restores its mode; the
    batches go to the model's device (its first parameter's: the rank's GPU when it is there).

    Args:
        model: a classifier: model(x) returns logits of shape (N, classes); accuracy uses argmax(1).
        dataset: a map-style dataset of (x, y) pairs, the same on every rank.
        batch_size: samples per forward pass on each rank (default 256).
        loss_fn: called as loss_fn(logits, y, reduction="sum") (default torch's cross_entropy).

    Returns:
        {"loss": mean loss, "accuracy": fraction correct, "samples": len(dataset)}, the same on every rank.

    Raises:
        ConfigError: `dataset` is empty (on every rank).
    """
    w = world()
    start, stop = eval_bounds(len(dataset), w.rank, w.size)
    subset = torch.utils.data.Subset(dataset, range(start, stop))
    was_training = model.training
    model.eval()
    where = _module_device(model)  # the batches go where the model is (the rank's GPU)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y in torch.utils.data.DataLoader(subset, batch_size=batch_size, pin_memory=where.type == "cuda"):
        x, y = x.to(where, non_blocking=True), y.to(where, non_blocking=True)
        out = model(x)
        sums += torch.tensor([float(loss_fn(out, y, reduction="sum")),
                              float((out.argmax(1) == y).sum()), len(y)], dtype=torch.float64)
    model.train(was_training)
    total = hvd.allreduce(sums, op=hvd.Sum, name="hvdp.evaluate").tolist()
    return eval_metrics(*total, rank=w.rank)


def log(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (on every process before init()), flushed at once.

    Args:
        args: what to print, as for print().
        kwargs: print()'s keywords (sep, end, file), except flush, which is always True.
    """
    if not hvd.is_initialized() or hvd.rank() == 0:
        print(*args, **kwargs, flush=True)


def progress(iterable: Iterable, **tqdm_kwargs: Any) -> Iterable:
    """A tqdm progress bar over `iterable` on rank 0, a disabled (silent) one elsewhere. Needs init() and tqdm.

    Args:
        iterable: what to iterate over.
        tqdm_kwargs: passed to tqdm.auto.tqdm (desc, total, ...), except disable.
    """
    from tqdm.auto import tqdm
    return tqdm(iterable, disable=hvd.rank() != 0, **tqdm_kwargs)


def check_consistency(model: torch.nn.Module) -> None:
    """Raise DivergenceError on every rank if any parameter or buffer differs across ranks, naming the first
    one and the ranks that differ from rank 0. Compares exact bytes, so it catches the smallest drift.

    Every rank must call it. One allgather of a sha256 digest per tensor, no tensor data.

    Args:
        model: the module whose state_dict (parameters and buffers) is compared.

    Raises:
        DivergenceError: a tensor's shape or bytes differ from rank 0's on some rank (raised on every rank).
    """
    model = _plain(model)
    digests = [consistency.digest(name, t.shape, _raw_bytes(t)) for name, t in model.state_dict().items()]
    problem = consistency.divergence(
        hvd.allgather_object(digests, name="hvdp.consistency"),
        fix="Broadcast the initial state (hvdp.torch.prepare does) and avoid rank-dependent code paths")
    if problem:
        raise DivergenceError(problem, rank=hvd.rank())


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, for any dtype (numpy has no bfloat16)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_same_model(model: torch.nn.Module) -> None:
    """Raise DivergenceError on every rank, naming the rank and the tensor, if the ranks built models of
    different shapes. (Horovod would fail the first broadcast with "One rank sent a tensor of shape [3], but
    another rank sent ... [4]": neither the rank nor the tensor.) One small allgather, no tensor data."""
    shapes = [consistency.digest(name, t.shape, b"") for name, t in model.state_dict().items()]
    problem = consistency.divergence(hvd.allgather_object(shapes, name="hvdp.model_shapes"), fix="")
    if problem:
        raise DivergenceError(problem, rank=hvd.rank())


# -------------------------------------------------------------------------------------------- elastic

class ElasticState(ObjectState):
    """What an elastic job keeps across a lost or added worker: model, optimizer, data position, extras.

        state = hvdp_torch.ElasticState(model, optimizer, loader, best=0.0)

        @hvdp_torch.elastic_run
        def train(state):
            while state.epoch < epochs:
                for x, y in loader:           # resumes mid-epoch after a reset
                    ...; optimizer.step()
                    state.commit()            # or every few steps: a failure rolls back to the last commit

    `optimizer` comes from prepare() and `loader` from shard(). Each optimizer step records the batches
    it trained on, so a commit holds the exact offset into the epoch's order; after a reset the ranks there
    are then split the rest of the epoch, and no sample is skipped or seen twice. sync() (run by
    elastic_run after every reset) broadcasts everything from rank 0 and rescales the learning rate to the
    new world size by the rule given to prepare().

    Args:
        model: the module being trained.
        optimizer: the optimizer prepare() returned.
        loader: the DataLoader shard() returned.
        extra: further values to keep and sync, read and set as attributes (state.best); not `epoch`.

    Raises:
        ConfigError: `optimizer` is not from prepare(), `loader` not from shard(), or `extra` has `epoch`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loader: torch.utils.data.DataLoader, **extra: Any):
        model = _plain(model)
        schedule = getattr(optimizer, "hvdp_schedule", None)
        sampler = getattr(loader, "batch_sampler", None)
        if schedule is None:
            raise ConfigError("ElasticState needs the optimizer returned by hvdp.torch.prepare()")
        if isinstance(loader, _StreamLoader):
            raise ConfigError("ElasticState needs a map-style dataset: shard() of a stream (an IterableDataset) "
                              "cannot be split again among a changed number of ranks mid-epoch")
        if not isinstance(sampler, ShardSampler):
            raise ConfigError("ElasticState needs the DataLoader returned by hvdp.torch.shard()")
        if "epoch" in extra:
            raise ConfigError("`epoch` is kept by ElasticState itself (state.epoch, from the data position); "
                              "leave it out of the extras")
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        schedule.on_step = sampler.record_steps
        self._snapshot = self._take()
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0, name="hvdp.elastic"),
                         get_rank=hvd.rank, **extra)

    @property
    def epoch(self) -> int:
        """The epoch training is in (or starts next): the loop condition of an elastic training function."""
        return self.sampler.position()[0]

    def _take(self) -> dict:
        s = self.optimizer.hvdp_schedule
        return {"model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "schedule": (s.step, s.multiplier), "position": self.sampler.position()}

    def save(self) -> None:
        """Snapshot model, optimizer, schedule and data position in memory (state.commit() calls it)."""
        self._snapshot = self._take()
        super().save()

    def restore(self) -> None:
        """Roll model, optimizer, schedule and data position back to the last save(); Horovod calls it."""
        snap = self._snapshot
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        s = self.optimizer.hvdp_schedule
        s.step, s.multiplier = snap["schedule"]
        s.depth, s.saved = 0, ()  # a step that raised never ran its post-step hook
        self.sampler.resume(*snap["position"])
        super().restore()

    def reset(self) -> None:
        """Make the loader's next iteration start where training is (Horovod calls it after a reset)."""
        # After a reset the next iteration starts where training is, not at the next epoch.
        self.sampler.resume(*self.sampler.position())

    def sync(self) -> None:
        """Broadcast model, optimizer state, schedule and data position from rank 0; rescale the LR.

        The learning rate is rescaled for the new world size by prepare()'s rule. elastic_run calls it
        after every reset; every rank must call it.
        """
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        # The whole optimizer state as one tree: a worker that just joined has none yet, and Horovod's
        # broadcast_optimizer_state would make it take a zero-gradient step to create it.
        # Streamed (see _horovod.broadcast_tree): an optimizer state of any size, received in place where
        # this rank already has it.
        s = self.optimizer.hvdp_schedule
        synced = _horovod.broadcast_tree(
            hvd, _ARRAYS, {"optimizer": self.optimizer.state_dict(), "schedule": (s.step, s.multiplier),
                           "position": self.sampler.position()},
            name="hvdp.elastic.sync", into=_into(None, self.optimizer))
        opt_state, (step, multiplier), position = synced["optimizer"], synced["schedule"], synced["position"]
        self.optimizer.load_state_dict(opt_state)
        s.multiplier = lr_multiplier(s.rule, hvd.size(), backward_passes_per_step=s.passes, op=s.op)
        _rescale_groups(self.optimizer, multiplier, s.multiplier)
        s.step = step
        self.sampler.resume(*position)
        super().sync()
        self._snapshot = self._take()  # what a failure before the next commit rolls back to


def _rescale_groups(optimizer: torch.optim.Optimizer, old_multiplier: float, new_multiplier: float) -> None:
    # A restored param group holds base x the multiplier of the world it was saved in; this world's differs.
    for group in optimizer.param_groups:
        group["lr"] = rescale_lr(group["lr"], old_multiplier, new_multiplier)


def elastic_run(train: Callable) -> Callable:
    """Horovod's elastic loop around `train(state, ...)`: on a lost worker, roll back to the last commit,
    re-form the world with the survivors (and any host that was added), sync from rank 0, and call again.

    Use it as a decorator; every rank must call the decorated function, with an ElasticState first.

    Args:
        train: the training function, train(state, ...); it returns when training is done.

    Returns:
        The wrapped function (Horovod's hvd.elastic.run).
    """
    return hvd.elastic.run(train)


# ------------------------------------------------------------------------------------------ checkpoints

def _fingerprint(model: torch.nn.Module) -> str:
    return ckpt.fingerprint((n, tuple(t.shape)) for n, t in model.state_dict().items())


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout on a GPU draws from its generator
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    epoch: int, step: int, global_step: int, keep: int = 3, **extra: Any) -> Path | None:
    """Write a checkpoint on rank 0 (atomically) and keep the newest `keep`; every rank must call it.

    `epoch` and `step` (batches done in that epoch) say where to resume the data order; `global_step`
    names the file. Also stored: the optimizer's step count and every rank's RNG states (torch, numpy,
    random), so a resumed run continues exactly. Ends with a barrier: the other ranks wait for the write.

    Args:
        directory: where to write "ckpt-<global_step:08d>.pt"; created if missing.
        model: the module whose state_dict is saved.
        optimizer: the optimizer (prepare()'s, for its step count) whose state_dict is saved.
        epoch: the epoch the data position is in.
        step: batches already done in that epoch (0 at an epoch end).
        global_step: the global optimizer step; names the file.
        keep: how many of the newest checkpoints to keep, this one included (default 3).
        extra: plain values (numbers, strings, lists, dicts, tensors) returned by load_checkpoint.

    Returns:
        The path on rank 0, None elsewhere.

    Raises:
        ConfigError: `keep` is not an integer >= 1 (on every rank, before any collective).
        CheckpointError: rank 0 could not write the file (read-only directory, disk full: the path and the
            OS error), on every rank; the older checkpoints are kept.
    """
    model = _plain(model)
    ckpt.check_keep(keep)
    rng = hvd.allgather_object(_rng_state(), name="hvdp.rng")  # every rank's RNG, so a resumed run continues exactly
    if hvd.rank() != 0:
        return _horovod.save_on_root(hvd, directory, "", None, keep)
    schedule = getattr(optimizer, "hvdp_schedule", None)
    payload = {
        "hvdp": ckpt.make_meta(framework="torch", step=global_step, epoch=epoch, world_size=hvd.size(),
                               model_fingerprint=_fingerprint(model)),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "position": {"epoch": int(epoch), "step": int(step),
                     "optimizer_steps": schedule.step if schedule else 0,
                     "lr_multiplier": schedule.multiplier if schedule else 1.0},
        "rng": rng,
        "extra": extra,
    }
    return _horovod.save_on_root(hvd, directory, ckpt.checkpoint_name(global_step, "pt"),
                                 lambda f: torch.save(payload, f), keep)


def load_checkpoint(directory: str | Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loader: torch.utils.data.DataLoader | None = None) -> dict | None:
    """Restore the newest checkpoint in `directory` on every rank; None (and nothing changed) if there is none.

    Rank 0 reads the file with torch.load(weights_only=True) and broadcasts it; a corrupt, truncated or
    foreign file raises CheckpointError naming it, on every rank. With `loader`, its data order resumes at
    the saved epoch and step. Every rank must call it. The RNG states are restored when the world size is
    the one that saved the checkpoint.

    Args:
        directory: the checkpoint directory; None, a missing directory or one without checkpoints: nothing
            to resume, returns None.
        model: the module to load the saved state_dict into (the same parameter names and shapes).
        optimizer: the optimizer to load the saved state into (prepare()'s: its step count is restored too).
        loader: the DataLoader shard() returned, to resume its data order (default None: left as it is).

    Returns:
        {"epoch", "step", "global_step", **extra} as saved, or None when there is no checkpoint.

    Raises:
        CheckpointError: the newest file is corrupt, truncated, not hvdp's, from another framework or model;
            or, with `loader`, it was taken mid-epoch with another number of ranks. On every rank.
    """
    model = _plain(model)
    payload = _horovod.read_checkpoint_on_root(hvd, directory, lambda path: _read(path, model, loader is not None),
                                               _ARRAYS, into=_into(model, optimizer))
    if payload is None:
        return None
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    position = payload["position"]
    schedule = getattr(optimizer, "hvdp_schedule", None)
    if schedule is not None:
        schedule.step = position["optimizer_steps"]
        # The restored rates are base x the saved world's multiplier (older files lack it: recompute it
        # from the saved world size with this job's rule); make them base x this world's.
        saved = position.get("lr_multiplier")
        if saved is None:
            saved = lr_multiplier(schedule.rule, payload["hvdp"]["world_size"],
                                  backward_passes_per_step=schedule.passes, op=schedule.op)
        _rescale_groups(optimizer, saved, schedule.multiplier)
    if payload["hvdp"]["world_size"] == hvd.size():
        _set_rng_state(payload["rng"][hvd.rank()])
    if loader is not None:
        target = loader if hasattr(loader, "set_position") else loader.batch_sampler
        target.set_position(position["epoch"], position["step"])
    return {"epoch": position["epoch"], "step": position["step"], "global_step": payload["hvdp"]["step"],
            **payload["extra"]}


def _read(path: Path, model: torch.nn.Module, resharding_data: bool) -> dict:
    # Memory-mapped: the tensors are paged in from the file as they are streamed, not read into memory.
    try:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            payload = torch.load(path, map_location="cpu", weights_only=True)  # an old, non-zip file
    except OSError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}. The file is corrupt, "
                              f"truncated or not a PyTorch checkpoint; delete it to resume from an older one")
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not an hvdp checkpoint")
    meta = ckpt.check_meta(payload.get("hvdp"), path, framework="torch", model_fingerprint=_fingerprint(model))
    if resharding_data and meta["world_size"] != hvd.size() and payload["position"]["step"]:
        raise CheckpointError(
            f"the checkpoint was taken mid-epoch with {meta['world_size']} ranks and this job has {hvd.size()}: "
            f"its data position cannot be resharded exactly; resume with {meta['world_size']} ranks, or from an "
            f"end-of-epoch checkpoint")
    return payload


class _TorchArrays(_horovod.ArrayOps):
    """Tensors for _horovod.broadcast_tree: their bytes, viewed as uint8 in host memory, go through Horovod's
    broadcast; the receiving side's load_state_dict puts them on the model's device."""

    def is_array(self, x) -> bool:
        return isinstance(x, torch.Tensor)

    def describe(self, x):
        return tuple(x.shape), x.dtype, x.numel() * x.element_size()

    def empty(self, ref):
        return torch.empty(ref.shape, dtype=ref.dtype)

    def fits(self, x, ref) -> bool:
        return (isinstance(x, torch.Tensor) and tuple(x.shape) == ref.shape and x.dtype == ref.dtype
                and x.device.type == "cpu" and x.is_contiguous())

    def as_bytes(self, x):  # a GPU tensor is sent from a host copy (and arrives in host memory elsewhere)
        return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    def broadcast(self, hvd_, buffer, name: str) -> None:
        hvd_.broadcast_(torch.from_numpy(buffer), root_rank=0, name=name)


_ARRAYS = _TorchArrays()


def _into(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable:
    """broadcast_tree's destinations for a checkpoint or an optimizer sync: the model's own tensors and the
    optimizer's existing state, so that those arrive in place instead of as a second copy."""
    params = model.state_dict() if model is not None else {}
    state = optimizer.state_dict()["state"]

    def into(path, ref):
        if len(path) == 2 and path[0] == "model":
            return params.get(path[1])
        if len(path) == 4 and path[:2] == ("optimizer", "state"):
            return state.get(path[2], {}).get(path[3])
        return None
    return into


__all__ = ["init", "world", "device", "prepare", "compile", "broadcast", "current_lr", "shard", "ShardSampler",
           "barrier", "average", "evaluate", "log", "progress", "SyncBatchNorm", "check_consistency", "check_finite",
           "save_checkpoint", "load_checkpoint", "ElasticState", "elastic_run", "HvdpError"]
