"""Sets up hvdp's shared-memory allreduce (raw Horovod under mpirun, HVDP_SHM_ALLREDUCE=1) and runs a few
allreduces through it; tests/faults/test_shm_cleanup.py kills one rank at each point of that with
HVDP_SHM_KILL_AT and lists /dev/shm afterwards."""

import horovod.torch as hvd
import torch

hvd.init()
for i in range(3):
    out = hvd.allreduce(torch.full((100_000,), float(hvd.rank() + 1)), op=hvd.Sum, name=f"shm.{i}")
    assert float(out[0]) == hvd.size() * (hvd.size() + 1) / 2, float(out[0])
print(f"shm_setup_worker: rank {hvd.rank()} done", flush=True)
