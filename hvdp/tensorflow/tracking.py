"""What hvdp's watchdog knows of this rank (TensorFlow): every collective horovod.tensorflow runs eagerly
(allreduce, allgather, broadcast and their grouped and in-place forms, alltoall, reducescatter, join: also
what broadcast_object, allgather_object and hvdp.tensorflow's own broadcast, checks and checkpoints use) is
recorded while it runs by the name Horovod gives it, in the registry the watchdog reads
(hvdp.core.watchdog.Collectives); and a shard() dataset iterated eagerly (a custom loop's `for x, y in
dataset`) tells it while the rank waits for a batch (and times that wait and the loop's steps for the
straggler report: hvdp/_keras_steps.py's LOOP). Collectives and batches inside a tf.function (Keras fit, a
compiled train step) run in TensorFlow's runtime, out of Python's sight: there only silent peers are caught.

install() wraps the functions of Horovod's TensorFlow op library in place, once per process, when the
watchdog runs."""

from __future__ import annotations

import functools
import time

import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops, iterator_ops

from hvdp import _horovod, _keras_steps
from hvdp.core.watchdog import Collectives

LOADING = "in its tf.data input pipeline, waiting for a batch"

# The op library's functions that run a collective. Run eagerly, an op's Horovod name is its kernel's node
# name, which TensorFlow sets to the op's type whatever `name=` says ("HorovodBroadcast"; Horovod's stall
# inspector shows the same): the ranks' eager collectives are paired by type, in order, and that name is what
# tells whether one rank lacks another's.
_OPS = ("horovod_allreduce", "horovod_grouped_allreduce", "horovod_allgather", "horovod_grouped_allgather",
        "horovod_broadcast", "horovod_broadcast_inplace", "horovod_broadcast_inplace_resource", "horovod_alltoall",
        "horovod_reducescatter", "horovod_grouped_reducescatter", "horovod_join")


def install(collectives: Collectives) -> bool:
    """Record horovod.tensorflow's eager collectives in `collectives` from now on; False when this Horovod's
    op library has none of the functions wrapped."""
    import horovod.tensorflow.mpi_ops as mpi_ops

    lib = getattr(mpi_ops, "MPI_LIB", None)
    if lib is None:
        return False
    if getattr(lib, "_hvdp_tracked", None) is collectives:
        return True
    wrapped = 0
    for fn in _OPS:
        original = getattr(lib, fn, None)
        if original is not None:
            setattr(lib, fn, _eager(original, "".join(part.capitalize() for part in fn.split("_")), collectives))
            wrapped += 1
    lib._hvdp_tracked = collectives
    return wrapped > 0


def _eager(original, op_type: str, collectives: Collectives):
    @functools.wraps(original)
    def run(*args, **kwargs):
        if not tf.executing_eagerly():  # traced into a graph: runs later, in TensorFlow's runtime
            return original(*args, **kwargs)
        try:
            with collectives.blocking(op_type):
                return original(*args, **kwargs)
        except Exception as e:  # a collective that raised: the ring is written
            _horovod.collective_failed(None, f"{type(e).__name__}: {str(e)[:200]}")
            raise
    return run


class _WatchedDataset(dataset_ops.UnaryUnchangedStructureDataset):
    """shard()'s dataset as it is (the same elements, the same graph), whose eager iterators tell the watchdog
    while the rank waits for a batch."""

    def __init__(self, dataset: tf.data.Dataset):
        self._input_dataset = dataset
        super().__init__(dataset, dataset._variant_tensor)
        from hvdp.tensorflow.runtime import hvd
        _keras_steps.LOOP.ensure(hvd)  # before any step is traced: the steps then carry the marks

    def __iter__(self):
        if tf.executing_eagerly():
            steps = _keras_steps.LOOP.epoch_begin()
            iterator = _WatchedIterator(self)
            iterator._hvdp_steps_before = steps
            return iterator
        return super().__iter__()


class _WatchedIterator(iterator_ops.OwnedIterator):
    def __next__(self):
        if not tf.executing_eagerly():
            return super().__next__()
        asked = time.time()
        _keras_steps.LOOP.fetch(asked)  # the previous batch's step, if it was one, ended here
        before = _horovod.enter(LOADING)
        try:
            batch = super().__next__()
        except StopIteration:
            _horovod.leave(before)
            _keras_steps.LOOP.epoch_end(getattr(self, "_hvdp_steps_before", 0))
            raise
        except BaseException:
            _horovod.leave(before)
            raise
        _horovod.leave(before)
        _keras_steps.LOOP.arrived(asked, time.time())
        return batch


def watched(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset`, whose eager iteration tells the watchdog while this rank waits for a batch."""
    return _WatchedDataset(dataset)
