"""One training-throughput measurement: `--impl` trains `--model` on synthetic data for warmup + reps x steps.

Launched by `hvdp bench` (benchmarks/ is where its workers live) under the launcher each implementation
needs: hvdp, hvdp-sharded (its optimizer state sharded: prepare(..., shard_optimizer_state=True)) and horovod under
horovodrun, ddp and ddp-zero (DDP with torch's ZeroRedundancyOptimizer) under torchrun, alone as plain python.
Rank 0 prints `bench: {json}` with the median samples/s per rank and the spread over repetitions; each
repetition's record also holds rank 0's memory (benchmarks/memory.py): the optimizer-state and gradient bytes
after the repetition's last step and the process's rise since before training.
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
from models import MODELS, batch, split_name  # noqa: E402
from cputhreads import Threads  # noqa: E402
from memory import Rise, held  # noqa: E402
from teardown import end_gloo_worker  # noqa: E402
from turns import Turns, add_arguments  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp", "hvdp-sharded", "horovod", "ddp", "ddp-zero", "alone"], required=True)
    p.add_argument("--model", required=True, help=f"{', '.join(MODELS)}, optionally -compiled and/or -bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (with --turns: one per turn)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd (momentum 0.9) or adamw (Adam-like state: two fp32 tensors per parameter)")
    add_arguments(p)
    p.add_argument("--batch", type=int, help="per-rank batch (default: the model's, benchmarks/models.py)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="auto: each rank's own GPU when torch sees one (the local rank's), else the CPU")
    args = p.parse_args()
    use_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())

    base, compiled, bf16 = split_name(args.model)
    factory, _, batch_size = MODELS[base]
    batch_size = args.batch or batch_size
    rank, size, device = 0, 1, torch.device("cuda" if use_gpu else "cpu")
    threads = Threads.before_init()
    if args.impl in ("hvdp", "hvdp-sharded"):
        import hvdp.torch as ht
        world = ht.init(device="cuda" if use_gpu else "cpu")  # hvdp: its runtime defaults, the rank's own GPU
        rank, size, device = world.rank, world.size, ht.device()
    elif args.impl == "horovod":
        import horovod.torch as hvd  # as Horovod's docs show
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if use_gpu:
            torch.cuda.set_device(hvd.local_rank())
            device = torch.device("cuda", hvd.local_rank())
    elif args.impl in ("ddp", "ddp-zero"):
        import torch.distributed as dist
        dist.init_process_group("nccl" if use_gpu else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        if use_gpu:
            local = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
    threads.after_init(engine=args.impl in ("hvdp", "hvdp-sharded", "horovod"))
    torch.set_num_threads(args.threads)  # the same thread setting for every implementation

    torch.manual_seed(0)
    model = factory().to(device)
    rise = Rise(device)  # from here: what the optimizer, its wrapping and the training add
    make, options = ((torch.optim.AdamW, {"lr": 1e-4}) if args.optimizer == "adamw" else
                     (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}))
    if args.impl == "ddp-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_gpu else None)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=make, **options)
    else:
        optimizer = make(model.parameters(), **options)
    if args.impl in ("hvdp", "hvdp-sharded"):
        optimizer = ht.prepare(model, optimizer, lr_scaling="none",  # hvdp: ZeRO-1/2 with hvdp-sharded
                               shard_optimizer_state=args.impl == "hvdp-sharded")
        if compiled:
            model = ht.compile(model)  # hvdp: the compiled backward still overlaps the all-reduce
    elif args.impl == "horovod":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif args.impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_gpu else None)
    if compiled and args.impl not in ("hvdp", "hvdp-sharded"):
        model = torch.compile(model)  # as each library's users do (DDP's compiler splits at its buckets)

    x, y = (t.to(device) for t in batch(base, batch_size, torch.Generator().manual_seed(rank)))

    def step():
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    turns = Turns.from_args(args, rank)  # set up: from here it runs only in its turns
    turns.wait("warmup")
    for _ in range(args.warmup):
        step()
    if use_gpu:
        torch.cuda.synchronize()
    turns.done("warmup", {})
    rates = []
    for rep in range(args.reps):
        turns.wait(rep)
        threads.start()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if use_gpu:
            torch.cuda.synchronize()  # the GPU's queued work belongs to the repetition
        rates.append(batch_size * args.steps / (time.perf_counter() - start))
        threads.stop()
        turns.done(rep, {"samples_per_sec": rates[-1], "cpu_by_thread": threads.report(),
                         "memory": {**held(model, optimizer), **rise.report()}})
    if rank == 0:
        print("bench: " + json.dumps({
            "impl": args.impl, "model": args.model, "np": size, "threads": args.threads, "device": str(device),
            "samples_per_sec": statistics.median(rates), "spread": [min(rates), max(rates)],
            "optimizer": args.optimizer, "memory": {**held(model, optimizer), **rise.report()},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_CYCLE", "HOROVOD_FUSION",
                                                                          "OMPI_MCA_mpi_yield"))}}), flush=True)
    if args.impl in ("ddp", "ddp-zero"):
        end_gloo_worker(dist)


if __name__ == "__main__":
    main()
