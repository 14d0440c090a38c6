"""After one collective that every rank runs, each rank submits a collective of its own name, as code that
branches on a value only its rank saw does. Horovod's stall inspector must end the job on every rank after
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, with rank 0 naming the tensors each rank is missing, instead of the
ranks waiting for each other forever. Each rank prints how its collective ended. Run by
tests/faults/test_hangs.py under horovodrun, MPI and Gloo."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdp.torch as ht  # noqa: E402

world = ht.init()
hvd = ht.hvd
assert hvd.allreduce(torch.ones(4), op=hvd.Sum, name="diverge.common").tolist() == [world.size] * 4
start = time.monotonic()
try:
    hvd.allgather(torch.full((3,), float(world.rank)), name=f"diverge.rank{world.rank}")
    print(f"diverge: rank {world.rank} completed in {time.monotonic() - start:.1f} s", flush=True)
except Exception as e:  # noqa: BLE001 - what Horovod raises is the point
    print(f"diverge: rank {world.rank} failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
