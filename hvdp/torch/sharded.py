"""Sharded optimizer state (ZeRO-1/2) for prepare(..., shard_optimizer_state=True).

Two layouts (hvdp.torch.sharded_layout decides which parameter gets which). An element-wise optimizer (SGD,
Adam, AdamW, ...: sharded_layout.ELEMENT_WISE) gets flat buckets: the parameters are laid out, param group by
param group, in flat dtype-homogeneous buckets of up to BUCKET_BYTES; each bucket is split across the ranks as
Horovod's reducescatter splits a first dimension (`numel // N` elements each, the first `numel % N` ranks one
more). At step(), each bucket's gradients are reduce-scattered (averaged or summed, as the allreduce path would),
so a rank receives only its slice; the wrapped optimizer, whose param groups hold one flat shard parameter per
bucket, steps that slice (its state exists only for it); the updated slices are all-gathered back into the model's
parameters. Any other optimizer (Adafactor, Muon, a user's class) gets the per-parameter layout: each parameter
is stepped whole, in its shape, by one rank (ZeroRedundancyOptimizer's greedy balance), which receives its
all-reduced gradient and broadcasts the updated parameter.

A parameter that no rank used in a step (its gradient None on every rank, agreed in the all-reduce that also
agrees on inf/NaN) is skipped as torch skips it; one of a flat bucket moves to the per-parameter layout then.
A parameter that becomes trainable after prepare() (requires_grad_(True)) and the parameters of a group added by
add_param_group() join the layout (new buckets, or new owners by the same balance), as ZeroRedundancyOptimizer
re-partitions.

Its state_dict side (the unsharded layout, the streamed checkpoint) is hvdp.torch.sharded_state's.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import time
from time import perf_counter

import torch

from hvdp import _horovod, _stragglers
from hvdp.core.errors import ConfigError
from hvdp.core.watchdog import WAITING
from hvdp.torch.optimizer import _counted
from hvdp.torch import sharded_clip
from hvdp.torch.runtime import COMPUTING, hvd
from hvdp.torch.sharded_layout import _Bucket, _Owned, _Piece, balance, element_wise, pack, split
from hvdp.torch.sharded_state import ShardedStateDict, describe_state
from hvdp.torch.weights import _Batch, _gradient_hook, at_end_of_backward

__all__ = ["BUCKET_BYTES", "ShardedOptimizer", "split"]

# Per bucket: the unit of the reduce-scatter, the all-gather and the checkpoint gather. A smaller bucket's
# reduce-scatter starts earlier in the backward pass: on hvdp bench's GPT (10M parameters, AdamW, np=2, MPI),
# 8 MiB buckets ran at 0.96x unsharded hvdp (median of 5 interleaved rounds), 32 MiB ones at 0.88x.
BUCKET_BYTES = 8 * 2**20
# During the backward pass, at most this many buckets' bytes of full flat gradients are held in reductions in flight
# (Horovod keeps each op's input and output until it is synchronized): before a bucket starts, the reductions
# already done are taken (their full copies freed), then, in a step whose order is agreed (_Flight), the oldest
# until the new one fits. Without it every bucket's full copy lived until step(): after backward() a rank held
# the whole gradient plus its shard (hvdp bench's GPT, 10M parameters, np=2: 57.5 MiB against 38.3 of .grad on
# the allreduce path).
IN_FLIGHT_BUCKETS = 2
# The longest the backward pass waits for one reduction (_make_room); past it, it stops waiting for this step.
WAIT_SECONDS = 1.0

# glibc's mmap threshold, fixed by the first sharded prepare() (_fix_mmap_threshold); glibc's M_MMAP_THRESHOLD
MMAP_THRESHOLD, _M_MMAP_THRESHOLD = 128 << 10, -3
_mmap_fixed: list = []


def _fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 128 KiB (its initial value), so that a freed buffer at least that large goes
    back to the system at once, unless MALLOC_MMAP_THRESHOLD_ is set (the user's choice) or the C library is not
    glibc. Once per process; returns whether it was set.

    glibc raises its threshold to the size of each mmap-ed block freed (up to 32 MiB): after the first 8 MiB
    bucket is freed, every tensor up to that size comes from malloc's heaps, which keep what is freed. The step's
    transient buffers (flat buckets, gathered parameters, the optimizer's temporaries) then stay resident beside
    the next ones: on hvdp bench's GPT (10M parameters, AdamW, np=2, MPI) the sharded run's peak RSS rose 273 MiB
    above its level before prepare() with glibc's moving threshold, 172 MiB with it fixed (the allreduce path:
    301 and 208). Each large tensor is then mmap-ed and faulted in anew; what that cost in throughput is in
    docs/pytorch.md#sharded-optimizer-state-zero-12."""
    if _mmap_fixed:
        return _mmap_fixed[0]
    done = False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        try:
            done = bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        except (OSError, AttributeError):  # no mallopt: not glibc
            done = False
    _mmap_fixed.append(done)
    return done


class ShardedOptimizer(ShardedStateDict, torch.optim.Optimizer):
    """What prepare(..., shard_optimizer_state=True) returns: the wrapped optimizer stepping this rank's shard.

    Its param_groups are the wrapped optimizer's (same dicts: the learning rates hvdp scales, with one flat
    shard parameter per bucket and the parameters this rank owns as "params"); its state is the shard's only.
    Every rank must call step(), synchronize(), clip_grad_norm_(), consolidate_state_dict() and
    add_param_group() (collectives, or a layout that must stay the same on every rank), in the same order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule, *, op, compression,
                 bucket_bytes: int | None = None):
        """Wrap `optimizer` (already broadcast from rank 0): lay its parameters out and make its param groups
        step this rank's shard, converting any state it holds.

        Args:
            optimizer: a torch optimizer; its param groups are changed in place.
            schedule: prepare()'s LR schedule (optimizer._Schedule).
            op: Horovod's reduction (hvd.Average or hvd.Sum).
            compression: Horovod's gradient compression (hvd.Compression.none or .fp16).
            bucket_bytes: the largest bucket (default BUCKET_BYTES).

        Raises:
            ConfigError: `optimizer` is torch.optim.LBFGS (its step re-evaluates a closure on the whole model).
        """
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("shard_optimizer_state=True cannot shard torch.optim.LBFGS: its step() calls a closure "
                              "that re-evaluates the loss on the whole model, many times per step; use "
                              "shard_optimizer_state=False", rank=hvd.rank())
        self._inner, self.hvdp_schedule = optimizer, schedule
        self._op, self._compression = op, compression
        self._rank, self._size = hvd.rank(), hvd.size()
        self._queued = False  # the end-of-backward callback is queued for the running pass (issue 47)
        # Horovod's Gloo reducescatter (gloo::ReduceScatterHalvingDoubling) leaves the Gloo transport slow for
        # what follows it: after one of 1,000 floats, np=2, an allgather of 7.8 MB took 9.3 s and a broadcast
        # 5.1 s (20 ms and 9 ms before it). Under Gloo the gradients are all-reduced in place instead and each
        # rank keeps its slice: Gloo's ring all-reduce is a reduce-scatter and an all-gather, so twice the
        # bytes, and the same values as the allreduce path (docs/pytorch.md#sharded-optimizer-state-zero-12).
        self._gloo = self._size > 1 and hvd.gloo_enabled()
        self._bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._per_param = not element_wise(optimizer)
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        self._names = [g.pop("param_names", None) for g in optimizer.param_groups]
        existing = optimizer.state_dict() if optimizer.state else None
        self._members = {i for i, p in enumerate(self._params()) if p.requires_grad}  # in the layout
        self._specs = pack(self._groups, sorted(self._members), self._bucket_bytes)  # the flat buckets' packing
        self._moved: set[int] = set()   # per parameter for good (flat layout: a parameter once used by no rank)
        self._owner: dict[int, int] = {}
        self._buckets: list[_Bucket] = []
        self._owned: list[_Owned] = []
        self._stand_in = None  # a 0-element parameter for GradScaler on a rank that steps nothing (_stand_in_grad)
        self._passes, self._counts = schedule.passes, {}
        self._reduce_after = self._passes  # backward passes whose gradients are summed before they are reduced
        # this step's reductions: every unit started (("b", bucket) or ("o", owned index)) -> its place in the
        # backward pass's order (1, 2, ...; 0: started by synchronize()), and those not yet synchronized, in order
        self._started: dict[tuple, int] = {}
        self._flight: dict[tuple, tuple] = {}  # unit -> (handle, compression context, bytes held)
        self._ordered = False  # the last step's order was every rank's (_agree): the backward pass may wait
        self._used: set[int] = set()  # the parameters that got a gradient on this rank in this step
        self._skipped: set[int] = set()  # those that got one on no rank (agreed in synchronize())
        self.hooks, self._hooked = [], set()
        self._build(optimizer.param_groups, keep=False)
        optimizer.state.clear()
        self._ready = False  # torch's __init__ calls add_param_group(): torch's own, until this is set
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state  # the same objects
        self._ready = True
        sharded_clip.LIVE.add(self)
        sharded_clip.guard_clipping()
        _fix_mmap_threshold()
        self._synchronized, self._consolidated = False, None
        # Overlap with the backward pass: a bucket's reduce-scatter (an owned parameter's all-reduce) starts as
        # soon as each of its parameters has accumulated its k-th gradient (Horovod's counting), and its full
        # gradients are freed then.
        self._hook(sorted(self._members), late=False)
        if existing is not None:
            self.load_state_dict(existing)

    # ------------------------------------------------------------------------------------------- the layout

    def _params(self) -> list[torch.Tensor]:
        return [p for params in self._groups for p in params]

    def _group_of(self) -> dict[int, int]:
        return {i: g for i, g in enumerate(g for g, params in enumerate(self._groups) for _ in params)}

    def _build(self, param_groups: list, keep: bool) -> None:
        """Lay out the members from _specs, _moved and _owner for this world; with `keep`, a bucket whose pieces
        are unchanged keeps its shard (and so its state), an owned parameter its owner; new buckets get a shard
        from the model's values (no state). Sets the param groups' "params". No collective."""
        params, group_of = self._params(), self._group_of()
        old = {(b.group, tuple(p.index for p in b.pieces)): b for b in self._buckets} if keep else {}
        per_param = set(self._members) if self._per_param else self._moved & self._members
        buckets = []
        for g, indices in ([] if self._per_param else self._specs):
            flat = tuple(i for i in indices if i not in per_param and i in self._members)
            if not flat:
                continue
            b = old.get((g, flat))
            if b is None:
                b = _Bucket(group=g, dtype=params[flat[0]].dtype)
                for i in flat:
                    b.pieces.append(_Piece(params[i], i, b.numel, params[i].numel()))
                    b.numel += params[i].numel()
            buckets.append(b)
        self._buckets = buckets
        if not keep:
            self._owner = {}
        self._owner = balance({i: params[i].numel() for i in per_param}, group_of,
                              {i: r for i, r in self._owner.items() if i in per_param}, self._size)
        self._owned = [_Owned(params[i], i, group_of[i], self._owner[i]) for i in sorted(per_param)]
        with torch.no_grad():
            for b in self._buckets:
                if b.shard is None or not keep:
                    b.slices = split(b.numel, self._size)
                    start, length = b.slices[self._rank]
                    b.shard = torch.nn.Parameter(self._flat(b, lambda p: p.detach(), start, start + length))
        mine = [o for o in self._owned if o.owner == self._rank]
        for g, group in enumerate(param_groups):
            group["params"] = [b.shard for b in self._buckets if b.group == g] + [o.param for o in mine if o.group == g]
        if not self._buckets and param_groups:  # GradScaler must find a gradient on every rank (_stand_in_grad)
            if self._stand_in is None:
                first = params[min(self._members)] if self._members else torch.zeros(0)
                self._stand_in = torch.nn.Parameter(torch.zeros(0, dtype=first.dtype, device=first.device))
            param_groups[0]["params"].append(self._stand_in)
        self._bucket_of = {id(piece.param): i for i, b in enumerate(self._buckets) for piece in b.pieces}
        self._owned_of = {id(o.param): o for o in self._owned}
        self._owned_at = {o.index: o for o in self._owned}
        self._missing = [len(b.pieces) for b in self._buckets]
        self._ordered = False  # other units: the order is agreed anew

    def _hook(self, indices: list[int], late: bool) -> None:
        """Count the gradients of these parameters as they accumulate. `late`: they joined after prepare(),
        which weighted only the gradients of the parameters trainable then: give them its gradient hook too
        (the division by k accumulated passes, an epoch's uneven end), unless one is there already."""
        params = self._params()
        for i in indices:
            p = params[i]
            if id(p) in self._hooked or not p.requires_grad:  # (a frozen one: when it is unfrozen, _join)
                continue
            self._hooked.add(id(p))
            if late and not any(getattr(h, "__qualname__", "").startswith(_gradient_hook.__name__)
                                for h in (p._backward_hooks or {}).values()):
                self.hooks.append(p.register_hook(_gradient_hook(self._passes, self.hvdp_schedule)))
            self.hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _join(self, in_step: bool) -> bool:
        """Add the parameters of the param groups that became trainable since (requires_grad_(True)) to the
        layout: new buckets, or new owners (one frozen but holding loaded state is owned already: it gets its
        hooks). `in_step`: their gradients of this step were accumulated without prepare()'s weighting: applied
        here. No collective; every rank sees the same flags (a script that unfreezes on some ranks only trains
        different models: the ranks' used-flags agreement cannot see it)."""
        params = self._params()
        late = [i for i, p in enumerate(params) if p.requires_grad and id(p) not in self._hooked
                and (i not in self._members or self._per_param or i in self._moved)]
        if not late:
            return False
        if in_step:
            weight = _Batch.factor(self._passes) / self._passes
            for i in late:
                if params[i].grad is not None and weight != 1.0:
                    params[i].grad.mul_(weight)
        new = [i for i in late if i not in self._members]
        if new:
            self._members |= set(new)
            self._specs += pack(self._groups, new, self._bucket_bytes)
            self._build(self.param_groups, keep=True)
        self._hook(late, late=True)
        return True

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (fine-tuning: layers unfrozen and handed to the optimizer), as torch's does, with
        its learning rate scaled by prepare()'s rule like the others: its trainable parameters join the layout
        (new flat buckets, or new owners by ZeroRedundancyOptimizer's balance, continued). Every rank must call
        it, with the same group.

        Args:
            param_group: {"params": ..., settings}, as torch.optim.Optimizer.add_param_group takes it.

        Raises:
            ConfigError: some of its parameters are in the optimizer already (on every rank).
        """
        if not self._ready:
            return torch.optim.Optimizer.add_param_group(self, param_group)
        group = dict(param_group)
        params = group.pop("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = group.pop("param_names", None)
        # torch's defaults and checks (duplicates across groups included), on a stand-in group of the real
        # parameters: then the group holds this rank's shards instead
        present = {id(p) for p in self._params()}
        if any(id(p) in present for p in params):
            raise ConfigError("add_param_group(): some of its parameters are in the optimizer already (torch refuses "
                              "a parameter in two groups); add only the new ones", rank=self._rank)
        probe = {**group, "params": params}
        torch.optim.Optimizer.add_param_group(self._inner, probe)
        self.param_groups.pop()  # (the same list as the wrapped optimizer's)
        if "lr" in probe:
            probe["lr"] = self.hvdp_schedule.rate(probe["lr"], scaled_by=1.0)  # prepare()'s rule, this world
        start = sum(len(p) for p in self._groups)
        self._groups.append(params)
        self._names.append(list(names) if names is not None else None)
        new = [start + k for k, p in enumerate(params) if p.requires_grad]
        self._members |= set(new)
        self._specs += pack(self._groups, new, self._bucket_bytes)
        self.param_groups.append({**probe, "params": []})
        self._build(self.param_groups, keep=True)
        self._hook(new, late=True)

    def relayout(self, size: int, rank: int, layout: tuple | None = None) -> None:
        """Lay the parameters out anew for a world of `size` ranks in which this one is `rank` (after an elastic
        reset; hvdp.torch.sharded_elastic.reshard then fills the state): new shards from the model's values, owners
        balanced anew, no state, nothing in flight. `layout`: another rank's layout() to take (a worker that
        joined has prepare()'s). No collective."""
        self._rank, self._size = rank, size
        self._gloo = size > 1 and hvd.gloo_enabled()
        if layout is not None:
            specs, moved, members = layout
            self._specs, self._moved = [(g, list(ix)) for g, ix in specs], set(moved)
            joined = set(members) - self._members
            self._members = set(members)
            self._hook(sorted(joined), late=True)
        self._build(self.param_groups, keep=False)
        self.state.clear()
        self._started.clear()
        self._flight.clear()  # (the reset dropped Horovod's ops)
        self._counts.clear()
        self._used = set()
        self._synchronized, self._consolidated = False, None

    def layout(self) -> tuple:
        """What relayout() needs to lay the parameters out as this rank does: (the flat buckets' packing, the
        parameters moved to the per-parameter layout, the parameters in the layout). Picklable."""
        return [(g, list(ix)) for g, ix in self._specs], sorted(self._moved), sorted(self._members)

    @staticmethod
    def _flat(bucket: _Bucket, value, start: int, end: int) -> torch.Tensor:
        """The elements [start, end) of the bucket's flat layout of value(param) (None: zeros)."""
        parts = []
        for piece, lo, hi in bucket.overlaps(start, end):
            v = value(piece.param)
            parts.append(torch.zeros(hi - lo, dtype=bucket.dtype, device=piece.param.device) if v is None
                         else v.reshape(-1)[lo:hi].to(bucket.dtype))
        if not parts:
            device = bucket.pieces[0].param.device
            return torch.zeros(0, dtype=bucket.dtype, device=device)
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    # ------------------------------------------------------------------------------------------- the step

    def _accumulated(self, param: torch.Tensor) -> None:
        # autograd's hook after a gradient was accumulated into param.grad, during the backward pass
        if not self._queued:  # hvdp (issue 47): mark this pass's last gradient ready when the pass ends
            self._queued = at_end_of_backward(self._end_of_backward)
        seen = self._counts[id(param)] = self._counts.get(id(param), 0) + 1
        if seen > self._reduce_after:
            raise ConfigError(f"a gradient was computed {seen} times before step(), with backward_passes_per_step="
                              f"{self._reduce_after}: call step() every {self._reduce_after} backward pass(es)",
                              rank=self._rank)
        if seen == self._reduce_after:
            i = self._bucket_of.get(id(param))
            if i is not None:
                self._missing[i] -= 1
                if self._missing[i] == 0:
                    self._reduce(i)
            elif id(param) in self._owned_of:
                self._reduce_owned(self._owned_of[id(param)])

    def _end_of_backward(self) -> None:
        self._queued = False
        _stragglers.backward_done()

    def _reduce(self, i: int, backward: bool = True) -> None:
        """Start bucket i's reduce-scatter; free the model's full gradients it was copied from (ZeRO-2). In the
        backward pass, first make room for its flat copy (_make_room)."""
        b = self._buckets[i]
        for piece in b.pieces:
            if piece.param.grad is not None:
                self._used.add(piece.index)
        if backward:
            self._make_room(b.numel * b.dtype.itemsize)
        sent, ctx = self._compression.compress(self._flat(b, lambda p: p.grad, 0, b.numel))
        if self._gloo:  # in place, each rank keeping its slice in synchronize(): see __init__
            handle = hvd.allreduce_async_(sent, name=f"hvdp.zero.grad.{i}", op=self._op)
        else:
            handle = hvd.reducescatter_async(sent, name=f"hvdp.zero.grad.{i}", op=self._op)
        self._begin(("b", i), handle, ctx, sent.numel() * sent.element_size(), backward)
        for piece in b.pieces:
            piece.param.grad = None

    def _reduce_owned(self, o: _Owned, backward: bool = True) -> None:
        """Start the all-reduce of an owned parameter's gradient (its owner keeps the result)."""
        grad = o.param.grad
        if grad is not None:
            self._used.add(o.index)
        if backward:
            self._make_room(o.param.numel() * o.param.element_size())
        sent, ctx = self._compression.compress(torch.zeros_like(o.param) if grad is None else grad)
        handle = hvd.allreduce_async(sent, name=f"hvdp.zero.own.{o.index}", op=self._op)
        self._begin(("o", o.index), handle, ctx, sent.numel() * sent.element_size(), backward)
        o.param.grad = None

    def _begin(self, unit: tuple, handle, ctx, nbytes: int, backward: bool) -> None:
        self._started[unit] = len(self._started) + 1 if backward else 0  # (those of synchronize() come last)
        self._flight[unit] = (handle, ctx, nbytes)

    def _make_room(self, nbytes: int) -> None:
        """Before a reduction of `nbytes` starts in the backward pass: take every reduction in flight that is done
        (its full copy freed now, not at step()); then, if this step's order is every rank's (_ordered), wait for
        the oldest until at most IN_FLIGHT_BUCKETS buckets' bytes are in flight with the new one.

        Waiting in the backward pass is safe only when every rank starts the same reductions in the same order:
        a rank waits for a reduction that every other rank has started, or will start before it waits itself.
        Where the ranks' orders differ (a parameter used on some ranks only starts its bucket at synchronize()
        there), rank A could wait for a bucket that rank B starts only at synchronize(), while B waits for one
        that A starts only then: both hang. So _agree() checks the order each step (two numbers per unit in the
        all-reduce it runs anyway) and a step waits only after a step whose order every rank shared. That order
        may still change in this step (an expert routed on one rank only): a wait lasts at most WAIT_SECONDS,
        after which this step waits no more (a hang becomes a stall of that long, and the memory bound is lost
        for the step)."""
        for unit, (handle, _, _) in list(self._flight.items()):
            if hvd.poll(handle):
                self._finish(unit)
        if not self._ordered:
            return
        limit = IN_FLIGHT_BUCKETS * self._bucket_bytes
        while self._flight and sum(n for _, _, n in self._flight.values()) + nbytes > limit:
            unit = next(iter(self._flight))
            handle, deadline = self._flight[unit][0], time.monotonic() + WAIT_SECONDS
            waiting = perf_counter()  # hvdp (issue 47): a wait for the other ranks, inside the backward pass
            try:
                while not hvd.poll(handle):
                    if time.monotonic() > deadline:
                        self._ordered = False
                        return
                    time.sleep(0.0002)
            finally:
                _stragglers.collective_wait(waiting)
            self._finish(unit)

    def _finish(self, unit: tuple) -> None:
        """Synchronize a reduction in flight: a bucket's shard parameter gets its slice of the result, an owned
        parameter's owner the whole; Horovod drops its input and output (the full flat copy)."""
        handle, ctx, _ = self._flight.pop(unit)
        waiting = perf_counter()
        try:
            reduced = hvd.synchronize(handle)
        finally:
            _stragglers.collective_wait(waiting)
        kind, key = unit
        if kind == "b":
            b = self._buckets[key]
            if self._gloo:
                start, length = b.slices[self._rank]
                reduced = reduced[start:start + length].clone()  # the bucket's full copy is freed
            b.shard.grad = self._compression.decompress(reduced, ctx).to(b.dtype)
        else:
            o = self._owned_at[key]
            if o.owner == self._rank:
                o.param.grad = self._compression.decompress(reduced, ctx).to(o.param.dtype).view_as(o.param)
        del reduced

    def sum_passes(self, k: int) -> None:
        """Reduce each gradient after k backward passes, summed as they come, where prepare() was given
        backward_passes_per_step=1: the loss is divided by k already and the rate is not scaled by k (Lightning's
        accumulate_grad_batches; hvdp.lightning calls it). The model's full gradients are held until the k-th
        pass, as without sharding; a step after fewer passes (an epoch's end) reduces what there is when
        synchronize() runs."""
        if self._passes != 1 or not isinstance(k, int) or k < 1:
            raise ConfigError(f"sum_passes({k!r}): k must be an integer >= 1, on an optimizer prepared with "
                              f"backward_passes_per_step=1 (got {self._passes})", rank=self._rank)
        self._reduce_after = k

    def synchronize(self) -> None:
        """Finish this step's reductions: each bucket's shard parameter gets its slice of the average (or sum,
        op="sum") over the ranks, each owned parameter on its owner its whole average. Buckets (parameters) whose
        gradients all came started during the backward pass (and those done were taken there); the others (a
        parameter without a gradient counts as zeros, a last step of fewer than k passes) start here, all before
        any is waited for. The model's full gradients are freed (set to None). A parameter that got a gradient on
        no rank is skipped by the step, as torch skips it (its
        gradient None; one of a flat bucket moves to the per-parameter layout). If the averaged gradients hold an
        inf/NaN in any rank's slice, every rank's shard gradients hold one afterwards, so that a GradScaler skips
        the step on every rank. Both agreements are one all-reduce of a flag per parameter. step() calls it when
        it has not run yet; call it yourself to read the shard gradients, and before GradScaler.unscale_(). A
        second call in the same step does nothing. Every rank must call it."""
        if self._synchronized:
            return
        self._join(in_step=True)
        for b in self._buckets:
            for piece in b.pieces:
                if self._counts.get(id(piece.param)) or piece.param.grad is not None:
                    self._used.add(piece.index)
        for i in range(len(self._buckets)):
            if ("b", i) not in self._started:
                self._reduce(i, backward=False)
        for o in self._owned:
            if ("o", o.index) not in self._started and o.param.requires_grad:  # (frozen on every rank: no gradient)
                self._reduce_owned(o, backward=False)
        for o in self._owned:
            if ("o", o.index) not in self._started:
                o.param.grad = None
        while self._flight:
            self._finish(next(iter(self._flight)))
        waiting = perf_counter()
        try:
            self._agree()
        finally:
            _stragglers.collective_wait(waiting)
        self._started.clear()
        self._counts.clear()
        self._used = set()
        self._missing = [len(b.pieces) for b in self._buckets]
        self._synchronized = True
        _counted(self.hvdp_schedule)

    def _grads(self) -> list[torch.Tensor]:
        """This rank's non-empty gradients the wrapped optimizer will read."""
        return ([b.shard.grad for b in self._buckets if b.shard.grad is not None and b.shard.grad.numel()]
                + [o.param.grad for o in self._owned if o.owner == self._rank and o.param.grad is not None
                   and o.param.grad.numel()])

    def _agree(self) -> None:
        """Agree with every rank, in one all-reduce, on which parameters got a gradient on some rank this step and
        whether the averaged gradients hold an inf/NaN; skip the unused ones and spread the inf/NaN.

        Unused: torch's optimizers skip a parameter whose .grad is None (AdamW neither decays it nor counts the
        step); here every rank's reduction got zeros for it. An owned one gets grad None again. A flat bucket
        cannot skip part of its shard (its step count is shared): its unused parameters move to the per-parameter
        layout, their state and the bucket's re-split from one all-gather per bucket and state key (_move), only
        at the steps where that happens.

        Non-finite: a GradScaler (fp16 AMP) looks for inf/NaN in the gradients of the optimizer's parameters, here
        this rank's shard only: an overflow in one rank's slice would make that rank skip the step and back off its
        scale while the others step (diverged replicas, and collectives out of step). A rank whose shard is finite
        then puts a NaN into it, so that GradScaler.unscale_ finds one on every rank: every rank skips the step and
        updates the scale alike, as on the allreduce path. Without a GradScaler such a step was broken already (an
        inf/NaN reaches the weights); a rank holding no element at all gets a one-element NaN gradient (the first
        bucket's, or the 0-element stand-in's), taken back in step()."""
        members = sorted(self._members)
        grads = self._grads()
        # Every element is finite exactly when the least and the greatest are (aminmax propagates a NaN): one
        # pass that allocates nothing, where isfinite(g).all() wrote a flag per element (8.6 ms against 0.8 ms
        # for 5M floats on one CPU thread; on hvdp bench's GPT most of what the sharded step lost to hvdp's).
        local = bool(grads) and bool(torch.stack([torch.isfinite(torch.stack(torch.aminmax(g))).all()
                                                  for g in grads]).all().logical_not())
        # the order of this step's reductions: each unit's place p in this rank's backward pass (0: started by
        # synchronize()), summed as p and p*p: every rank had the same p > 0 exactly when N * sum(p*p) equals
        # sum(p)**2 (Cauchy-Schwarz) with sum(p) > 0; float64 holds these sums exactly
        units = [("b", i) for i in range(len(self._buckets))] + [("o", o.index) for o in self._owned]
        places = [float(self._started.get(u, 0)) for u in units]
        flags = torch.tensor([float(local)] + [float(i in self._used) for i in members] + places
                             + [p * p for p in places], dtype=torch.float64)
        if self._size > 1:
            flags = hvd.allreduce(flags, op=hvd.Sum, name="hvdp.zero.nonfinite")
        found = bool(flags[0] > 0)
        used = flags[1:1 + len(members)].tolist()
        sums, squares = flags[1 + len(members):1 + len(members) + len(units)], flags[1 + len(members) + len(units):]
        self._ordered = bool(units) and bool(((sums > 0) & (sums * sums == squares * self._size)).all())
        unused = {i for i, f in zip(members, used) if f == 0}
        self._skipped = unused  # not stepped: nothing to broadcast after the step
        for o in self._owned:
            if o.index in unused:
                o.param.grad = None
        moving = {piece.index for b in self._buckets for piece in b.pieces if piece.index in unused}
        if moving:
            self._move(moving)
        self._stand_in_grad(math.nan if found and not local else None)

    def _stand_in_grad(self, value) -> None:
        """Give the 0-element stand-in (no flat bucket: a rank that may step nothing) a gradient, so that a
        GradScaler finds one on every rank; `value` (NaN) into one gradient of this rank when another rank's holds
        an inf/NaN."""
        if self._stand_in is not None:
            self._stand_in.grad = torch.zeros_like(self._stand_in)
        if value is None:
            return
        with torch.no_grad():
            grads = self._grads()
            if grads:
                grads[0].view(-1)[0] = value
            else:  # a one-element stand-in, set through .data (torch's .grad setter refuses another size)
                target = self._buckets[0].shard if self._buckets else self._stand_in
                if target is not None:
                    target.grad.data = torch.full((1,), value, dtype=target.dtype, device=target.device)

    def _move(self, indices: set[int]) -> None:
        """Move these parameters (each in a flat bucket, unused this step) to the per-parameter layout, with
        their state, and re-split what remains of their buckets with its state and this step's gradients. Each
        affected bucket's gradient and per-element state are all-gathered once (a bucket at a time). Every
        rank, with the same indices."""
        affected = [b for b in self._buckets if any(p.index in indices for p in b.pieces)]
        described = self._describe(affected)
        per_keys, grads, states = set(), {}, {}
        for n, (b, (per, other, on_device)) in enumerate(zip(affected, described)):
            per_keys |= set(per)
            full = self._all(b.shard.grad if b.shard.grad is not None else torch.zeros_like(b.shard),
                             f"hvdp.zero.move.grad.{n}")
            mine = self.state.pop(b.shard, {})
            gathered = {k: self._all(mine[k] if k in mine else torch.zeros(b.shard.shape, dtype=dtype,
                                                                           device=b.shard.device),
                                     f"hvdp.zero.move.{n}.{k}") for k, dtype in per.items()}
            for piece in b.pieces:
                cut = slice(piece.offset, piece.offset + piece.numel)
                grads[piece.index] = full[cut].clone()
                if per or other:
                    states[piece.index] = {**{k: v[cut].clone() for k, v in gathered.items()},
                                           **{k: (v.clone().to(piece.param.device) if k in on_device else v.clone())
                                              if torch.is_tensor(v) else v for k, v in other.items()}}
            del full, gathered
        self._moved |= indices
        self._build(self.param_groups, keep=True)
        with torch.no_grad():
            for b in self._buckets:
                if not any(p.index in grads for p in b.pieces):
                    continue  # a bucket kept as it was
                index = {id(p.param): p.index for p in b.pieces}
                start, length = b.slices[self._rank]
                b.shard.grad = self._flat(b, lambda p: grads[index[id(p)]], start, start + length)
                first = states.get(b.pieces[0].index)
                if first:
                    self.state[b.shard] = {
                        k: (self._flat(b, lambda p, k=k: states[index[id(p)]][k], start, start + length).to(v.dtype)
                            if k in per_keys else v) for k, v in first.items()}
        for o in self._owned:
            if o.index in indices and o.owner == self._rank and o.index in states:
                self.state[o.param] = {k: v.view(o.param.shape) if k in per_keys else v
                                       for k, v in states[o.index].items()}

    def _all(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allgather(tensor.detach(), name=name) if self._size > 1 else tensor.detach()

    def _describe(self, buckets: list[_Bucket]) -> list[tuple[dict, dict, list]]:
        """Per bucket, agreed by every rank (one allgather_object): its per-element state keys ({key: dtype}) and
        its other entries (the step count: of the first rank that has any; a rank with an empty shard may have
        none), copied to the CPU, and which of those were not on it."""
        mine = []
        for b in buckets:
            mine.append(describe_state(self.state.get(b.shard, {}), b.shard))
        every = hvd.allgather_object(mine, name="hvdp.zero.move") if self._size > 1 else [mine]
        out = []
        for n in range(len(buckets)):
            per = {}
            for d in every:
                per.update(d[n][0])
            first = next((d[n] for d in every if d[n][1]), ({}, {}, []))
            out.append((dict(sorted(per.items())), first[1], first[2]))
        return out

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For code written for the allreduce path: step() reduces the gradients once per step whether or not
        synchronize() ran, so this context changes nothing. The clipping recipe of that path (synchronize(),
        torch.nn.utils.clip_grad_norm_(model.parameters(), ...), this context around step()) clips the shards:
        see hvdp.torch.sharded_clip."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as torch.nn.utils.clip_grad_norm_ on the full
        gradients would: the norm is computed across the shards (one all-reduce of a number).

        Reduces the gradients first if synchronize() has not run. Every rank must call it.

        Args:
            max_norm: the largest norm allowed.
            norm_type: the p of the p-norm (default 2.0); math.inf for the largest absolute value.

        Returns:
            The global norm before clipping (a float32 tensor, the same on every rank).

        Raises:
            ConfigError: `norm_type` is not a number > 0.
        """
        if not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ConfigError(f"norm_type must be a number > 0 (or math.inf), got {norm_type!r}", rank=self._rank)
        if not self._synchronized:
            self.synchronize()
        grads = self._grads()
        norms = [torch.linalg.vector_norm(g.double(), norm_type) for g in grads]
        nothing = torch.zeros((), dtype=torch.float64)  # a rank whose shards are empty
        if math.isinf(norm_type):
            local = torch.stack(norms).max() if norms else nothing
            total = hvd.allreduce(local.cpu(), op=hvd.Max, name="hvdp.zero.norm.max")
        else:
            local = torch.stack([n ** norm_type for n in norms]).sum() if norms else nothing
            total = hvd.allreduce(local.cpu(), op=hvd.Sum, name="hvdp.zero.norm.sum") ** (1.0 / norm_type)
        total = total.float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def step(self, closure=None):
        """Reduce-scatter the gradients (unless synchronize() ran), step the wrapped optimizer on this rank's
        shard at this step's rate (the warmup applied around it), and all-gather the updated parameters into
        the model. Every rank must call it.

        Args:
            closure: not supported (a closure would recompute the loss on the full model per shard).

        Raises:
            ConfigError: a closure was given.
        """
        if closure is not None:
            raise ConfigError("a sharded optimizer's step() takes no closure", rank=self._rank)
        s = self.hvdp_schedule
        began = _stragglers.step_begin()  # hvdp (issue 47): the update is this call less its collectives
        _horovod.progress(s.step, WAITING)
        if not self._synchronized:
            self.synchronize()
        for b in self._buckets:  # the stand-in of _agree() on a rank without elements
            if b.shard.numel() == 0 and b.shard.grad is not None and b.shard.grad.numel():
                b.shard.grad = b.shard.grad[:0]
        if self._stand_in is not None:
            self._stand_in.grad = None  # never stepped
        with torch.no_grad():  # the model may have been loaded or changed since the last step: its values rule
            for b in self._buckets:  # piece by piece into the shard: no flat copy of it on the way
                start, _ = b.slices[self._rank]
                flat = b.shard.view(-1)
                for piece, lo, hi in b.overlaps(start, start + b.shard.numel()):
                    at = piece.offset + lo - start
                    flat[at:at + hi - lo].copy_(piece.param.detach().reshape(-1)[lo:hi])
        kept = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = s.rate(g["lr"], step=s.step)
        try:
            self._inner.step()
        finally:
            for g, lr in zip(self.param_groups, kept):
                g["lr"] = lr
        waiting = perf_counter()
        try:
            self._gather_parameters()
        finally:
            _stragglers.collective_wait(waiting)
        self._synchronized = False
        s.step += 1
        _counted(s)
        _horovod.progress(s.step, COMPUTING)
        _stragglers.step_end(hvd, began)  # every K steps, the straggler report (a collective: every rank is here)

    def _gather_parameters(self) -> None:
        """Broadcast each owned parameter from its owner; all-gather the updated shards into the model's
        parameters, one bucket at a time: each gathered bucket is a transient copy of its parameters, and with
        every bucket's gather in flight at once (fused by Horovod into one buffer as large) the step's peak held
        a second copy of the model: on hvdp bench's GPT
        (AdamW, np=2, two 32 MiB buckets; glibc's mmap threshold fixed, so that RSS follows what is live) its
        peak RSS rise was 293 MiB, 256 MiB one bucket at a time. Gathers kept in flight up to 32 MiB (8 MiB
        buckets) were no faster there (26.2-27.1 samples/s against 26.3-29.0 one at a time)."""
        with torch.no_grad():
            owned = [hvd.broadcast_async_(o.param.data, root_rank=o.owner, name=f"hvdp.zero.own.param.{o.index}")
                     for o in self._owned if o.index not in self._skipped] if self._size > 1 else []
            for i, b in enumerate(self._buckets):
                full = hvd.allgather(b.shard.detach(), name=f"hvdp.zero.param.{i}")
                for piece in b.pieces:
                    piece.param.copy_(full[piece.offset:piece.offset + piece.numel].view_as(piece.param))
                del full
            for handle in owned:
                hvd.synchronize(handle)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the shard's (torch's zero_grad, on both). Parameters of the param
        groups made trainable since the last call (requires_grad_(True)) join the layout here (or, if unfrozen
        after it, at the next synchronize()).

        Args:
            set_to_none: set them to None (default) instead of zeroing them.

        Raises:
            ConfigError: a reduce-scatter started in the backward pass is still in flight (zero_grad() after
                backward() but before step(): its gradients would be half discarded).
        """
        if self._started:
            raise ConfigError("zero_grad() was called after backward() and before step() or synchronize(): "
                              "call step() (or synchronize()) first", rank=self._rank)
        for params in self._groups:
            for p in params:
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)
        self._synchronized = False
        self._join(in_step=False)  # parameters unfrozen since: their gradients counted from the next backward
