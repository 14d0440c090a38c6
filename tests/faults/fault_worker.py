"""A small training loop in which one rank fails on purpose: `--fault stop|kill|skip --rank R --at-step S`.

stop: SIGSTOP itself (a hung rank); kill: SIGKILL itself (a dead rank); skip: leave the training loop early
and keep running without joining the all-reduce (a rank-dependent code path); pause: sleep --pause seconds
between two steps, outside any collective, then go on (a rank evaluating or writing a slow checkpoint).
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.torch as ht  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--fault", choices=["stop", "kill", "skip", "pause"], required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--at-step", type=int, default=5)
p.add_argument("--steps", type=int, default=10_000)
p.add_argument("--pause", type=float, default=90.0)
args = p.parse_args()

world = ht.init()
model = torch.nn.Linear(8, 2)
opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
for step in range(args.steps):
    if world.rank == args.rank and step == args.at_step:
        print(f"rank {world.rank}: injecting {args.fault} at step {step}", flush=True)
        if args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.fault == "pause":
            time.sleep(args.pause)
        else:
            time.sleep(3600)  # alive, heartbeating, but never reaching the next all-reduce
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
print(f"rank {world.rank}: finished without noticing the fault", flush=True)
