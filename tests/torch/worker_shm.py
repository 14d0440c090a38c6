"""Checks of hvdp's shared-memory allreduce (csrc/horovod/shm_operations.cc) inside a real MPI job, run by
tests/torch/test_shm_allreduce.py at several world sizes and chunk sizes.

The reference for every result is computed here from the inputs of all ranks, gathered with MPI's
allgather: the sum in rank order, then Horovod's scaling. It must match bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402
from tests.checks import check, main  # noqa: E402

world = ht.init()
hvd = ht.hvd
EXPECTED_OP = os.environ.get("EXPECT_ALLREDUCE_OP",
                             "SHM_ALLREDUCE" if os.environ.get("HVDP_SHM_ALLREDUCE") == "1" else "MPI_ALLREDUCE")
# Element counts around the 4 KiB chunks most launches use (1024 float32 elements): smaller, equal, crossing
# one and many chunk boundaries, counts that do not split evenly among the ranks, and one that crosses the
# default chunk (256 KiB here) too.
SIZES = [1, 7, 1000, 1023, 1024, 1025, 3 * 1024 + 5, 50_003, 200_003]


def _input(n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype) * (world.rank + 1)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _reference(x, scale_before=1.0, scale_after=1.0):
    """Sum in rank order of every rank's x times `scale_before`, then times `scale_after`, in x's dtype,
    as Horovod scales: in float32 for float32 tensors, in float64 otherwise."""
    parts = hvd.allgather(x.unsqueeze(0), name=f"shm.ref.{x.dtype}.{x.numel()}").unbind(0)
    sdt = torch.float32 if x.dtype == torch.float32 else torch.float64

    def scale(t, s):
        return t if s == 1.0 else (torch.tensor(s, dtype=sdt) * t).to(x.dtype)

    total = scale(parts[0], scale_before)
    for p in parts[1:]:
        total = total + scale(p, scale_before)
    return scale(total, scale_after)


def _same(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what}: max |diff| {(got.double() - want.double()).abs().max().item():.3g}"


@check
def sums_equal_the_rank_order_reference(tmp):
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        for n in SIZES:
            x = _input(n, dtype, seed=n)
            _same(hvd.allreduce(x, op=hvd.Sum, name=f"shm.sum.{dtype}.{n}"), _reference(x), f"sum {dtype} n={n}")
            y = x.clone()
            hvd.allreduce_(y, op=hvd.Sum, name=f"shm.inplace.{dtype}.{n}")
            _same(y, _reference(x), f"in-place sum {dtype} n={n}")


@check
def average_and_scaling_match_horovods(tmp):
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            x = _input(n, dtype, seed=2 * n)
            _same(hvd.allreduce(x, op=hvd.Average, name=f"shm.avg.{dtype}.{n}"),
                  _reference(x, scale_after=1.0 / world.size), f"average {dtype} n={n}")
            _same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.3, postscale_factor=1.7, name=f"shm.sc.{dtype}.{n}"),
                  _reference(x, 0.3, 1.7), f"pre/postscaled {dtype} n={n}")


def _reference_16bit(x, pre=1.0, post=1.0, average=False):
    """16-bit floats as the shared-memory op reduces them: widened to float32, each input times `pre`, summed
    in rank order, times `post` (and 1/size for an average), rounded once. MPI's path (the shared-memory op
    off) rounds after every step instead: after the prescale, after each addition, after the postscale."""
    parts = hvd.allgather(x.unsqueeze(0), name=f"shm.ref16.{x.dtype}.{x.numel()}").unbind(0)
    post32 = torch.tensor(post / world.size if average else post, dtype=torch.float32)
    pre32 = torch.tensor(pre, dtype=torch.float32)
    if EXPECTED_OP == "SHM_ALLREDUCE":
        total = parts[0].float() * pre32
        for p in parts[1:]:
            total = total + p.float() * pre32
        return (total * post32).to(x.dtype)
    scaled = [(p.float() * pre32).to(x.dtype) if pre != 1.0 else p for p in parts]
    total = scaled[0]
    for p in scaled[1:]:
        total = (total.float() + p.float()).to(x.dtype)
    return (total.float() * post32).to(x.dtype) if post32 != 1.0 else total


@check
def float16_and_bfloat16_sum_in_float32_rounded_once(tmp):
    for dtype in (torch.float16, torch.bfloat16):
        for n in SIZES:
            x = _input(n, dtype, seed=3 * n)
            _same(hvd.allreduce(x, op=hvd.Sum, name=f"shm.sum16.{dtype}.{n}"), _reference_16bit(x),
                  f"sum {dtype} n={n}")
            _same(hvd.allreduce(x, op=hvd.Average, name=f"shm.avg16.{dtype}.{n}"),
                  _reference_16bit(x, average=True), f"average {dtype} n={n}")
            _same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.3, postscale_factor=1.7, name=f"shm.sc16.{dtype}.{n}"),
                  _reference_16bit(x, 0.3, 1.7), f"pre/postscaled {dtype} n={n}")
    # Rounded once, not per step: three bfloat16 values whose float32 sum is exact but whose pairwise
    # rounded sum is not (1 + 2**-8 rounds to 1 in bfloat16, while 1 + 2**-8 + 2**-8 is 1 + 2**-7).
    if world.size == 3 and EXPECTED_OP == "SHM_ALLREDUCE":
        x = torch.tensor([1.0 if world.rank == 0 else 2.0 ** -8] * 5, dtype=torch.bfloat16)
        got = hvd.allreduce(x, op=hvd.Sum, name="shm.bf16.once")
        assert torch.equal(got, torch.full((5,), 1 + 2.0 ** -7, dtype=torch.bfloat16)), got


@check
def bfloat16_broadcast_and_allgather(tmp):
    x = _input(1025, torch.bfloat16, seed=5)
    b = hvd.broadcast(x, root_rank=0, name="shm.bf16.bcast")
    rows = hvd.allgather(b.unsqueeze(0), name="shm.bf16.bcast.gather")
    assert b.dtype == torch.bfloat16 and all(torch.equal(rows[0], r) for r in rows), "broadcast differs"
    g = hvd.allgather(x.unsqueeze(0), name="shm.bf16.gather")
    assert g.dtype == torch.bfloat16 and torch.equal(g[world.rank], x), "allgather lost this rank's row"


@check
def fused_tensors_of_odd_sizes(tmp):
    # One grouped allreduce is one fused response: the chunks run across tensor boundaries, and an empty
    # tensor sits in the middle.
    xs = [_input(n, torch.float32, seed=i) for i, n in enumerate([5, 0, 1031, 3, 4097, 17, 2048])]
    outs = hvd.grouped_allreduce(xs, op=hvd.Average, name="shm.grouped")
    for i, (x, out) in enumerate(zip(xs, outs)):
        _same(out, _reference(x, scale_after=1.0 / world.size), f"grouped tensor {i} ({x.numel()} elements)")


@check
def every_rank_gets_the_same_bits(tmp):
    x = _input(100_003, torch.float32, seed=9)
    out = hvd.allreduce(x, op=hvd.Average, name="shm.same")
    rows = hvd.allgather(out.unsqueeze(0), name="shm.same.gather")
    assert all(torch.equal(rows[0], r) for r in rows[1:]), "ranks disagree on the reduced tensor"


def _activities(timeline: str) -> dict[str, set[str]]:
    """{tensor name: names of the activities Horovod's timeline recorded for it} (pid = one tensor)."""
    events = json.loads(timeline.rstrip().rstrip(",") + ("" if timeline.rstrip().endswith("]") else "]"))
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e.get("args", {})}
    found: dict[str, set[str]] = {}
    for e in events:
        if e.get("ph") == "B" and e["pid"] in names:
            found.setdefault(names[e["pid"]], set()).add(e["name"])
    return found


@check
def the_op_that_ran_is_the_one_configured(tmp):
    # Horovod's timeline names the operation that executed each collective. (Every dtype the torch bindings
    # allreduce takes the shared-memory op when it is on.)
    path = tmp / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=False)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        hvd.allreduce(torch.ones(4096, dtype=dtype), name=f"shm.timeline.{dtype}")
    hvd.stop_timeline()
    if world.rank == 0:
        found = _activities(path.read_text())
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert EXPECTED_OP in found[f"allreduce.shm.timeline.{dtype}"], (dtype, found)


if __name__ == "__main__":
    main(lambda obj: hvd.allgather_object(obj, name="checks.results"), world.rank)
