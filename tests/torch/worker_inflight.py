"""Many collectives in flight at once, on ranks made uneven on purpose, every result compared exactly.

Run by tests/torch/test_inflight.py under MPI with hvdp's shared-memory allreduce, MPI without it and Gloo,
at 2 and 3 ranks (`python worker_inflight.py OUT.json ITERATIONS`).

Each iteration starts, before waiting for any of them, a dozen asynchronous allreduces (every dtype the
torch bindings take, sizes below, at and above the shared-memory chunk and Horovod's fusion threshold, Sum,
Average, pre/postscaled, named and unnamed, out of place and in place, each rank submitting the named ones in
its own order), a grouped allreduce, an allgather and a broadcast. One rank sleeps, another does busy work, and for
part of the run all ranks are pinned to one core, so fast ranks run ahead into the next response while slow
ones are still reading the last.

Every rank's input is a known function of (iteration, tensor, rank) with small integer values, so each rank
computes the exact result itself, without a collective, and exactness does not depend on the order in which
a backend adds. A wrong result is recorded, never raised: every rank runs the same collectives to the end,
so a wrong sum cannot turn into a hang of the comparison itself.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402

world = ht.init()
hvd = ht.hvd
RANK, SIZE = world.rank, world.size


DEFAULT_CHUNK = 256 << 10  # the shared-memory op's chunk when HVDP_SHM_CHUNK_BYTES is unset (kDefaultChunkBytes)


CHUNK = int(os.environ.get("HVDP_SHM_CHUNK_BYTES") or DEFAULT_CHUNK)
FUSION = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20))

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def _elements(dtype: torch.dtype) -> list[int]:
    """Sizes around the chunk and above the fusion threshold, in elements of `dtype`."""
    per_chunk = CHUNK // dtype.itemsize
    return [1, 5, 1000, per_chunk - 1, per_chunk, per_chunk + 1, 3 * per_chunk + 17, FUSION // dtype.itemsize + 3]


def _input(n: int, it: int, j: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    # Integers in [-30, 30]: any sum of 3 of them, halved or doubled, is exact in every dtype here.
    v = (torch.arange(n, dtype=torch.int64) * (it + 3) + 7 * j + 13 * rank) % 61 - 30
    return v.to(dtype)


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision Horovod scales a buffer of `dtype` in (ScaleBuffer: float for 16/32-bit floats)."""
    return torch.float64 if dtype in (torch.float64, torch.int32, torch.int64) else torch.float32


def _expected(n, it, j, dtype, op, pre, post) -> torch.Tensor:
    total = sum(_input(n, it, j, r, torch.float64) * pre for r in range(SIZE))  # exact in float64
    total = total.to(dtype)
    scale = post / SIZE if op == "average" else post
    if scale != 1.0:
        total = (total.to(_scale_dtype(dtype)) * torch.tensor(scale, dtype=_scale_dtype(dtype))).to(dtype)
    return total


def _specs(it: int, rng: random.Random) -> list[dict]:
    """This iteration's allreduces: the same list on every rank (rng is seeded alike)."""
    specs = []
    for j in range(12):
        dtype = rng.choice(DTYPES)
        n = rng.choice(_elements(dtype))
        if n * dtype.itemsize > FUSION and rng.random() < 0.7:
            n = rng.choice(_elements(dtype)[:-1])  # keep the big ones to a few per iteration
        floating = dtype.is_floating_point
        op = rng.choice(["sum", "average"] if floating else ["sum"])
        pre, post = rng.choice([(1.0, 1.0), (1.0, 1.0), (0.5, 2.0), (2.0, 0.25)] if floating else [(1.0, 1.0)])
        specs.append(dict(j=j, n=n, dtype=dtype, op=op, pre=pre, post=post,
                          name=None if rng.random() < 0.3 else f"inflight.{it}.{j}",
                          inplace=rng.random() < 0.3))
    return specs


def _uneven(it: int, rng_local: random.Random) -> None:
    """Make this rank slower or faster than its peers, differently each iteration."""
    slow = it % SIZE
    if RANK == slow:
        time.sleep(rng_local.choice([0, 0.0005, 0.002, 0.01]))
    elif RANK == (slow + 1) % SIZE:
        end = time.perf_counter() + rng_local.choice([0, 0.001, 0.005])
        while time.perf_counter() < end:  # busy, holding the core
            pass


def main(out: Path, iterations: int) -> None:
    errors: list[str] = []
    checked = 0
    all_cores = os.sched_getaffinity(0)
    rng_local = random.Random(1000 + RANK)  # different on every rank: order and timing
    for it in range(iterations):
        # The middle third of the run: every rank on one core, so a spinning rank starves its peer.
        pin = iterations // 3 <= it < 2 * iterations // 3
        os.sched_setaffinity(0, {min(all_cores)} if pin else all_cores)
        rng = random.Random(it)  # the same on every rank: what is reduced
        specs = _specs(it, rng)
        # Horovod names an unnamed tensor after its handle, a count of this rank's submissions: the unnamed
        # go first, in the same order on every rank; each rank submits the named ones in an order of its own.
        named = [k for k in range(len(specs)) if specs[k]["name"] is not None]
        rng_local.shuffle(named)
        order = [k for k in range(len(specs)) if specs[k]["name"] is None] + named
        handles = {}
        for k in order:
            s = specs[k]
            x = _input(s["n"], it, s["j"], RANK, s["dtype"])
            op = hvd.Average if s["op"] == "average" else hvd.Sum
            kw = dict(name=s["name"], op=op, prescale_factor=s["pre"], postscale_factor=s["post"])
            handles[k] = (hvd.allreduce_async_(x, **kw), x) if s["inplace"] else (hvd.allreduce_async(x, **kw), None)
            if rng_local.random() < 0.3:
                _uneven(it, rng_local)
        group_n = [3, 0, CHUNK // 4 + 1, 5000]
        group_in = [_input(n, it, 100 + i, RANK, torch.float32) for i, n in enumerate(group_n)]
        group = hvd.grouped_allreduce_async(group_in, op=hvd.Sum, name=f"inflight.group.{it}")
        gathered = hvd.allgather_async(torch.full((RANK + 1, 3), float(RANK + it)), name=f"inflight.gather.{it}")
        bcast = hvd.broadcast_async(torch.full((17,), float(RANK * 100 + it)), root_rank=it % SIZE,
                                    name=f"inflight.bcast.{it}")
        _uneven(it, rng_local)

        def compare(got, want, what):
            nonlocal checked
            checked += 1
            if got.dtype != want.dtype or not torch.equal(got, want):
                bad = (got.double() != want.double()).nonzero().flatten()
                errors.append(f"rank {RANK} iteration {it} {what}: {bad.numel()} of {want.numel()} elements "
                              f"wrong, first at {bad[:1].tolist()}: got {got.flatten()[bad[:3]].tolist()} "
                              f"want {want.flatten()[bad[:3]].tolist()}")

        for k in sorted(handles):  # waited for in another order than submitted
            s = specs[k]
            handle, inplace = handles[k]
            try:
                got = hvd.synchronize(handle)
                got = inplace if inplace is not None else got
            except Exception as e:  # noqa: BLE001 - recorded; the other collectives still run
                errors.append(f"rank {RANK} iteration {it} tensor {k}: {type(e).__name__}: {e}")
                continue
            what = (f"tensor {k} ({s['n']} x {str(s['dtype']).removeprefix('torch.')}, {s['op']}, "
                    f"pre {s['pre']} post {s['post']}, {'in place' if s['inplace'] else 'out of place'})")
            compare(got, _expected(s["n"], it, s["j"], s["dtype"], s["op"], s["pre"], s["post"]), what)
        for i, got in enumerate(hvd.synchronize(group)):
            compare(got, _expected(group_n[i], it, 100 + i, torch.float32, "sum", 1.0, 1.0), f"grouped tensor {i}")
        want_gather = torch.cat([torch.full((r + 1, 3), float(r + it)) for r in range(SIZE)])
        compare(hvd.synchronize(gathered), want_gather, "allgather")
        compare(hvd.synchronize(bcast), torch.full((17,), float((it % SIZE) * 100 + it)), "broadcast")
    os.sched_setaffinity(0, all_cores)
    results = hvd.allgather_object({"rank": RANK, "checked": checked, "errors": errors[:20],
                                    "error_count": len(errors)}, name="inflight.results")
    if RANK == 0:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
