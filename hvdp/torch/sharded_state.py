"""A sharded optimizer's state in the unsharded layout: what its state_dict(), load_state_dict() and the
streamed checkpoint (hvdp.torch.checkpoint) read and write.

Owned parameters (the per-parameter layout) keep their state whole on their owner: it is sent from there
(each tensor broadcast by its owner while rank 0 writes it; a rank holds one tensor of another's at a time).

The checkpoint format stays the unsharded one: consolidation gathers the state bucket by bucket and splits it
into per-parameter tensors (torch's state_dict layout), and load_state_dict() takes that layout and keeps this
rank's slice, so a checkpoint resumes at any world size, sharded or not. For checkpoints, both directions
stream: state_skeleton() + gather_state() hand rank 0 one gathered bucket at a time (save_checkpoint writes
each into the file), and load_streamed() receives one broadcast bucket at a time from rank 0's mapping of the
file, so that no rank ever holds the whole state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hvdp.core.errors import ConfigError
from hvdp.torch.runtime import hvd

if TYPE_CHECKING:
    from hvdp.torch.sharded import _Bucket

# Per-parameter state that is one value, not one per element (Adam's step, ASGD's eta and mu, NAdam's mu_product): for a 0-dim
# parameter the shapes alone cannot tell.
_SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def is_per_element(value, shard: torch.Tensor) -> bool:
    """Whether a shard's state entry has one value per element (momentum, Adam's moments), not one in all."""
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == shard.shape


def describe_state(entries: dict, shard: torch.Tensor) -> tuple[dict, dict, list]:
    """What a flat shard's state holds: ({key: dtype} of its per-element entries, the other entries (Adam's
    step) copied to the CPU, the keys of those that were not on the CPU)."""
    per, other, on_device = {}, {}, []
    for k, v in entries.items():
        if is_per_element(v, shard):
            per[k] = v.dtype
        elif torch.is_tensor(v):
            other[k] = v.detach().cpu().clone()
            if v.device.type != "cpu":
                on_device.append(k)
        else:
            other[k] = v
    return per, other, on_device


class _Keys(list):
    """state_skeleton()'s keys for gather_state(): a list of (key, per_element), with .owned, what each owned
    parameter's state holds (ShardedStateDict._state_keys)."""

    def __init__(self, items, owned: dict):
        super().__init__(items)
        self.owned = owned


@dataclass(frozen=True)
class Streamed:
    """Stands for a per-element state tensor that load_checkpoint leaves on rank 0 (memory-mapped from the
    file) instead of broadcasting it whole: load_streamed() sends it bucket by bucket. Picklable, so that it
    travels in the broadcast skeleton."""

    shape: tuple
    dtype: torch.dtype


class ShardedStateDict:
    """The state_dict half of hvdp.torch.sharded.ShardedOptimizer (its base class), over the layout that class
    keeps: _buckets (each with its pieces, its ranks' slices and this rank's shard), _groups and _names (the
    original param groups' parameters and names), _rank, _size, state, param_groups, _flat() and _consolidated
    (what consolidate_state_dict() gathered)."""

    def _state_keys(self) -> "_Keys":
        """(key, per_element) of the shard's state, agreed by every rank (an empty shard may have none), and in
        .owned what each owned parameter's state holds ({index: {key: ("tensor", shape, dtype, value of a
        0-dim one) or ("value", value)}}). A key is per-element (its tensors streamed, never in the skeleton's
        values) if it is so in a shard or if some owned parameter holds it as a tensor of 1 dimension or more."""
        mine, owned = {}, {}
        for b in self._buckets:
            for k, v in self.state.get(b.shard, {}).items():
                mine[k] = is_per_element(v, b.shard)
        for o in self._owned:
            if o.owner == self._rank and o.param in self.state:
                owned[o.index] = {k: ("tensor", tuple(v.shape), v.dtype, v.detach().cpu().clone() if v.dim() == 0
                                      else None) if torch.is_tensor(v) else ("value", v)
                                  for k, v in self.state[o.param].items()}
        every = hvd.allgather_object((mine, owned), name="hvdp.zero.keys") if self._size > 1 else [(mine, owned)]
        merged, meta = {}, {}
        for m, own in every:
            for k, per_element in m.items():
                merged[k] = merged.get(k, False) or per_element
            meta.update(own)
        for entry in meta.values():
            for k, v in entry.items():
                if v[0] == "tensor":
                    merged[k] = merged.get(k, False) or len(v[1]) > 0
        return _Keys(sorted(merged.items()), meta)

    def state_skeleton(self, to: int = 0) -> tuple[list, dict | None]:
        """The first half of a streamed gather (save_checkpoint's): the state keys every rank agreed on, and on
        rank `to` the full state_dict in the unsharded layout with each per-element tensor (exp_avg, momentum:
        shaped as its parameter) an uninitialised placeholder of its shape and dtype, whose pages are never
        touched (no memory) until gather_state() fills it or a writer puts its bytes elsewhere. None on the
        other ranks. Every rank must call it (one allgather_object), then gather_state() with the keys.

        Args:
            to: the rank that receives the state (default 0).

        Returns:
            (keys, skeleton): keys as gather_state() takes them; skeleton on rank `to`, None elsewhere.
        """
        keys = self._state_keys()
        if self._rank != to:
            return keys, None
        state: dict = {}
        for b in self._buckets:
            mine = self.state.get(b.shard, {})
            for key, per_element in keys:
                if key not in mine:
                    continue
                v = mine[key]
                for piece in b.pieces:
                    if per_element:  # an untouched allocation: its pages cost nothing until written
                        placeholder = torch.UntypedStorage(piece.numel * v.element_size())
                        value = torch.empty(0, dtype=v.dtype).set_(placeholder, 0, piece.param.shape)
                    else:
                        value = v.clone() if torch.is_tensor(v) else v
                    state.setdefault(piece.index, {})[key] = value
        per = {k for k, p in keys if p}
        for index, entry in keys.owned.items():
            for key, v in entry.items():
                if v[0] == "value":
                    value = v[1]
                elif key in per:  # an untouched allocation, filled by gather_state()
                    placeholder = torch.UntypedStorage(math.prod(v[1]) * v[2].itemsize)
                    value = torch.empty(0, dtype=v[2]).set_(placeholder, 0, v[1])
                else:
                    value = v[3].clone()
                state.setdefault(index, {})[key] = value
        groups, index = [], 0
        for g, group in enumerate(self.param_groups):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(self._groups[g])))
            if self._names[g] is not None:
                packed["param_names"] = list(self._names[g])
            index += len(self._groups[g])
            groups.append(packed)
        return keys, {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}

    def gather_state(self, keys: list, put=None) -> None:
        """The second half of a streamed gather: bucket by bucket and key by key, all-gather the per-element
        state and, on the rank that passes `put`, call put(index, key, values) with each parameter's part
        (a 1-D view into the gathered bucket, valid during the call only) where state_skeleton() put a
        placeholder. A rank holds one bucket's gathered state at a time (the bound on the memory a streamed
        gather adds: BUCKET_BYTES, or the largest parameter's state, a parameter being never split). Every rank
        must call it, after state_skeleton(), with its keys.

        Then each owned parameter's tensors (those per-element keys name), each broadcast by its owner.

        Args:
            keys: what state_skeleton() returned first.
            put: called on the receiving rank (None on the others); whatever it raises propagates, leaving the
                other ranks in the remaining collectives: catch it there and raise after this returns.
        """
        for i, b in enumerate(self._buckets):
            mine = self.state.get(b.shard, {})
            for j, (key, per_element) in enumerate(keys):
                if not per_element:
                    continue
                local = mine.get(key)
                if local is None:  # a bucket no rank has state for yet
                    local = torch.zeros(b.shard.shape, dtype=b.dtype, device=b.shard.device)
                full = hvd.allgather(local.detach(), name=f"hvdp.zero.state.{i}.{j}") if self._size > 1 else local
                if put is not None and key in mine:
                    for piece in b.pieces:
                        put(piece.index, key, full[piece.offset:piece.offset + piece.numel])
                del full
        per = {k for k, p in keys if p}
        for o in self._owned:  # each owned tensor, broadcast by its owner
            for key, v in sorted((keys.owned.get(o.index) or {}).items()):
                if v[0] != "tensor" or key not in per or not math.prod(v[1]):
                    continue
                if o.owner == self._rank:
                    values = self.state[o.param][key].detach().reshape(-1).clone()
                else:
                    values = torch.empty(math.prod(v[1]), dtype=v[2], device=o.param.device)
                if self._size > 1:
                    hvd.broadcast_(values, root_rank=o.owner, name=f"hvdp.zero.own.state.{o.index}.{key}")
                if put is not None:
                    put(o.index, key, values)
                del values

    def gathered_state_dict(self, to: int = 0) -> dict | None:
        """The full optimizer state in the unsharded layout (torch's state_dict of the original optimizer:
        one entry per parameter index) on rank `to`, None on the others. Gathered bucket by bucket: a rank
        holds one bucket's gathered state at a time besides what `to` builds (the whole state: save_checkpoint
        streams it to the file instead, with state_skeleton() and gather_state()). Every rank must call it.

        Args:
            to: the rank that receives the state (default 0).
        """
        keys, skeleton = self.state_skeleton(to)

        def put(index, key, values):
            skeleton["state"][index][key] = values.reshape(skeleton["state"][index][key].shape).clone()

        self.gather_state(keys, put if skeleton is not None else None)
        return skeleton

    def per_element(self, state_dict: dict) -> dict:
        """Which tensors of a full state_dict (unsharded layout) load_state_dict() would slice: {(index, key):
        tensor} for each per-element entry, by the rule load_state_dict applies (shaped as its parameter; for a
        0-dim parameter, not a scalar key such as "step"). Empty when the param groups do not match (then
        load_state_dict says why). No collective."""
        saved = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in saved] != [len(p) for p in self._groups]:
            return {}
        out = {}
        for group, ours in zip(saved, self._groups):
            for idx, param in zip(group["params"], ours):
                for k, v in (state_dict["state"].get(idx) or {}).items():
                    if torch.is_tensor(v) and v.shape == param.shape and (param.dim() > 0 or k not in _SCALAR_KEYS):
                        out[idx, k] = v
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank `to` for the next state_dict() there (ZeroRedundancyOptimizer's API).
        Every rank must call it.

        Args:
            to: the rank that keeps it (default 0).
        """
        self._consolidated = self.gathered_state_dict(to)

    def state_dict(self) -> dict:
        """The full state (unsharded layout) that consolidate_state_dict() gathered on this rank.

        Raises:
            ConfigError: consolidate_state_dict() did not gather it on this rank.
        """
        if self._consolidated is None:
            raise ConfigError("a sharded optimizer's state_dict() is the full state gathered on one rank: call "
                              "optimizer.consolidate_state_dict(to=rank) on every rank first (save_checkpoint "
                              "does it for you)", rank=self._rank)
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state in the unsharded layout (a checkpoint's, an unsharded optimizer's state_dict()
        or gathered_state_dict()), keeping this rank's slice; the hyperparameters of every param group too.
        Every rank passes the same state; no collective.

        Args:
            state_dict: {"state": {index: {...}}, "param_groups": [...]} over the original parameters.

        Raises:
            ConfigError: its param groups do not match the optimizer's (count or parameters per group).
        """
        self._load(state_dict, None)

    def load_streamed(self, state_dict: dict, source=None) -> None:
        """load_state_dict() for a state whose per-element tensors stayed on rank 0 (load_checkpoint's): on
        every rank, `state_dict` has a Streamed(shape, dtype) in place of each tensor per_element() names;
        rank 0 passes `source(index, key)`, returning that tensor (memory-mapped from the file). Bucket by
        bucket and key by key, rank 0 packs the bucket's flat state into one buffer, broadcasts it, and every
        rank keeps its slice: a rank holds its shard plus one bucket's buffer (BUCKET_BYTES, or the largest
        parameter's state), never the whole state. Every rank must call it, with the same `state_dict`.

        Args:
            state_dict: as load_state_dict() takes it, with Streamed entries (the same on every rank).
            source: on rank 0, the function giving each Streamed entry's tensor; None elsewhere.

        Raises:
            ConfigError: its param groups do not match the optimizer's (on every rank: they all see the same).
        """
        self._load(state_dict, source)

    def _load(self, state_dict: dict, source) -> None:
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(p) for p in self._groups]:
            raise ConfigError(f"the optimizer state has param groups of {[len(g['params']) for g in saved]} "
                              f"parameters, this optimizer {[len(p) for p in self._groups]}", rank=self._rank)
        by_index = {}
        for g, group in enumerate(saved):
            for pos, idx in enumerate(group["params"]):
                by_index[(g, pos)] = (idx, state_dict["state"].get(idx))
        order = {}  # a parameter's index in this optimizer -> (its index in state_dict, its saved state)
        index = 0
        for g, params in enumerate(self._groups):
            for pos in range(len(params)):
                order[index] = by_index[(g, pos)]
                index += 1
        self._join(in_step=False)  # parameters unfrozen since the last step: their state is loaded too
        self._split_divergent(order)
        self.state.clear()
        staging = []  # load_streamed's one buffer, reused bucket after bucket (a new one each time fragments the heap)
        for i, b in enumerate(self._buckets):
            start, length = b.slices[self._rank]
            states = [(p, *order.get(p.index, (None, None))) for p in b.pieces]
            keys = {}
            for p, _, st in states:
                for k, v in (st or {}).items():
                    per = isinstance(v, Streamed) or (torch.is_tensor(v) and v.shape == p.param.shape
                                                      and (p.param.dim() > 0 or k not in _SCALAR_KEYS))
                    keys.setdefault(k, (per, v))
            shard_state = {}
            for k, (per, first) in keys.items():
                if per and isinstance(first, Streamed):
                    shard_state[k] = self._receive(i, b, k, first.dtype, states, source, staging).to(b.shard.device)
                elif per:
                    values = {id(p.param): (st or {}).get(k) for p, _, st in states}
                    shard_state[k] = self._flat(b, lambda param: values[id(param)], start, start + length).to(
                        first.dtype).to(b.shard.device)
                else:
                    shard_state[k] = first.clone() if torch.is_tensor(first) else first
            if shard_state:
                self.state[b.shard] = shard_state
        for o in self._owned:
            idx, st = order.get(o.index, (None, None))
            kept = {}
            for k, v in sorted((st or {}).items()):
                if isinstance(v, Streamed):  # on rank 0 only (load_checkpoint): broadcast, the owner keeps it
                    value = torch.empty(v.shape, dtype=v.dtype)
                    if self._rank == 0:
                        value.copy_(source(idx, k))
                    if self._size > 1 and value.numel():
                        hvd.broadcast_(value, root_rank=0, name=f"hvdp.zero.load.own.{o.index}.{k}")
                else:
                    value = v
                if o.owner == self._rank:
                    kept[k] = _placed(k, value, o.param)
            if kept:
                self.state[o.param] = kept
        for group, values in zip(self.param_groups, saved):
            group.update({k: v for k, v in values.items() if k not in ("params", "param_names")})

    def _split_divergent(self, order: dict) -> None:
        """Move to the per-parameter layout each parameter of a flat bucket whose saved scalar state (step count)
        or lack of state differs from the rest of its bucket's (one skipped in a step where no rank used it): a
        flat shard has one step count; and a frozen one that has saved state. The bucket keeps the state most of
        its parameters share. Every rank decides alike from the same state; no collective."""
        # a frozen parameter with saved state keeps it (torch's optimizer keeps it, and steps it once unfrozen):
        # owned, outside the flat buckets
        moving = {i for i, p in enumerate(self._params()) if i not in self._members and (order.get(i) or (0, None))[1]}
        self._members |= moving
        for b in self._buckets:
            signs = [_signature(p.param, (order.get(p.index) or (None, None))[1]) for p in b.pieces]
            if len(set(signs)) > 1:
                keep = max(signs, key=lambda s: (signs.count(s), -signs.index(s)))
                moving |= {p.index for p, s in zip(b.pieces, signs) if s != keep}
        if moving:
            self._moved |= moving
            self._build(self.param_groups, keep=False)

    def _receive(self, i: int, b: _Bucket, key: str, dtype: torch.dtype, states: list, source,
                 staging: list) -> torch.Tensor:
        """Bucket i's flat state `key`, packed on rank 0 from source(index, key) (zeros where a parameter has
        none) and broadcast; returns a copy of this rank's slice. `staging` holds the buffer (a list of one
        uint8 tensor), allocated for the largest bucket at the first call and reused."""
        nbytes = b.numel * dtype.itemsize
        if not staging or staging[0].numel() < nbytes:
            staging[:] = [torch.empty(max(c.numel for c in self._buckets) * dtype.itemsize, dtype=torch.uint8)]
        raw = staging[0][:nbytes]
        buffer = raw.view(dtype)
        if self._rank == 0:
            for (p, idx, st) in states:
                part = buffer[p.offset:p.offset + p.numel]
                if isinstance((st or {}).get(key), Streamed):
                    part.copy_(source(idx, key).reshape(-1))
                else:
                    part.zero_()
        if self._size > 1:
            hvd.broadcast_(raw, root_rank=0, name=f"hvdp.zero.load.{i}.{key}")
        start, length = b.slices[self._rank]
        return buffer[start:start + length].clone()


def _signature(param: torch.Tensor, state: dict | None):
    """What a flat bucket's parameters must share: whether there is state, and its scalar entries' values."""
    if not state:
        return None
    out = []
    for k, v in sorted(state.items()):
        if isinstance(v, Streamed) or (torch.is_tensor(v) and v.shape == param.shape
                                       and (param.dim() > 0 or k not in _SCALAR_KEYS)):
            continue
        out.append((k, tuple(v.reshape(-1).tolist()) if torch.is_tensor(v) else v))
    return tuple(out)


def _placed(key: str, value, param: torch.Tensor):
    """A loaded state value for `param` as torch's Optimizer.load_state_dict places it: a floating tensor in
    the parameter's dtype and on its device, except "step", which stays where and what it is."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.clone()
    return value.to(dtype=param.dtype if value.is_floating_point() else value.dtype, device=param.device).clone()
