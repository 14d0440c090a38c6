"""Rank 0 stops rank 1 (SIGSTOP) in the middle of a long shared-memory allreduce, and lets it go on after
the allreduce's timeout. Each rank prints how its allreduce ended: both must fail it, naming the other
rank, instead of waiting for each other forever. Run by tests/faults/test_hangs.py under horovodrun (MPI)
with tiny chunks (HVDP_SHM_CHUNK_BYTES), so that one allreduce takes seconds."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402

world = ht.init()
hvd = ht.hvd
pids = hvd.allgather_object(os.getpid(), name="stall.pids")
x = torch.ones(96 << 20)  # 384 MiB: about 2 s with 128-byte chunks here
start = time.monotonic()
handle = hvd.allreduce_async_(x, op=hvd.Sum, name="stall")
if world.rank == 0:
    time.sleep(0.2)  # negotiation takes milliseconds: rank 1 is inside the allreduce by now
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(float(os.environ["HVDP_SHM_TIMEOUT_SECONDS"]) + 2)
    os.kill(pids[1], signal.SIGCONT)
try:
    hvd.synchronize(handle)
    print(f"stall: rank {world.rank} completed in {time.monotonic() - start:.1f} s", flush=True)
except Exception as e:  # noqa: BLE001 - what Horovod raises is the point
    print(f"stall: rank {world.rank} failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
