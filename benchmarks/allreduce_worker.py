"""All-reduce bandwidth over message sizes for one implementation; rank 0 prints `bench: {json}` per size.

busbw = algbw * 2(n-1)/n (nccl-tests' definition): the bandwidth each link must carry in a ring.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teardown import end_gloo_worker  # noqa: E402

SMALL, SMALL_REPS = 256 << 10, 50  # up to 256 KiB a message's latency is the figure: time at least 50 of them


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp-mpi", "hvdp-gloo", "horovod-mpi", "torch-gloo", "mpi4py"], required=True)
    p.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864", help="bytes")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    if args.impl.startswith(("hvdp", "horovod")):
        import torch

        if args.impl == "horovod-mpi":  # Horovod as its docs show, with its own defaults
            import horovod.torch as hvd
            hvd.init()
        else:
            import hvdp.torch as ht
            ht.init()
            hvd = ht.hvd
        rank, size = hvd.rank(), hvd.size()

        def make(n):
            return torch.ones(n, dtype=torch.float32)

        def reduce(t, i):
            hvd.allreduce_(t, op=hvd.Sum, name=f"bench.{t.numel()}")
    elif args.impl == "torch-gloo":
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def make(n):
            return torch.ones(n, dtype=torch.float32)

        def reduce(t, i):
            dist.all_reduce(t)
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def make(n):
            return np.ones(n, dtype=np.float32)

        def reduce(t, i):
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)

    for nbytes in (int(s) for s in args.sizes.split(",")):
        t = make(nbytes // 4)
        for i in range(args.warmup):
            reduce(t, i)
        times = []
        for i in range(max(args.reps, SMALL_REPS) if nbytes <= SMALL else args.reps):  # latency: many, cheap
            start = time.perf_counter()
            reduce(t, i)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        algbw = nbytes / seconds / 1e9
        if rank == 0:
            print("bench: " + json.dumps({"impl": args.impl, "bytes": nbytes, "np": size, "seconds": seconds,
                                          "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (size - 1) / size}),
                  flush=True)
    if args.impl == "torch-gloo":
        end_gloo_worker(dist)


if __name__ == "__main__":
    main()
