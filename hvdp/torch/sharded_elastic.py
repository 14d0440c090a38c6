"""Elastic training with sharded optimizer state: what a commit keeps, and the re-sharding after a reset.

A rank holds only its slice of the optimizer state, so a lost worker takes its slice with it. A commit
therefore keeps, besides this rank's own slice, a copy of the slice of the one rank it is the keeper of
(hvdp.core.sharding.keepers: on another host whenever no host holds more than half the ranks; the next rank
when every rank is on one host). A host that is lost or removed leaves every slice it held with a keeper
elsewhere; the commit holds 2/N of the state where the unsharded ElasticState holds all of it. After a reset, every rank of
the new world (survivors and newly started workers) calls reshard(): the buckets are laid out for the new
world, and each bucket's state is rebuilt from the committed slices, one bucket and key at a time, each slice
broadcast by the survivor that holds it, every rank keeping its new slice.

A worker lost in the middle of a commit can leave the survivors holding different commits: a collective that
completed on one rank failed on another. Each commit therefore carries a serial (ElasticState's count), and
the state is rebuilt only from slices of the commit rank 0 holds, the one whose model and data position sync()
gives every rank; a slice held by no rank at that serial is an error, never a mix of two commits.
"""

from __future__ import annotations

import socket

import torch

from hvdp.core.errors import CheckpointError
from hvdp.core.sharding import keepers
from hvdp.torch.runtime import hvd
from hvdp.torch.sharded import ShardedOptimizer, split
from hvdp.torch.sharded_state import describe_state


def _described(opt: ShardedOptimizer) -> list[dict]:
    """Per bucket, what the shard's state holds: {"per": {key: dtype} of its per-element entries, "other":
    the other entries (Adam's step), copied to the CPU, "on_device": those of them that were not on it}."""
    out = []
    for b in opt._buckets:
        per, other, on_device = describe_state(opt.state.get(b.shard, {}), b.shard)
        out.append({"per": per, "other": other, "on_device": on_device})
    return out


def _merged(every: list[list[dict]]) -> list[dict]:
    """One description per bucket from every rank's (a rank with an empty slice may hold no state there): the
    per-element keys any rank has, the other entries of the first rank that has any."""
    merged = []
    for i in range(len(every[0])):
        per = {}
        for d in every:
            per.update(d[i]["per"])
        first = next((d[i] for d in every if d[i]["other"]), {"other": {}, "on_device": []})
        merged.append({"per": dict(sorted(per.items())), "other": first["other"], "on_device": first["on_device"]})
    return merged


def commit_copies(opt: ShardedOptimizer, serial: int = 0) -> dict:
    """What this rank keeps at a commit: its own slices and those of the ranks it keeps (the per-element state
    of each bucket, gathered one bucket and key at a time), the description of every bucket's state, and
    `serial`, the same on every rank for the same commit. Every rank must call it, at the same commit."""
    size, rank = opt._size, opt._rank
    mine = _described(opt)
    if size > 1:
        every = hvd.allgather_object((socket.gethostname(), mine), name="hvdp.zero.commit")
        kept = keepers([host for host, _ in every])
        buckets = _merged([d for _, d in every])
    else:
        kept, buckets = [0], _merged([mine])
    ranks = sorted({rank} | {r for r in range(size) if kept[r] == rank})
    slices = {r: [{} for _ in opt._buckets] for r in ranks}
    for i, (b, described) in enumerate(zip(opt._buckets, buckets)):
        state = opt.state.get(b.shard, {})
        for j, (key, dtype) in enumerate(described["per"].items()):
            local = state.get(key)
            if local is None:
                local = torch.zeros(b.shard.shape, dtype=dtype, device=b.shard.device)
            full = hvd.allgather(local.detach(), name=f"hvdp.zero.commit.{i}.{j}") if size > 1 else local
            for r in ranks:
                start, length = b.slices[r]
                slices[r][i][key] = full[start:start + length].detach().cpu().clone()
            del full
    # the owned parameters' state (per-parameter layout), whole: each rank's broadcast once, kept by its keeper
    owned = {}
    for r in range(size):
        mine = _owned_state(opt) if r == rank else None
        theirs = hvd.broadcast_object(mine, root_rank=r, name=f"hvdp.zero.commit.owned.{r}") if size > 1 else mine
        if r in ranks:
            owned[r] = theirs
        del theirs
    return {"size": size, "serial": serial, "slices": slices, "buckets": buckets, "owned": owned,
            "layout": opt.layout()}


def _owned_state(opt: ShardedOptimizer) -> dict:
    """{index: {key: (value copied to the CPU, whether it was elsewhere)}} of the parameters this rank owns."""
    out = {}
    for o in opt._owned:
        if o.owner == opt._rank and o.param in opt.state:
            out[o.index] = {k: (v.detach().cpu().clone(), v.device.type != "cpu") if torch.is_tensor(v) else (v, False)
                            for k, v in opt.state[o.param].items()}
    return out


def sources(summaries: list[tuple | None], rank: int = 0) -> tuple[int, dict[int, int]]:
    """Which commit to rebuild and who sends each slice of it, from every new rank's (world size, serial,
    former ranks whose slices it holds), or None for a rank that holds no commit: (the former world size,
    {former rank: the lowest new rank holding its slice at that commit}). The commit is rank 0's (the others
    take its model and data position in sync()), else the newest any rank holds.

    Raises:
        CheckpointError: the ranks hold commits of different world sizes, or some former rank's slice is held
            by no rank at that commit (a rank and its keeper both lost, or a worker lost mid-commit).
    """
    held = [s for s in summaries if s is not None]
    sizes = sorted({s[0] for s in held})
    if len(sizes) > 1:
        raise CheckpointError(f"the ranks hold elastic commits of different world sizes {sizes}: the optimizer "
                              f"state cannot be rebuilt; resume from a checkpoint", rank=rank)
    old = sizes[0]
    serial = summaries[0][1] if summaries[0] is not None else max(s[1] for s in held)
    holder: dict[int, int] = {}
    for new_rank, s in enumerate(summaries):
        for r in (s[2] if s is not None and s[1] == serial else ()):
            holder.setdefault(r, new_rank)
    lost = [r for r in range(old) if r not in holder]
    if lost:
        behind = sorted({s[1] for s in held} - {serial})
        others = ", #".join(map(str, behind))
        why = (f" at the commit rank 0 holds (#{serial}; others hold #{others}: a worker was lost in the middle of "
               f"a commit)" if behind else
               ": each rank's slice is kept by itself and by one rank on another host, and both left the job")
        raise CheckpointError(
            f"the optimizer state of former rank(s) {lost} of {old} was lost{why}. Resume from a checkpoint "
            f"(hvdp.torch.save_checkpoint / load_checkpoint)", rank=rank)
    return old, holder


def reshard(opt: ShardedOptimizer, committed: dict | None) -> None:
    """Lay `opt` out for the world there is now and rebuild its state from the commits the ranks hold.

    Every rank of the new world must call it, each with its last commit_copies() (None on a worker that
    joined, or when nothing was committed): the slices of each former rank at rank 0's commit are broadcast by
    the lowest new rank that holds them, every rank keeping its new slice; a rank holds one bucket's state of
    one key at a time besides its shard. The model's parameters must already be the same on every rank (the
    new shards are taken from them).

    Raises:
        CheckpointError: on every rank: the slices of some former ranks are held by no rank at the commit
            rebuilt (a rank and its keeper were both lost, or a worker lost mid-commit left the survivors with
            different commits: sources()), or the ranks hold commits of different world sizes.
    """
    summary = None if committed is None else (committed["size"], committed["serial"], sorted(committed["slices"]),
                                              committed["buckets"], committed["layout"])
    every = hvd.allgather_object((summary, opt.layout()), name="hvdp.zero.reshard") if hvd.size() > 1 else \
        [(summary, opt.layout())]
    if all(s is None for s, _ in every):
        opt.relayout(hvd.size(), hvd.rank(), every[0][1])  # rank 0's layout (a joined worker has prepare()'s)
        return  # nothing committed yet: the fresh state, as after prepare()
    every = [s for s, _ in every]
    old, holder = sources([s[:3] if s is not None else None for s in every], hvd.rank())
    buckets = every[holder[0]][3]  # the description of the rebuilt commit's buckets
    opt.relayout(hvd.size(), hvd.rank(), every[holder[0]][4])  # and its layout (a joined worker has prepare()'s)
    for i, (b, described) in enumerate(zip(opt._buckets, buckets)):
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in described["other"].items()}
        start, length = b.slices[opt._rank]
        for key, dtype in described["per"].items():
            full = torch.empty(b.numel, dtype=dtype)
            for r, (s, n) in enumerate(split(b.numel, old)):
                part = full[s:s + n]
                if holder[r] == opt._rank:
                    part.copy_(committed["slices"][r][i][key])
                if n and hvd.size() > 1:
                    hvd.broadcast_(part, root_rank=holder[r], name=f"hvdp.zero.reshard.{i}.{key}.{r}")
            state[key] = full[start:start + length].clone().to(b.shard.device)
            del full
        for k in described["on_device"]:  # Adam's step with capturable=True: where the shard is
            state[k] = state[k].to(b.shard.device)
        if state:
            opt.state[b.shard] = state
    owners = {o.index: o for o in opt._owned}
    for r in range(old):  # each former rank's owned parameters' state, from the rank that holds it to their owners
        held = committed["owned"][r] if holder[r] == opt._rank else None
        if hvd.size() > 1:
            held = hvd.broadcast_object(held, root_rank=holder[r], name=f"hvdp.zero.reshard.owned.{r}")
        for index, entry in held.items():
            o = owners[index]
            if o.owner == opt._rank:
                opt.state[o.param] = {k: v.to(o.param.device) if on_device else v for k, (v, on_device) in entry.items()}
        del held
