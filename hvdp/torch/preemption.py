"""Preemption: preempted() after each optimizer step, and exit_for_requeue() once the checkpoint is written.

    world = hvdp_torch.init(preemption=True)      # SIGTERM / SIGUSR1 now wait for the loop
    for step, (x, y) in enumerate(loader, first):
        ...
        optimizer.step()
        if hvdp_torch.preempted():                # every rank, after every optimizer step
            hvdp_torch.save_checkpoint(directory, model, optimizer, epoch=epoch, step=step + 1, ...)
            hvdp_torch.exit_for_requeue()         # exit 75: "requeue me"

The policy (signals, exit code, how the ranks agree) is hvdp.core.preemption's; the handlers are
hvdp/_preemption.py's.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from hvdp import _preemption
from hvdp.core.preemption import Agreement
from hvdp.torch.runtime import hvd, log


def _agreement() -> Agreement:
    def submit(flag: int):
        return hvd.allreduce_async_(torch.tensor([flag], dtype=torch.int32), op=hvd.Sum, name="hvdp.preempted")

    return Agreement(submit, lambda handle: int(hvd.synchronize(handle)[0]), hvd.size())


def preempted() -> bool:
    """Whether the job stops now: True on every rank at the same call once any rank got a stop signal.

    Every rank must call it, at the same points: after each optimizer step (not between the backward passes of
    an accumulated step, whose gradients a checkpoint does not hold). Each call adds this rank's flag to a
    one-integer sum over the ranks and reads the previous call's sum, which arrived during the step: a signal
    is acted on at the second call after it reached any rank, at no measurable cost per step. When it returns
    True, write the checkpoint (save_checkpoint with the step done in this epoch) and call exit_for_requeue().
    Always False, and no collective, when preemption is off (init(preemption=False), the default, or
    HVDP_PREEMPTION unset).
    """
    return _preemption.check(_agreement)


def exit_for_requeue() -> NoReturn:
    """End this rank with the requeue exit code (75, EX_TEMPFAIL; HVDP_REQUEUE_EXIT_CODE), saying why on rank
    0. Call it on every rank after the checkpoint preempted() asked for; a Slurm job script (examples/slurm.sbatch)
    then requeues the job, and the run resumes from that checkpoint.

    Raises:
        SystemExit: always, with that code.
    """
    _preemption.exit_for_requeue(log)
