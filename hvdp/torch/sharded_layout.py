"""Where a sharded optimizer's parameters live: flat buckets split element by element across the ranks, or whole
parameters each stepped by one rank (its owner). hvdp.torch.sharded steps the layout; this module decides it.

Which layout an optimizer gets is decided by `element_wise()`: an optimizer whose update of an element depends
only on that element's gradient and state and on scalars (SGD, Adam, ...) steps a flat 1-D slice as it would
step the parameters, so it gets the flat buckets (ZeRO-1/2, every bucket split evenly). Any other optimizer
(Adafactor's row/column factors, LAMB/LARS's per-tensor norms, Muon's matrix iteration, a user's class) needs
each parameter whole, in its shape: each parameter is stepped by one rank, chosen by the greedy size balance of
torch.distributed.optim.ZeroRedundancyOptimizer (per param group, largest parameter first, to the rank holding
the fewest elements so far).

A parameter of an element-wise optimizer that no rank used in a step (its gradient None everywhere) must be
skipped that step, as torch skips it, and from then on its step count differs from its bucket's: it moves to the
per-parameter layout for good (`_Layout.moved`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch


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


# torch's optimizers whose step is element-wise: per-element state (momentum, moments, Adagrad's sum, Rprop's
# step sizes, ASGD's ax) and scalars shared by the whole tensor that depend on the step count only (step, NAdam's
# mu_product, ASGD's eta and mu). Read in torch/optim/*.py: each _init_group/step touches a parameter only
# through elementwise ops on it, its gradient and that state. Not here: Adafactor (row/column factors and the
# tensor's RMS), LBFGS (closure: refused), SparseAdam (sparse gradients only), Muon (matrix Newton-Schulz).
ELEMENT_WISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
                torch.optim.ASGD, torch.optim.Rprop)


def element_wise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` may step flat slices: its class is one of ELEMENT_WISE, or a subclass of one that
    overrides neither step() nor _init_group() (a subclass that does may compute anything: per parameter)."""
    cls = type(optimizer)
    if cls in ELEMENT_WISE:
        return True
    for base in cls.__mro__[1:]:
        if base in ELEMENT_WISE:
            # (torch wraps each class's step() at its first instance: compare what the wrappers wrap)
            return all(_unwrapped(cls, m) is _unwrapped(base, m) for m in ("step", "_init_group"))
    return False


def _unwrapped(cls: type, name: str):
    return inspect.unwrap(getattr(cls, name)) if hasattr(cls, name) else None


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


@dataclass(slots=True)
class _Owned:
    """A parameter in the per-parameter layout: the wrapped optimizer of rank `owner` steps it, whole."""

    param: torch.Tensor
    index: int
    group: int
    owner: int


def pack(groups: list, indices: list[int], bucket_bytes: int) -> list[tuple[int, list[int]]]:
    """The flat buckets of the parameters `indices` (into the flattened `groups`, in order): (group, their
    indices) each, per param group and dtype, a new bucket where the next parameter would pass bucket_bytes."""
    params = [(g, p) for g, ps in enumerate(groups) for p in ps]
    out, open_, nbytes = [], {}, {}
    for i in indices:
        g, p = params[i]
        key = (g, p.dtype)
        at = open_.get(key)
        if at is None or (nbytes[at] and nbytes[at] + p.numel() * p.element_size() > bucket_bytes):
            at = open_[key] = len(out)
            out.append((g, []))
            nbytes[at] = 0
        out[at][1].append(i)
        nbytes[at] += p.numel() * p.element_size()
    return out


def balance(sizes: dict[int, int], groups: dict[int, int], owners: dict[int, int], world: int) -> dict[int, int]:
    """ZeroRedundancyOptimizer's partition, continued from `owners` ({index: rank} already placed): the other
    indices of `sizes` ({index: numel}), param group by param group (`groups`: {index: group}), largest first
    (ties in index order), each to the rank holding the fewest elements so far (the lowest such rank)."""
    load = [0] * world
    for i, r in owners.items():
        load[r] += sizes[i]
    out = dict(owners)
    for g in sorted({groups[i] for i in sizes}):
        for i in sorted((i for i in sizes if groups[i] == g and i not in owners), key=lambda i: (-sizes[i], i)):
            r = min(range(world), key=lambda k: (load[k], k))
            out[i] = r
            load[r] += sizes[i]
    return out
