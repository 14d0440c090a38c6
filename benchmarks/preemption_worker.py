"""What preempted() costs per optimizer step: the main job's model and batch, with and without the call, in
interleaved rounds; rank 0 prints `bench: {json}`. Run under a launcher:

    horovodrun -np 2 -H localhost:2 python benchmarks/preemption_worker.py --steps 200 --rounds 7
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hvdp.torch as hvdp_torch  # noqa: E402
from train_torch import Net  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    world = hvdp_torch.init(preemption=True)
    torch.manual_seed(0)
    model = Net(1, 10)
    optimizer = hvdp_torch.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    def run(check: bool) -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if check and hvdp_torch.preempted():
                hvdp_torch.exit_for_requeue()
        return (time.perf_counter() - started) / args.steps * 1e3

    def calls_only() -> float:  # nothing to overlap with: each call waits for the previous call's sum
        started = time.perf_counter()
        for _ in range(args.steps):
            if hvdp_torch.preempted():
                hvdp_torch.exit_for_requeue()
        return (time.perf_counter() - started) / args.steps * 1e3

    run(True), run(False), calls_only()  # warm-up
    without, with_check, alone = [], [], []
    for _ in range(args.rounds):
        without.append(run(False))
        with_check.append(run(True))
        alone.append(calls_only())
    if world.rank == 0:
        a, b = statistics.median(without), statistics.median(with_check)
        print("bench: " + json.dumps({"size": world.size, "steps": args.steps, "rounds": args.rounds,
                                      "ms_per_step_without": round(a, 3), "ms_per_step_with": round(b, 3),
                                      "added_ms": round(b - a, 3), "ratio": round(b / a, 3),
                                      "ms_per_call_alone": round(statistics.median(alone), 3)}), flush=True)


if __name__ == "__main__":
    main()
