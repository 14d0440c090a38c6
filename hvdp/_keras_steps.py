"""The step account of issue 47 on Keras's fit (both backends): each step's input, compute, gradient-wait and
optimizer times, for hvdp's straggler report (hvdp/_stragglers.py, hvdp.core.stragglers).

A fit step is one call of a compiled function on TensorFlow (steps_per_execution of them per call): no Python
runs inside it. So the step marks its parts itself, with the wall clock (tf.timestamp(), time.time()'s
clock): when its batch is there (the start of train_step, after the data), when its gradients are ready (the
start of DistributedOptimizer.apply), when their all-reduce ended, and when the update ended. Each mark adds
the time since the previous mark to its part's sum, in a variable (Marks). StepTimes, one of
hvdp.keras.callbacks(), sets the first mark at the previous call's end (or the epoch's start: fit takes a
batch before on_train_batch_begin on torch) and, at each call's end, closes one accounted step with the sums
(so with steps_per_execution = s a record covers s steps; every rank has the same s); every K calls and at
each epoch's end the ranks report (a collective every rank reaches at the same call). On torch the step runs
eagerly and the marks are time.time() readings.

What the parts mean is hvdp.core.stragglers's: input is the time from the call's start (or the last step's
update) until the batch is there; compute until the last gradient; wait in the gradient all-reduce (where a
fast rank waits for a slow one); optimizer the update. HVDP_STEP_ACCOUNTING=0 turns it off.

A TensorFlow custom loop over shard()'s dataset (`for x, y in dataset: train_step(x, y)`, the step a
tf.function or eager) is accounted by the same marks (LOOP, one Marks per process, made when shard() makes its
dataset): hvdp.tensorflow's DistributedOptimizer and DistributedGradientTape mark the gradients ready and
reduced (and the optimizer its update) inside the step, and the dataset's eager iterator
(hvdp/tensorflow/tracking.py) times the wait for each batch and closes the step at the next batch's request.
A batch after which nothing was marked (an evaluation over a shard() dataset) closes no step. During a Keras
fit its StepTimes drives the marks and the loop's account stays out.
"""

from __future__ import annotations

import time

import keras

from hvdp import _keras_backend, _stragglers

PARTS = ("input", "compute", "wait", "optimizer")


class Marks:
    """The sums of one call's parts and its last mark: on TensorFlow one float64 variable of 5 values
    (last mark, input, compute, wait, optimizer) that the compiled step updates; on torch a list."""

    def __init__(self):
        self.torch = _keras_backend.on_torch()
        if self.torch:
            self.values = [0.0] * 5
        else:
            import tensorflow as tf
            # made outside any tf.function being traced; in host memory, so that reading it each step copies
            # nothing from a GPU (the marks are host clock readings)
            with tf.init_scope(), tf.device("/CPU:0"):
                self.values = tf.Variable(tf.zeros(5, tf.float64), trainable=False, name="hvdp_step_marks")

    def start(self, now: float) -> None:
        """A call begins at `now` (time.time()): no part measured yet."""
        if self.torch:
            self.values = [now, 0.0, 0.0, 0.0, 0.0]
        else:
            self.values.assign([now, 0.0, 0.0, 0.0, 0.0])

    def mark(self, part: str, after=()):
        """The time since the last mark belongs to `part`; on TensorFlow the mark is taken once the tensors
        `after` are computed (the batch, the gradients, the reduced gradients). Returns `after`."""
        index = 1 + PARTS.index(part)
        if self.torch:
            now = time.time()
            self.values[index] += now - self.values[0]
            self.values[0] = now
            return after
        import tensorflow as tf
        tensors = [t for t in tf.nest.flatten(after) if t is not None and not isinstance(t, tf.IndexedSlices)]
        with tf.control_dependencies(tensors):
            now = tf.timestamp()
        last = self.values[0]
        self.values.assign(tf.tensor_scatter_nd_add(
            tf.tensor_scatter_nd_update(self.values, [[0]], [now]), [[index]], [now - last]))
        return after

    def read(self) -> list[float]:
        """[last mark, input, compute, wait, optimizer] of this call."""
        return list(self.values) if self.torch else [float(v) for v in self.values.numpy()]


def marks(optimizer) -> Marks | None:
    """The Marks a DistributedOptimizer's (or, `optimizer` None, a DistributedGradientTape's) step writes:
    those StepTimes attached, else a custom loop's (LOOP), or None (no accounting)."""
    return getattr(optimizer, "_hvdp_marks", None) or LOOP.marks


class Loop:
    """The step account of a TensorFlow custom loop over shard()'s dataset, driven by its eager iterator:
    epoch_begin() at each iteration's start, fetch() when a batch is asked for (it closes the open step when
    the step marked anything), arrived() when the batch is there, epoch_end() at the iteration's end. All times
    are time.time() readings, the clock of the marks' tf.timestamp().

    The marks are not reset per step (an eager assign, 70 us here): each close reads them (30 us) and takes the
    difference from the previous read. The compute mark counts from the previous step's last mark, so the
    loop's own code after an update (logging, a float() of the loss) and the wait for the batch fall into it;
    the wait, timed here, is taken out again. The marks restart at each iteration's start and end, so the time
    between iterations (an evaluation, a checkpoint) is no step's."""

    def __init__(self):
        self.marks: Marks | None = None  # made by ensure(), in a world of 2+ ranks with the accounting on
        self.hvd = None       # horovod.tensorflow, once the marks are made
        self.fitting = False  # a Keras fit runs: its StepTimes drives the marks
        self.began = 0.0      # the open step's start: the previous step's close, or the iteration's start
        self.input_s = 0.0    # the open step's time waiting for batches
        self.open = False     # a batch arrived since the last close
        self.last = [0.0] * 5  # the marks as the last close (or restart) read them

    def ensure(self, hvd) -> None:
        """Make the marks (shard() calls it, eagerly, before any step is traced, with horovod.tensorflow) on
        TensorFlow in a world of 2+."""
        if self.marks is None and _stragglers.ON and not _keras_backend.on_torch() and hvd.size() > 1:
            self.hvd, self.marks = hvd, Marks()

    def active(self) -> bool:
        return self.marks is not None and not self.fitting

    def _restart(self, now: float) -> None:
        self.marks.start(now)
        self.began, self.input_s, self.open, self.last = now, 0.0, False, [now, 0.0, 0.0, 0.0, 0.0]

    def epoch_begin(self) -> int:
        """An iteration of the dataset starts (a training epoch, or an evaluation inside one): a step its last
        batch began and marked ends here. Returns the steps so far, for epoch_end()."""
        if self.active():
            now = time.time()
            self.fetch(now)
            self._restart(now)
        return _stragglers.steps

    def fetch(self, now: float) -> None:
        """A batch is asked for at `now`: the open step ended, if it marked anything (else its batches and the
        next one make one step, as accumulated passes do)."""
        if not self.active() or not self.open:
            return
        values = self.marks.read()
        if values[0] == self.last[0]:  # nothing marked since the last close: not a training step (yet)
            return
        _, compute, wait, optimizer = (v - w for v, w in zip(values[1:], self.last[1:]))
        _stragglers.closed(self.hvd, (self.input_s, compute - self.input_s, wait, optimizer, now - self.began))
        self.began, self.input_s, self.open, self.last = now, 0.0, False, values

    def arrived(self, asked: float, now: float) -> None:
        """The batch asked for at `asked` is there at `now`: input time."""
        if self.active():
            self.input_s += now - asked
            self.open = True

    def epoch_end(self, steps_before: int) -> None:
        """The iteration that began with `steps_before` steps (epoch_begin()) ended, every rank after the same
        batches (the request that found it over closed its last step: fetch()): report if the loop stepped in
        it."""
        if self.active():
            _stragglers.epoch_end(self.hvd, steps_before)
            self._restart(time.time())


LOOP = Loop()


def ready(optimizer, grads):
    """DistributedOptimizer.apply's start: the gradients are ready (the time since the batch was compute)."""
    m = marks(optimizer)
    return grads if m is None else m.mark("compute", grads)


def reduced(optimizer, grads):
    """The gradients' all-reduce ended (the time since they were ready was waiting)."""
    m = marks(optimizer)
    return grads if m is None else m.mark("wait", grads)


def applied(optimizer, result=None):
    """The wrapped optimizer's update ended."""
    m = marks(optimizer)
    return result if m is None else m.mark("optimizer", result)


class StepTimes(keras.callbacks.Callback):
    """Feeds the straggler report from fit (one of hvdp.keras.callbacks(), on every rank). `boards`: the user's
    keras.callbacks.TensorBoard callbacks, into whose log_dir's train run rank 0 writes each epoch's last
    period (step_ms/<part>/rank<r>, at the epoch)."""

    def __init__(self, boards=()):
        super().__init__()
        self._marks: Marks | None = None
        self._began = 0.0
        self._steps_at_epoch = 0
        self._boards = list(boards)

    def on_train_begin(self, logs=None):
        LOOP.fitting = True
        if not _stragglers.ON or _keras_backend.horovod().size() == 1:
            return
        optimizer, model = self.model.optimizer, self.model
        self._marks = marks(optimizer)
        if self._marks is not None and getattr(model, "_hvdp_marked_step", False):
            return  # a later fit of the same model: its step carries the marks already
        if self._marks is None:
            optimizer._hvdp_marks = self._marks = Marks()
        if not getattr(model, "_hvdp_marked_step", False):  # the batch's arrival, at train_step's start
            step = model.train_step

            def train_step(data):
                m = marks(model.optimizer)
                return step(data if m is None else m.mark("input", data))

            model.train_step, model._hvdp_marked_step = train_step, True
        model.make_train_function(force=True)  # the step now carries the marks

    def on_epoch_begin(self, epoch, logs=None):
        self._steps_at_epoch = _stragglers.steps
        self._began = time.time()

    def on_train_batch_begin(self, batch, logs=None):
        # A call's time runs from the previous call's end: on torch fit takes the batch from its iterator
        # before this callback (on TensorFlow the step takes it inside the compiled call).
        if self._marks is not None:
            self._marks.start(self._began)

    def on_train_batch_end(self, batch, logs=None):
        if self._marks is not None:
            now = time.time()
            _, input_, compute, wait, optimizer = self._marks.read()
            _stragglers.closed(_keras_backend.horovod(), (input_, compute, wait, optimizer, now - self._began))
            self._began = now

    def on_train_end(self, logs=None):
        LOOP.fitting = False

    def on_epoch_end(self, epoch, logs=None):
        if self._marks is None:
            return
        hvd = _keras_backend.horovod()
        _stragglers.epoch_end(hvd, self._steps_at_epoch)
        rows = _stragglers.scalars()
        if not self._boards or not rows or hvd.rank() != 0:
            return
        import tensorflow as tf  # TensorBoard's writer (Keras's TensorBoard needs it on either backend)
        for board in self._boards:
            writer = board._train_writer  # the callback's own (one event file, as the callback alone writes)
            with writer.as_default():
                for tag, value in rows:
                    tf.summary.scalar(tag, value, step=epoch)
            writer.flush()
