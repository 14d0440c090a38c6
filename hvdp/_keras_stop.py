"""A Keras callback's `model.stop_training = True` on one rank, made every rank's at the same step.

Keras's fit reads `model.stop_training` after each step's callbacks and after each epoch's: a rank where a
callback set it (TerminateOnNaN on a rank-local loss, EarlyStopping on a rank-local value, a user callback)
leaves the loop while the others enter the next step's gradient all-reduce, and the job hangs. hvdp.keras's
callbacks make the decision collective without a round trip of its own per step:

- a request made in a step's callbacks is carried, as one number, by the next step's gradient all-reduce
  (StopFlag and reduce_then_apply, which DistributedOptimizer.apply calls): the request is withdrawn from
  Keras on the asking rank (`stop_training` back to False) so that it takes that step too; when the sum is
  not zero, no rank applies that step (the weights stay those after the asking step, on every rank) and
  every rank's fit stops after it;
- a request made in the epoch's last step or at the epoch's end is settled by one one-number all-reduce per
  epoch, after the other callbacks' on_epoch_end.

The flag lives apart from the optimizer's variables (checkpoints and broadcasts do not see it). On Keras's
torch backend, where fit's step runs eagerly, the step reads the all-reduced number back (one host sync).
"""

from __future__ import annotations

import keras

from hvdp import _keras_backend


SIGNALLED = 2.0  # the request's value when a stop signal made it (1.0: a callback's)


class StopFlag:
    """This rank's request to stop (asked, a Keras variable the compiled step reads) and the ranks' agreement
    (agreed: a Keras variable the compiled step writes on TensorFlow, a bool on torch, where the step is eager)."""

    def __init__(self):
        self.asked_variable = keras.Variable(0.0, dtype="float32", trainable=False, name="hvdp_stop_asked")
        self._agreed = False if _keras_backend.on_torch() else keras.Variable(
            0.0, dtype="float32", trainable=False, name="hvdp_stop_agreed")
        # the steps run without applying anything since the agreement, that one included (its data was read)
        self._skipped = 0 if _keras_backend.on_torch() else keras.Variable(
            0, dtype="int64", trainable=False, name="hvdp_stop_skipped")

    def reset(self) -> None:
        """No request, no agreement (at each fit's start and end)."""
        self.asked_variable.assign(0.0)
        if _keras_backend.on_torch():
            self._agreed, self._skipped = False, 0
        else:
            self._agreed.assign(0.0)
            self._skipped.assign(0)

    def skipped(self) -> int:
        """How many of the steps read so far applied nothing: the one that carried the agreement and those
        after it in the same steps_per_execution loop (the same on every rank)."""
        return self._skipped if _keras_backend.on_torch() else int(keras.ops.convert_to_numpy(self._skipped))

    def ask(self) -> None:
        """Ask every rank to stop: the next gradient all-reduce carries it."""
        self.asked_variable.assign(1.0)

    def ask_for_signal(self) -> None:
        """A stop signal's request (hvdp/_preemption.py's thread, possibly mid-step): carried the same way, but
        an epoch's end does not settle it (the next epoch's first step carries it, and the ranks checkpoint)."""
        self.asked_variable.assign(SIGNALLED)

    def asked(self) -> bool:
        """Whether a callback on this rank asked to stop (not a signal: see ask_for_signal)."""
        return float(keras.ops.convert_to_numpy(self.asked_variable)) == 1.0

    def agreed(self) -> bool:
        """Whether a gradient all-reduce carried some rank's request (the same answer on every rank)."""
        if _keras_backend.on_torch():
            return self._agreed
        return float(keras.ops.convert_to_numpy(self._agreed)) > 0


def reduce_then_apply(optimizer, grads: list, variables: list, apply, allreduce) -> None:
    """`apply(allreduce(grads, variables))`, unless the ranks stop: with `optimizer._hvdp_stop` (a StopFlag,
    set by hvdp.keras's callbacks) the all-reduce carries one more number, the ranks' requests to stop;
    where their sum is not zero nothing is applied and the flag records the agreement, and while it holds
    (the rest of a steps_per_execution loop) no step all-reduces or applies anything. Every rank takes the
    same branch.

    Args:
        optimizer: the DistributedOptimizer whose step this is.
        grads: the gradients (None where a variable has none).
        variables: their variables.
        apply: applies the averaged gradients (the wrapped optimizer's apply).
        allreduce: allreduce(gradients, variables), their average over the ranks.
    """
    flag = getattr(optimizer, "_hvdp_stop", None)
    if flag is None:
        apply(allreduce(grads, variables))
        return
    present = next((g for g in grads if g is not None), None)
    dtype = "float32" if present is None else keras.backend.standardize_dtype(present.dtype)
    if _keras_backend.on_torch():
        if flag._agreed:
            flag._skipped += 1
            return
        reduced = allreduce([*grads, keras.ops.cast(flag.asked_variable.value, dtype)],
                            [*variables, flag.asked_variable])
        if float(reduced[-1]) > 0:
            flag._agreed, flag._skipped = True, flag._skipped + 1
            return
        apply(reduced[:-1])
        return
    import tensorflow as tf

    def skip():
        flag._skipped.assign_add(1)
        return tf.constant(False)

    def run():
        reduced = allreduce([*grads, tf.cast(flag.asked_variable.value, dtype)], [*variables, flag.asked_variable])
        stop = reduced[-1] > 0
        flag._agreed.assign(tf.cast(stop, tf.float32))

        def step():
            apply(reduced[:-1])
            return tf.constant(True)

        return tf.cond(stop, skip, step)

    tf.cond(flag._agreed.value > 0, skip, run)


class AgreeOnStop(keras.callbacks.Callback):
    """The last of fit's callbacks (hvdp.keras's DistributedCallback puts it there): sees what every other
    callback set on `model.stop_training` and makes it every rank's decision (see the module's docstring).

    Args:
        flag: the StopFlag the model's DistributedOptimizer carries.
    """

    def __init__(self, flag: StopFlag):
        super().__init__()
        self.flag = flag

    def on_train_batch_end(self, batch, logs=None):
        """A step that carried some rank's request stops every rank; a request made in this step's callbacks
        is withdrawn from Keras here and carried by the next step (or settled at the epoch's end)."""
        if self.flag.agreed():
            self.model.stop_training = True
        elif self.model.stop_training:
            self.model.stop_training = False
            self.flag.ask()

    def on_epoch_end(self, epoch, logs=None):
        """Settle a request of the epoch's last step or of an on_epoch_end: one one-number all-reduce, on every
        rank at every epoch's end (collective)."""
        local = 1.0 if (self.model.stop_training or self.flag.asked()) else 0.0
        if _keras_backend.allreduce_mean([local], "hvdp.stop_training")[0] > 0:
            self.model.stop_training = True
