"""One training-throughput measurement: `--impl` trains `--model` on synthetic data for warmup + reps x steps.

Launched by `hvdp bench` (benchmarks/ is where its workers live) under the launcher each implementation
needs: hvdp and horovod under horovodrun, ddp under torchrun, alone as plain python. Rank 0 prints
`bench: {json}` with the median samples/s per rank and the spread over repetitions.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402
from teardown import end_gloo_worker  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp", "horovod", "ddp", "alone"], required=True)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    factory, shape, batch = MODELS[args.model]
    rank, size = 0, 1
    if args.impl == "hvdp":
        import hvdp.torch as ht
        world = ht.init()  # hvdp: its tuned runtime defaults apply here
        rank, size = world.rank, world.size
    elif args.impl == "horovod":
        import horovod.torch as hvd  # as Horovod's docs show
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif args.impl == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)  # the same thread setting for every implementation

    torch.manual_seed(0)
    model = factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.impl == "hvdp":
        optimizer = ht.prepare(model, optimizer, lr_scaling="none")
    elif args.impl == "horovod":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif args.impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        rates.append(batch * args.steps / (time.perf_counter() - start))
    if rank == 0:
        print("bench: " + json.dumps({
            "impl": args.impl, "model": args.model, "np": size, "threads": args.threads,
            "samples_per_sec": statistics.median(rates), "spread": [min(rates), max(rates)],
            "env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_CYCLE", "HOROVOD_FUSION",
                                                                          "OMPI_MCA_mpi_yield"))}}), flush=True)
    if args.impl == "ddp":
        end_gloo_worker(dist)


if __name__ == "__main__":
    main()
