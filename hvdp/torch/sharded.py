"""Sharded optimizer state (ZeRO-1/2) for prepare(..., shard_optimizer_state=True).

The optimizer's parameters are laid out, param group by param group, in flat dtype-homogeneous buckets of up
to BUCKET_BYTES; each bucket is split across the ranks as Horovod's reducescatter splits a first dimension
(`numel // N` elements each, the first `numel % N` ranks one more). At step(), each bucket's gradients are
reduce-scattered (averaged or summed, as the allreduce path would), so a rank receives only its slice; the
wrapped optimizer, whose param groups now hold one flat shard parameter per bucket, steps that slice (its state
exists only for it); the updated slices are all-gathered back into the model's parameters.

Its state_dict side (the unsharded layout, the streamed checkpoint) is hvdp.torch.sharded_state's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from hvdp import _horovod
from hvdp.core.errors import ConfigError
from hvdp.core.watchdog import WAITING
from hvdp.torch.optimizer import _counted
from hvdp.torch.runtime import COMPUTING, hvd
from hvdp.torch.sharded_state import ShardedStateDict

# Per bucket: the unit of the reduce-scatter, the all-gather and the checkpoint gather. A smaller bucket's
# reduce-scatter starts earlier in the backward pass: on hvdp bench's GPT (10M parameters, AdamW, np=2, MPI),
# 8 MiB buckets ran at 0.96x unsharded hvdp (median of 5 interleaved rounds), 32 MiB ones at 0.88x.
BUCKET_BYTES = 8 * 2**20


def split(numel: int, size: int) -> list[tuple[int, int]]:
    """(start, length) of each rank's slice of `numel` elements: Horovod's reducescatter split of a first
    dimension (numel // size each, the first numel % size ranks one more)."""
    base, extra = divmod(numel, size)
    out, start = [], 0
    for rank in range(size):
        length = base + (1 if rank < extra else 0)
        out.append((start, length))
        start += length
    return out


@dataclass(slots=True)
class _Piece:
    param: torch.Tensor
    index: int      # the parameter's index in the optimizer's state_dict
    offset: int     # where it starts in its bucket
    numel: int


@dataclass(slots=True)
class _Bucket:
    group: int
    dtype: torch.dtype
    pieces: list = field(default_factory=list)
    numel: int = 0
    slices: list = field(default_factory=list)  # split(numel, size)
    shard: torch.nn.Parameter | None = None      # this rank's slice, the parameter the wrapped optimizer steps

    def overlaps(self, start: int, end: int):
        """(piece, lo, hi): the part [lo, hi) of each piece (in its own flat numbering) within [start, end)."""
        for p in self.pieces:
            lo, hi = max(start, p.offset), min(end, p.offset + p.numel)
            if lo < hi:
                yield p, lo - p.offset, hi - p.offset


def _layout(groups: list, bucket_bytes: int, size: int) -> list[_Bucket]:
    buckets, index = [], 0
    for g, params in enumerate(groups):
        open_ = {}  # dtype -> the group's bucket being filled
        for p in params:
            i, index = index, index + 1
            if not p.requires_grad:
                continue
            b = open_.get(p.dtype)
            if b is None or (b.numel and (b.numel + p.numel()) * p.element_size() > bucket_bytes):
                b = open_[p.dtype] = _Bucket(group=g, dtype=p.dtype)
                buckets.append(b)
            b.pieces.append(_Piece(p, i, b.numel, p.numel()))
            b.numel += p.numel()
    for b in buckets:
        b.slices = split(b.numel, size)
    return buckets


class ShardedOptimizer(ShardedStateDict, torch.optim.Optimizer):
    """What prepare(..., shard_optimizer_state=True) returns: the wrapped optimizer stepping this rank's shard.

    Its param_groups are the wrapped optimizer's (same dicts: the learning rates hvdp scales, with one flat
    shard parameter per bucket as "params"); its state is the shard's only. Every rank must call step(),
    synchronize(), clip_grad_norm_() and consolidate_state_dict() (collectives), in the same order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule, *, op, compression,
                 bucket_bytes: int | None = None):
        """Wrap `optimizer` (already broadcast from rank 0): lay its parameters out in buckets and make its
        param groups step this rank's shard, converting any state it holds.

        Args:
            optimizer: a torch optimizer; its param groups are changed in place.
            schedule: prepare()'s LR schedule (optimizer._Schedule).
            op: Horovod's reduction (hvd.Average or hvd.Sum).
            compression: Horovod's gradient compression (hvd.Compression.none or .fp16).
            bucket_bytes: the largest bucket (default BUCKET_BYTES).
        """
        self._inner, self.hvdp_schedule = optimizer, schedule
        self._op, self._compression = op, compression
        self._rank, self._size = hvd.rank(), hvd.size()
        # Horovod's Gloo reducescatter (gloo::ReduceScatterHalvingDoubling) leaves the Gloo transport slow for
        # what follows it: after one of 1,000 floats, np=2, an allgather of 7.8 MB took 9.3 s and a broadcast
        # 5.1 s (20 ms and 9 ms before it). Under Gloo the gradients are all-reduced in place instead and each
        # rank keeps its slice: Gloo's ring all-reduce is a reduce-scatter and an all-gather, so twice the
        # bytes, and the same values as the allreduce path (docs/pytorch.md#sharded-optimizer-state-zero-12).
        self._gloo = self._size > 1 and hvd.gloo_enabled()
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        self._names = [g.pop("param_names", None) for g in optimizer.param_groups]
        existing = optimizer.state_dict() if optimizer.state else None
        self._buckets = _layout(self._groups, bucket_bytes or BUCKET_BYTES, self._size)
        self._make_shards(optimizer.param_groups)
        optimizer.state.clear()
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state  # the same objects
        self._synchronized, self._consolidated = False, None
        # Overlap with the backward pass: a bucket's reduce-scatter starts as soon as each of its parameters has
        # accumulated its k-th gradient (Horovod's counting), and its full gradients are freed then.
        self._passes, self._counts, self._pending = schedule.passes, {}, {}
        self._missing = [len(b.pieces) for b in self._buckets]
        self._bucket_of = {id(piece.param): i for i, b in enumerate(self._buckets) for piece in b.pieces}
        self.hooks = [piece.param.register_post_accumulate_grad_hook(self._accumulated)
                      for b in self._buckets for piece in b.pieces]
        if existing is not None:
            self.load_state_dict(existing)

    def _make_shards(self, param_groups: list) -> None:
        """Split each bucket for this world and make this rank's slice of the model's values its shard
        parameter, the one `param_groups` step."""
        with torch.no_grad():
            for b in self._buckets:
                b.slices = split(b.numel, self._size)
                start, length = b.slices[self._rank]
                b.shard = torch.nn.Parameter(self._flat(b, lambda p: p.detach(), start, start + length))
        for g, group in enumerate(param_groups):
            group["params"] = [b.shard for b in self._buckets if b.group == g]

    def relayout(self, size: int, rank: int) -> None:
        """Split the buckets anew for a world of `size` ranks in which this one is `rank` (after an elastic
        reset; hvdp.torch.sharded_elastic.reshard then fills the state): new shard parameters from the model's
        values, no state, nothing in flight. No collective."""
        self._rank, self._size = rank, size
        self._gloo = size > 1 and hvd.gloo_enabled()
        self._make_shards(self.param_groups)
        self.state.clear()
        self._pending.clear()
        self._counts.clear()
        self._missing = [len(b.pieces) for b in self._buckets]
        self._synchronized, self._consolidated = False, None

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
        seen = self._counts[id(param)] = self._counts.get(id(param), 0) + 1
        if seen > self._passes:
            raise ConfigError(f"a gradient was computed {seen} times before step(), with backward_passes_per_step="
                              f"{self._passes}: call step() every {self._passes} backward pass(es)", rank=self._rank)
        if seen == self._passes:
            i = self._bucket_of[id(param)]
            self._missing[i] -= 1
            if self._missing[i] == 0:
                self._reduce(i)

    def _reduce(self, i: int) -> None:
        """Start bucket i's reduce-scatter; free the model's full gradients it was copied from (ZeRO-2)."""
        b = self._buckets[i]
        sent, ctx = self._compression.compress(self._flat(b, lambda p: p.grad, 0, b.numel))
        if self._gloo:  # in place, each rank keeping its slice in synchronize(): see __init__
            handle = hvd.allreduce_async_(sent, name=f"hvdp.zero.grad.{i}", op=self._op)
        else:
            handle = hvd.reducescatter_async(sent, name=f"hvdp.zero.grad.{i}", op=self._op)
        self._pending[i] = (handle, ctx)
        for piece in b.pieces:
            piece.param.grad = None

    def synchronize(self) -> None:
        """Finish this step's reduce-scatters: each bucket's shard parameter gets its slice of the average (or
        sum, op="sum") over the ranks. Buckets whose parameters all got their gradients started during the
        backward pass; the others (a parameter without a gradient counts as zeros, a last step of fewer than
        k passes) start here. The model's full gradients are freed (set to None). If the averaged gradients
        hold an inf/NaN in any rank's slice, every rank's shard gradients hold one afterwards (one all-reduce of
        a flag), so that a GradScaler skips the step on every rank. step() calls it when it has not run yet;
        call it yourself to read the shard gradients, and before GradScaler.unscale_(). Every rank must call
        it."""
        for i in range(len(self._buckets)):
            if i not in self._pending:
                self._reduce(i)
        for i, b in enumerate(self._buckets):
            handle, ctx = self._pending.pop(i)
            reduced = hvd.synchronize(handle)
            if self._gloo:
                start, length = b.slices[self._rank]
                reduced = reduced[start:start + length].clone()  # the bucket's full copy is freed
            b.shard.grad = self._compression.decompress(reduced, ctx).to(b.dtype)
        self._agree_on_non_finite()
        self._counts.clear()
        self._missing = [len(b.pieces) for b in self._buckets]
        self._synchronized = True
        _counted(self.hvdp_schedule)

    def _agree_on_non_finite(self) -> None:
        """Make an inf/NaN anywhere in the averaged gradients visible in every rank's shard gradients.

        A GradScaler (fp16 AMP) looks for inf/NaN in the gradients of the optimizer's parameters, here this
        rank's shard only: an overflow in one rank's slice would make that rank skip the step and back off its
        scale while the others step (diverged replicas, and collectives out of step). One all-reduce (max) of
        a flag per step tells every rank; a rank whose shard is finite then puts a NaN into it, so that
        GradScaler.unscale_ finds one on every rank: every rank skips the step and updates the scale alike, as
        on the allreduce path. Without a GradScaler such a step was broken already (an inf/NaN reaches the
        weights); a rank holding no element at all gets a one-element NaN gradient, taken back in step()."""
        if self._size == 1:
            return
        grads = [b.shard.grad for b in self._buckets if b.shard.grad.numel()]
        # Every element is finite exactly when the least and the greatest are (aminmax propagates a NaN): one
        # pass that allocates nothing, where isfinite(g).all() wrote a flag per element (8.6 ms against 0.8 ms
        # for 5M floats on one CPU thread; on hvdp bench's GPT most of what the sharded step lost to hvdp's).
        local = (torch.stack([torch.isfinite(torch.stack(torch.aminmax(g))).all() for g in grads]).all()
                 .logical_not() if grads else torch.zeros((), dtype=torch.bool))
        local = local.to(torch.float32).cpu()
        found = hvd.allreduce(local, op=hvd.Max, name="hvdp.zero.nonfinite")
        if not found.item() or local.item():
            return
        with torch.no_grad():
            if grads:
                grads[0].view(-1)[0] = math.nan
            elif self._buckets:  # this rank's shards are all empty: a one-element stand-in, set through .data
                b = self._buckets[0]  # (torch's .grad setter refuses a size other than the parameter's)
                b.shard.grad.data = torch.full((1,), math.nan, dtype=b.dtype, device=b.shard.device)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For code written for the allreduce path: step() reduces the gradients once per step whether or not
        synchronize() ran, so this context changes nothing."""
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
        grads = [b.shard.grad for b in self._buckets if b.shard.grad is not None and b.shard.grad.numel()]
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
        _horovod.progress(s.step, WAITING)
        if not self._synchronized:
            self.synchronize()
        for b in self._buckets:  # the stand-in of _agree_on_non_finite on a rank without elements
            if b.shard.numel() == 0 and b.shard.grad is not None and b.shard.grad.numel():
                b.shard.grad = b.shard.grad[:0]
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
        self._gather_parameters()
        self._synchronized = False
        s.step += 1
        _counted(s)
        _horovod.progress(s.step, COMPUTING)

    def _gather_parameters(self) -> None:
        """All-gather the updated shards into the model's parameters, one bucket at a time: each gathered bucket
        is a transient copy of its parameters, and with every bucket's gather in flight at once (fused by
        Horovod into one buffer as large) the step's peak held a second copy of the model: on hvdp bench's GPT
        (AdamW, np=2, two 32 MiB buckets; glibc's mmap threshold fixed, so that RSS follows what is live) its
        peak RSS rise was 293 MiB, 256 MiB one bucket at a time. Gathers kept in flight up to 32 MiB (8 MiB
        buckets) were no faster there (26.2-27.1 samples/s against 26.3-29.0 one at a time)."""
        with torch.no_grad():
            for i, b in enumerate(self._buckets):
                full = hvd.allgather(b.shard.detach(), name=f"hvdp.zero.param.{i}")
                for piece in b.pieces:
                    piece.param.copy_(full[piece.offset:piece.offset + piece.numel].view_as(piece.param))
                del full

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the shard's (torch's zero_grad, on both).

        Args:
            set_to_none: set them to None (default) instead of zeroing them.

        Raises:
            ConfigError: a reduce-scatter started in the backward pass is still in flight (zero_grad() after
                backward() but before step(): its gradients would be half discarded).
        """
        if self._pending:
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
