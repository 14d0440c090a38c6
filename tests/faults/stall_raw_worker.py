"""Raw Horovod, no hvdp.init() (issue 52 item 3): rank 0 waits in a broadcast that no other rank posts while
the others sleep. Horovod's own stall inspector must still name the tensor and the ranks missing from it
after HOROVOD_STALL_CHECK_TIME_SECONDS, and end the job after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: hvdp's
engine fixes 12 and 13 (negotiating less often when idle, starting cycles at enqueue) must not silence it."""

import time

import horovod.torch as hvd
import torch

hvd.init()
hvd.allreduce(torch.ones(1), name="warm")
if hvd.rank() == 0:
    print("stall: rank 0 entering broadcast only.rank0", flush=True)
    hvd.broadcast(torch.zeros(4), root_rank=0, name="only.rank0")
    print("stall: rank 0 finished without noticing", flush=True)
else:
    time.sleep(120)  # far past the stall shutdown: the job must end before this rank wakes
