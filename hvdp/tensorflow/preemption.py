"""Preemption for TensorFlow custom loops (and hvdp.keras's callbacks): preempted() after each optimizer step,
and exit_for_requeue() once the checkpoint is written.

    world = hvdp_tf.init(preemption=True)         # SIGTERM / SIGUSR1 now wait for the loop
    for step, (x, y) in enumerate(data, first):
        train_step(x, y)
        if hvdp_tf.preempted():                   # every rank, after every optimizer step
            hvdp_tf.save_checkpoint(directory, model, optimizer, epoch=epoch, step=step + 1, ...)
            hvdp_tf.exit_for_requeue()            # exit 75: "requeue me"

horovod.tensorflow's eager collectives block (and share one name per op type, so none may run beside
another), so the ranks sum their flags every CHECK_EVERY calls, waiting for the sum, instead of overlapping it
with the next step as hvdp.torch does. The policy is hvdp.core.preemption's; the handlers hvdp/_preemption.py's.
"""

from __future__ import annotations

from typing import NoReturn

import tensorflow as tf

from hvdp import _preemption
from hvdp.core.preemption import Agreement
from hvdp.tensorflow.collectives import log
from hvdp.tensorflow.runtime import hvd

CHECK_EVERY = 10  # steps between two sums: a blocking 1-integer all-reduce took 1.7 ms here, a step several


def _agreement() -> Agreement:
    def total(flag: int) -> int:
        return int(hvd.allreduce(tf.constant([flag], tf.int32), op=hvd.Sum, name="hvdp.preempted")[0])

    return Agreement(lambda flag: flag, total, hvd.size(), every=CHECK_EVERY, pipelined=False)


def preempted() -> bool:
    """Whether the job stops now: True on every rank at the same call once any rank got a stop signal.

    Every rank must call it, at the same points: after each optimizer step, eagerly (outside tf.function).
    Every CHECK_EVERY-th call sums a flag over the ranks (a blocking one-integer all-reduce), so a signal is
    acted on within CHECK_EVERY steps of reaching any rank. When it returns True, write the checkpoint
    (save_checkpoint with the step done in this epoch) and call exit_for_requeue(). Always False, and no
    collective, when preemption is off (init(preemption=False), the default, or HVDP_PREEMPTION unset).
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
