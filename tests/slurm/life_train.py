"""A long job's training, run by examples/slurm.sbatch (`--script tests/slurm/life_train.py`) in
tests/slurm/test_sbatch.py's life job and `make soak-life`: benchmarks/models.py's GPT (small), AdamW with its
state sharded across the ranks, the forward pass under bf16 autocast, 2 accumulated backward passes per step,
the gradients clipped by their global norm, the samples read from files by 2 DataLoader workers per rank
(examples/train_torch.py's SampleFiles), and a checkpoint at every epoch's end: every --steps-per-epoch (k)
optimizer steps, all kept.

The global batch is fixed (--global-batch samples per optimizer step): each rank's batch is
global / (size x 2 passes) and the rate is not scaled (lr_scaling="none"), so a job resized between epochs
trains every step on the same samples (shard(): N ranks of batch b see what one process of N*b sees).

Rank 0 prints "life: step S of T done at world size N" after each optimizer step, "life: resumed at step S"
after a resume, and `result: {json}` at the end.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import hvdp.torch as hvdp_torch
from benchmarks.models import GPT
from common import digest, print_result, write_files
from hvdp.core.errors import ConfigError
from train_torch import SampleFiles

PASSES = 2        # backward passes accumulated per optimizer step
VOCAB, CONTEXT = 256, 32
KEEP = 10_000     # every checkpoint stays: the test loads each one


def model() -> GPT:
    return GPT(vocab=VOCAB, context=CONTEXT, width=64, layers=2, heads=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--files", required=True, help="the samples' directory (written once, by rank 0)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps-per-epoch", type=int, default=4, help="k: a checkpoint every k steps")
    parser.add_argument("--global-batch", type=int, default=24, help="samples per optimizer step, all ranks")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="a pause after each step, so that a test's disturbance lands inside the run")
    args = parser.parse_args()

    world = hvdp_torch.init(preemption=True)  # hvdp: SIGTERM/SIGUSR1 checkpoint and exit 75
    if args.global_batch % (world.size * PASSES):
        raise ConfigError(f"--global-batch {args.global_batch} is not a multiple of {world.size} rank(s) x "
                          f"{PASSES} passes")
    batch = args.global_batch // (world.size * PASSES)
    if world.is_main:  # hvdp: one rank writes the files, the others wait for them
        tokens = np.random.default_rng(0).integers(0, VOCAB, (args.steps_per_epoch * args.global_batch,
                                                              CONTEXT + 1))
        write_files(args.files, tokens, np.zeros(len(tokens), np.int64), "npy")
    hvdp_torch.barrier()
    loader = hvdp_torch.shard(SampleFiles(args.files), batch_size=batch, seed=0, num_workers=2)
    torch.manual_seed(0)
    net = model().to(hvdp_torch.device())
    optimizer = hvdp_torch.prepare(  # hvdp: 1/N of AdamW's state per rank; the global batch is fixed
        net, torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1), lr_scaling="none",
        backward_passes_per_step=PASSES, shard_optimizer_state=True)
    resumed = hvdp_torch.load_checkpoint(args.checkpoint_dir, net, optimizer, loader)  # hvdp: resume
    start_epoch, first = (resumed["epoch"], resumed["step"]) if resumed else (0, 0)
    done = resumed["global_step"] if resumed else 0
    total = args.epochs * args.steps_per_epoch
    if resumed:
        hvdp_torch.log(f"life: resumed at step {done} of {total} (epoch {start_epoch} batch {first}) "
                       f"at world size {world.size}")

    def save(epoch: int, step: int) -> None:  # hvdp: rank 0 writes atomically, every rank calls
        hvdp_torch.save_checkpoint(args.checkpoint_dir, net, optimizer, epoch=epoch, step=step, global_step=done,
                                   keep=KEEP)

    device = hvdp_torch.device().type
    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        for i, (seq, _) in enumerate(loader, first if epoch == start_epoch else 0):
            seq = seq.to(hvdp_torch.device())
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = F.cross_entropy(net(seq[:, :-1]), seq[:, 1:].flatten())
            loss.backward()
            if (i + 1) % PASSES:
                continue
            optimizer.clip_grad_norm_(1.0)  # hvdp: the global norm, across the shards
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            hvdp_torch.log(f"life: step {done} of {total} done at world size {world.size}")
            time.sleep(args.step_seconds)
            if hvdp_torch.preempted():  # hvdp: a stop signal on any rank: every rank stops after this step
                save(epoch, i + 1)
                hvdp_torch.exit_for_requeue()
        save(epoch + 1, 0)
    hvdp_torch.check_consistency(net)  # hvdp: replicas bit-identical
    weights = [w.detach().cpu().numpy() for w in net.state_dict().values()]
    if world.is_main:
        print_result({"world_size": world.size, "global_step": done, "seconds": time.perf_counter() - started,
                      "weights_sha256": digest(weights)})


if __name__ == "__main__":
    main()
