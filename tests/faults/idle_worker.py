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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=8.0)
args = p.parse_args()

world = ht.init()
hvd = ht.hvd
hvd.allreduce(torch.ones(1024), name="warm")
time.sleep(1)  # the start-up's threads settle

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
