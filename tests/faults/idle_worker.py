"""The CPU a rank uses while it waits (tests/faults/test_idle_cpu.py): each rank's process CPU time, every
thread together (time.process_time), over two windows of --seconds each:

- late: rank 1 sleeps in Python before an allreduce that rank 0 is already waiting in (a slow rank, a rank
  loading data or evaluating: its peer waits);
- idle: every rank sleeps between two collectives (a job between steps, or at a barrier in user code).

Rank 0 prints `result: {"late": [cpu s of rank 0, rank 1, ...], "idle": [...], "seconds": S}`. Horovod's
background thread negotiates every cycle (1 ms) whatever the ranks do; what a waiting rank costs is decided
there (issue 37).
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=8.0)
p.add_argument("--prompt", type=int, default=0,
               help="instead: time this many small allreduces one after another, rank 1 late by a random "
                    "0-2 ms before every other one; prints {\"prompt\": seconds, \"count\": N, \"sum_ok\": bool}")
p.add_argument("--late-peer", type=int, default=0,
               help="instead: time this many allreduces, each with one rank (rank i %% size) arriving 5-300 ms "
                    "after the others; prints {\"late_wait\": [seconds the late rank waited in each], ...}")
p.add_argument("--back-to-back", type=int, default=0,
               help="instead: time this many 4 KiB allreduces, rank 1 late by a random 0-1 ms before every 4th, "
                    "the rest back to back; prints {\"seconds\": [per rank, each call's seconds], \"sum_ok\": bool}")
p.add_argument("--different-collectives", action="store_true",
               help="instead: each rank waits in an allreduce of a name no other rank enqueues (a stall) for "
                    "--seconds, then enqueues the others' too; each prints {\"stall_cpu\": cpu s, \"rank\": r}")
args = p.parse_args()

world = ht.init()
hvd = ht.hvd
hvd.allreduce(torch.ones(1024), name="warm")
time.sleep(1)  # the start-up's threads settle


def allreduce_of(i: int, numel: int, name: str) -> torch.Tensor:
    """The sum over ranks of each rank's rank + i, numel elements (checked by `is_sum`)."""
    return hvd.allreduce(torch.full((numel,), float(world.rank + i)), op=hvd.Sum, name=name)


def is_sum(out: torch.Tensor, i: int) -> bool:
    return bool((out == sum(r + i for r in range(world.size))).all())


if args.prompt:
    # A cycle starts when a tensor is enqueued (fix 13): with a cycle far longer than an allreduce, N in a
    # row take N allreduces' time, not N cycles. Every other time rank 1 arrives late by up to 2 ms; the
    # others are back to back (each rank enqueues the next as soon as the last one completes).
    delays = torch.rand(args.prompt, generator=torch.Generator().manual_seed(1)) * 2e-3
    delays[::2] = 0
    ok, start = True, time.perf_counter()
    for i in range(args.prompt):
        if world.rank == 1:
            time.sleep(float(delays[i]))
        ok &= is_sum(allreduce_of(i, 1024, f"prompt.{i}"), i)
    seconds = time.perf_counter() - start
    every = hvd.allgather_object((seconds, ok), name="prompt")
    if world.rank == 0:
        print("result: " + json.dumps({"prompt": [e[0] for e in every], "sum_ok": all(e[1] for e in every),
                                       "count": args.prompt}), flush=True)
    sys.exit(0)

if args.back_to_back:
    # Fix 14 (Gloo's device loop yields when a user thread holds a pair's lock): without it, a share of these
    # calls took 4 or 8 ms (the scheduler's tick) instead of Gloo's ~0.3 ms. Every call is timed on every
    # rank; the late rank's lateness is part of its peers' time in every 4th call, so those are left out.
    late = torch.rand(args.back_to_back, generator=torch.Generator().manual_seed(3)) * 1e-3
    times, ok = [], True
    for i in range(args.back_to_back):
        if i % 4 == 0 and world.rank == 1:
            time.sleep(float(late[i]))
        start = time.perf_counter()
        out = allreduce_of(i, 1024, f"back_to_back.{i % 8}")
        if i % 4:
            times.append(time.perf_counter() - start)
        ok &= is_sum(out, i)
    every = hvd.allgather_object((times, ok), name="back_to_back")
    if world.rank == 0:
        print("result: " + json.dumps({"seconds": [e[0] for e in every], "sum_ok": all(e[1] for e in every)}),
              flush=True)
    sys.exit(0)

if args.different_collectives:
    # Every rank waits for a tensor that another has not enqueued, so each is "waiting for a late peer" (fix
    # 13 starts such a rank's next cycle at once) and none comes: the cycles must keep their time, not spin.
    # After the window a thread enqueues the other ranks' tensors too, and every allreduce completes.

    def measure():
        start = time.process_time()
        time.sleep(args.seconds)
        used = time.process_time() - start
        handles = [hvd.allreduce_async(torch.ones(4), name=f"stall.{r}") for r in range(world.size) if r != world.rank]
        for h in handles:
            hvd.synchronize(h)
        print("result: " + json.dumps({"stall_cpu": used, "rank": world.rank}), flush=True)

    thread = threading.Thread(target=measure)
    thread.start()
    hvd.allreduce(torch.ones(4), name=f"stall.{world.rank}")
    thread.join()
    sys.exit(0)

if args.late_peer:
    # The ranks that came first are waiting in the allreduce, so it can complete as soon as the late rank
    # enqueues its tensor: the late rank waits in it for an allreduce's time, not for a cycle. Before the
    # fix, when the late rank's cycle ran while the others waited (its cycle time was up), it ran without the
    # tensor, and the late rank's own enqueue then waited for the others' next cycle: up to a whole cycle.
    # Lateness of 5-300 ms with a 200 ms cycle puts a cycle of the late rank inside the wait most times.
    late = 5e-3 + torch.rand(args.late_peer, generator=torch.Generator().manual_seed(2)) * 0.295
    waits, ok = [], True
    for i in range(args.late_peer):
        is_late = world.rank == i % world.size
        if is_late:
            time.sleep(float(late[i]))
        start = time.perf_counter()
        out = allreduce_of(i, 256, f"late_peer.{i}")
        if is_late:
            waits.append(time.perf_counter() - start)
        ok &= is_sum(out, i)
    every = hvd.allgather_object((waits, ok), name="late_peer")
    if world.rank == 0:
        print("result: " + json.dumps({"late_wait": [w for e in every for w in e[0]],
                                       "sum_ok": all(e[1] for e in every)}), flush=True)
    sys.exit(0)

hvd.allreduce(torch.ones(1), name="before.late")
start = time.process_time()
if world.rank == 1:
    time.sleep(args.seconds)
hvd.allreduce(torch.ones(1024), name="late")
late = time.process_time() - start

hvd.allreduce(torch.ones(1), name="before.idle")
start = time.process_time()
time.sleep(args.seconds)
idle = time.process_time() - start
hvd.allreduce(torch.ones(1), name="after.idle")

used = hvd.allgather_object((late, idle), name="cpu")
if world.rank == 0:
    print("result: " + json.dumps({"late": [u[0] for u in used], "idle": [u[1] for u in used],
                                   "seconds": args.seconds}), flush=True)
