"""Training that a test pauses from outside (tests/faults/test_pause.py): each rank says its pid, rank 0 says
each step it reaches, and at the end each rank prints the SHA-256 of its weights, so that the test can stop
the whole job, or one rank, mid-training and check what follows.

The model's gradient is 4 MiB: under MPI with the shared-memory allreduce and small chunks
(HVDP_SHM_CHUNK_BYTES), most of a step is spent in its barriers, where a pause most often lands.
"""

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.torch as ht  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sleep", type=float, default=0.2, help="seconds between steps, outside any collective")
p.add_argument("--stop-file", help="a file the test writes a step number into: every rank stops at that step "
                                  "(written tens of steps ahead, so every rank reads it in time)")
args = p.parse_args()
stop_file = Path(args.stop_file) if args.stop_file else None

world = ht.init()
print(f"pause_worker: rank {world.rank} pid {os.getpid()}", flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)
opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
g = torch.Generator().manual_seed(world.rank)
x, y = torch.randn(16, 1024, generator=g), torch.randn(16, 1024, generator=g)
for step in range(args.steps):
    if stop_file is not None and stop_file.exists() and step >= int(stop_file.read_text()):
        break
    if world.rank == 0:
        print(f"pause_worker: step {step}", flush=True)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(args.sleep)
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
print(f"pause_worker: rank {world.rank} finished, weights {digest}", flush=True)
