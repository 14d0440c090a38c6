"""hvdp.tensorflow's data sharding: shard() and its ShardPosition (each rank's batches of a tf.data pipeline,
a new order every epoch)."""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from hvdp._horovod import agree
from hvdp.core.consistency import fingerprint_of, sample_positions
from hvdp.core.errors import ConfigError
from hvdp.core.records import RecordIndex, RecordReader
from hvdp.core.sharding import ShardPlan
from hvdp.core.world import World
from hvdp.tensorflow.runtime import _ensure_init, hvd
from hvdp.tensorflow.tracking import watched


class ShardPosition:
    """Where a shard's next iteration starts: `epoch`, the `offset` (samples of its order trained on before,
    by a world of any size) and the batch `step` from there.

    Each iteration of the dataset takes the current position and moves to the start of the next epoch,
    so the order advances by itself; set() moves it (resume, or hvdp.keras following fit's epoch). Each
    iteration reads `plan` anew: an elastic reset replaces it with the new world's (hvdp.keras_elastic).

    Args:
        plan: the hvdp.core.sharding.ShardPlan of this rank (the `plan` attribute).
        passes: the backward passes per optimizer step that shard(weights=True)'s gradient weights assume
            (the `passes` attribute, default 1; hvdp.keras.callbacks sets it from the optimizer).
    """

    def __init__(self, plan: ShardPlan, passes: int = 1):
        self.plan = plan
        self.epoch = 0
        self.step = 0
        self.offset = 0
        self.passes = passes  # backward passes per optimizer step that the gradient weights assume

    def set(self, epoch: int, step: int = 0, offset: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (default 0) counted from `offset` samples
        into its order (default 0: the epoch's start)."""
        self.epoch, self.step, self.offset = int(epoch), int(step), int(offset)

    def _begin(self) -> tuple[ShardPlan, int, int, int]:
        begun = self.plan, self.epoch, self.step, self.offset
        self.epoch, self.step, self.offset = self.epoch + 1, 0, 0
        return begun


_BATCHING = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset", "BatchDataset", "PaddedBatchDataset")


def _batched_by(dataset: tf.data.Dataset) -> str | None:
    """The batching transformation whose batches `dataset` yields (its nearest .batch() or .padded_batch() not
    undone by an .unbatch() after it), or None: read from tf.data's chain of input datasets."""
    while dataset is not None:
        name = type(dataset).__name__
        if name == "_UnbatchDataset":
            return None
        if name in _BATCHING:
            return "padded_batch" if "Padded" in name else "batch"
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def _nested(value, top: bool = False):
    """`value` with its leaves as numpy arrays: tuples and dicts (and lists of arrays, or the top-level list)
    stay the structure, anything else (an array, a list of numbers or file paths) is a leaf."""
    if isinstance(value, dict):
        return {k: _nested(v) for k, v in value.items()}
    if isinstance(value, tuple) or (isinstance(value, list) and (top or (value and all(
            isinstance(v, (np.ndarray, tf.Tensor, tuple, dict)) for v in value)))):
        return tuple(_nested(v) for v in value)
    return np.asarray(value)


def _as_structure(data) -> tuple[tuple, tuple[np.ndarray, ...]]:
    """`data` as (structure, arrays): the structure of one sample (a tuple at the top, nested tuples and dicts
    within, as tf.nest packs them) and its leaves' arrays, one entry per sample each, in tf.nest's order.
    (x, (y1, y2)) and ({"a": xa, "b": xb}, y) keep their nesting; an array alone is the tuple (x,)."""
    if isinstance(data, tf.data.Dataset):
        if data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ConfigError("shard() needs a finite dataset of samples (not batches, not repeated): its "
                              "samples are indexed by the epoch order; remove .repeat()")
        batched = _batched_by(data)
        if batched is not None:
            raise ConfigError(f"shard() needs a dataset of samples, and this one is batched (.{batched}() in its "
                              f"pipeline): shard() batches it itself, batch_size samples per rank. Remove the "
                              f".{batched}() (or pass the unbatched dataset) and give the batch size to shard()")
        # Random access by index is what makes the order exact: read the (unbatched) samples once.
        items = [it if isinstance(it, tuple) else (it,) for it in data.as_numpy_iterator()]
        if not items:
            raise ConfigError("shard() got an empty dataset")
        columns = list(zip(*(tf.nest.flatten(it) for it in items)))
        arrays = []
        for j, column in enumerate(columns):
            shapes = sorted({np.shape(c) for c in column})
            if len(shapes) > 1:
                raise ConfigError(f"shard() needs samples of one shape per element, and element {j} of the "
                                  f"dataset's samples has shapes {shapes[:4]}: pad them to one shape (or, if the "
                                  f"dataset is already batched, remove its batching: shard() batches)")
            arrays.append(np.stack(column))
        return items[0], tuple(arrays)
    structure = _nested(data, top=True)
    structure = structure if isinstance(structure, tuple) else (structure,)
    arrays = tuple(tf.nest.flatten(structure))
    lengths = {len(a) if a.ndim else 0 for a in arrays}
    if len(lengths) != 1:
        raise ConfigError(f"shard() got arrays of different lengths {[len(a) if a.ndim else 0 for a in arrays]}; "
                          f"inputs and labels need one entry per sample")
    return structure, arrays


def _arrays_fingerprint(arrays) -> str:
    """What identifies the data across ranks without reading it all: each array's shape and dtype, and its rows
    at a few fixed positions; an array of strings (file paths) whole, so that another listing or order shows."""
    parts = []
    for a in arrays:
        parts.append(repr((a.shape, a.dtype.str)).encode())
        if a.dtype.kind in "USO":
            parts.append(repr(a.tolist()).encode())
        else:
            parts.extend(np.ascontiguousarray(a[i]).tobytes() for i in sample_positions(len(a)))
    return fingerprint_of(parts)


def _agree_on_arrays(horovod, data, *, call: str, shape: list | None = None, **settings) -> tuple[np.ndarray, ...]:
    """`data` as arrays (_as_structure's leaves), once every rank holds the same: the same number of samples and
    _arrays_fingerprint, and the same `settings`; else ConfigError on every rank, naming the rank and the value
    (shard()'s check, also evaluate()'s: `call` names the function). An error in reading `data` on one rank is
    raised on every rank. One small all-gather; every rank must call it. `shape`, a list, gets the structure of
    one sample appended (_as_structure)."""
    arrays: list = []

    def mine() -> dict:
        structure, leaves = _as_structure(data)
        arrays.extend(leaves)
        if shape is not None:
            shape.append(structure)
        return {**settings, "samples": len(arrays[0]), "fingerprint": _arrays_fingerprint(arrays)}

    agree(horovod, mine, call=call)
    return tuple(arrays)


def _packer(structure: tuple):
    """A function of a sample's flat leaves (as _as_structure orders them) to the sample's `structure`, a tuple."""
    if all(not isinstance(part, (tuple, dict)) for part in structure):
        return tuple
    return lambda leaves: tuple(tf.nest.pack_sequence_as(structure, list(leaves)))


def _gatherer(arrays):
    """A tf.data function from a batch of sample numbers to the tuple of those rows of `arrays`."""
    columns = tuple(tf.convert_to_tensor(a) for a in arrays)  # captured by reference, not in the graph

    def gather(idx):
        return tuple(tf.gather(c, idx) for c in columns)
    return gather


def _record_reader(index: RecordIndex):
    """A tf.data function from a batch of record numbers to the 1-tuple of their serialized records."""
    local = threading.local()  # a reader (its open files) per tf.data thread

    def read(idx):
        reader = getattr(local, "reader", None)
        if reader is None:
            reader = local.reader = RecordReader(index)
        return np.array(reader.read(idx.numpy()), dtype=object)

    def records(idx):
        out = tf.py_function(read, [idx], tf.string)
        out.set_shape([None])
        return (out,)
    return records


def shard(data, *, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
          map=None, num_parallel_calls: int = tf.data.AUTOTUNE, weights: bool = False,
          backward_passes_per_step: int = 1) -> tf.data.Dataset:
    """A tf.data.Dataset of this rank's batches of `data`; `batch_size` is per rank.

    `data` is an array, a tuple of arrays (x, y), a finite tf.data.Dataset of samples (read into memory
    once), or what indexes a dataset too large for memory: file paths (with their labels), or the records
    of TFRecord files (index_records(files)). The epoch order depends only on (seed, epoch), never on
    TensorFlow's global seed; ranks get disjoint slices of each global batch, so N ranks with batch b see at every step
    exactly what one process with batch N*b sees. `map` (decode, augment) runs on each of this rank's
    samples after the split, in parallel and in order, before batching: the pipeline stays tf.data's own
    (no Python per sample), and the returned dataset keeps its `hvdp_position` (a ShardPosition) that says
    and sets where the next iteration starts; transforming the dataset afterwards (.map returns a new
    one) loses it. Each iteration is the next epoch (no set_epoch to forget). Calls init() if needed.

    Every rank must call it, with the same data and settings: they are compared across the ranks (one small
    all-gather): batch_size, seed, shuffle, drop_last, the number of samples and a fingerprint of the data
    (the rows of in-memory arrays at fixed positions, the whole list of file paths, the files and record
    counts of index_records). seed=rank, a per-node copy with one file more, or a listing in another order
    is a ConfigError on every rank, naming the rank and the value.

    Args:
        data: the samples, as above; every rank passes the same. Nested samples keep their nesting:
            (x, (y1, y2)), ({"a": xa, "b": xb}, y), as arrays or a tf.data dataset of such samples (each leaf
            array indexed, the batch packed back into the sample's structure).
        batch_size: samples per rank per batch, from 1 to len(data) // size.
        shuffle: a new order every epoch (default True).
        seed: the seed of the epoch order (default 0).
        drop_last: drop the last, partial global batch of each epoch (default False: split it evenly).
        map: a function of one sample (its arrays' elements as arguments: map(path, label)) returning the
            sample to batch, in TensorFlow ops (default None: the samples as they are).
        num_parallel_calls: samples that `map` processes at once (default tf.data.AUTOTUNE).
        weights: add each sample's gradient weight as the batch's last element, a float32 vector (default
            False): 1.0 in every step of whole batches; in an epoch's last, partial step the factor that
            makes the ranks' averaged gradient one process's mean over that step's samples
            (ShardPlan.gradient_weight); 0.0 for a sample that only tops a batch up. Weight the per-sample
            loss with it (`loss_fn(y, p, sample_weight=w)`, a mean over the batch); hvdp.keras.shard
            passes it to fit as the sample weight.
        backward_passes_per_step: the k of DistributedOptimizer the weights assume (default 1): k batches
            make a step, grouped from the epoch's start; call its flush() after the epoch for the short
            last group.

    Returns:
        A tf.data.Dataset of batches: tuples of batched arrays, one per input array, or what `map` returns,
        batched; with `weights`, one more element at the end.

    Raises:
        ConfigError: the ranks passed different settings or data (on every rank, naming the rank and the
            value); an infinite (repeated), empty or already batched dataset (.batch() or .padded_batch() in
            its pipeline: shard batches), samples of different shapes, arrays of different lengths, batch_size < 1,
            fewer samples than ranks, batch_size larger than each rank's share, `map` not callable, or
            backward_passes_per_step not an integer >= 1.
    """
    return _shard(data, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, map=map,
                  num_parallel_calls=num_parallel_calls, weights=weights, passes=backward_passes_per_step)


def _shard(data, *, batch_size, shuffle, seed, drop_last, map, num_parallel_calls, weights, passes,
           finish=None, horovod=None) -> tf.data.Dataset:
    """shard(); `finish`, a function of a batch's elements, runs on each batch before the prefetch; `horovod`,
    the initialised horovod module whose ranks share the data (default None: horovod.tensorflow, initialised
    here if needed; hvdp.keras passes horovod.torch on Keras's torch backend)."""
    if horovod is None:
        w, horovod = _ensure_init(), hvd
    else:
        w = World.from_horovod(horovod)
    if map is not None and not callable(map):
        raise ConfigError(f"shard(map=...) takes a function of one sample, got {type(map).__name__}")
    if not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"shard(backward_passes_per_step=...) must be an integer >= 1, got {passes!r}")
    settings = {"batch_size": batch_size, "seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    if isinstance(data, RecordIndex):
        n, samples = len(data), _record_reader(data)
        fingerprint = fingerprint_of([repr((list(data.paths), data.counts())).encode()])
        agree(horovod, lambda: {**settings, "samples": n, "fingerprint": fingerprint}, call="shard()")
    else:
        shape: list = []
        arrays = _agree_on_arrays(horovod, data, call="shard()", shape=shape, **settings)
        gather, pack = _gatherer(arrays), _packer(shape[0])
        n, samples = len(arrays[0]), (gather if pack is tuple else lambda idx: pack(gather(idx)))
        del arrays
    plan = ShardPlan(n=n, batch_size=batch_size, rank=w.rank, size=w.size, seed=seed, shuffle=shuffle,
                     drop_last=drop_last)
    position = ShardPosition(plan, passes)

    def epoch_indices():
        # One Python call per epoch: the rest is tf.data's. Every batch but the last of an epoch has
        # batch_size samples, so batching the rank's index stream again gives back its batches.
        plan, epoch, start, offset = position._begin()
        batches = list(plan.batches(epoch, start, offset))
        idx = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        if not weights:
            yield idx
            return
        # Steps counted from `offset` (0 but after an elastic resize), so a resumed epoch groups its passes
        # as before.
        yield idx, np.concatenate([np.full(len(b), plan.gradient_weight(start + i, offset, position.passes),
                                           np.float32)
                                   for i, b in enumerate(batches)] or [np.zeros(0, np.float32)])

    signature = tf.TensorSpec([None], tf.int64)
    if weights:
        signature = (signature, tf.TensorSpec([None], tf.float32))
    dataset = tf.data.Dataset.from_generator(epoch_indices, output_signature=signature)
    dataset = dataset.unbatch().batch(batch_size)
    dataset = dataset.map((lambda idx, wb: (*samples(idx), wb)) if weights else samples,
                          num_parallel_calls=num_parallel_calls, deterministic=True)
    if map is not None:
        user = map
        if weights:  # the user's function sees the sample only; the weight rides along after it
            def user(*element):
                out = map(*element[:-1])
                return (*out, element[-1]) if isinstance(out, tuple) else (out, element[-1])
        dataset = dataset.unbatch().map(user, num_parallel_calls=num_parallel_calls,
                                        deterministic=True).batch(batch_size)
    if finish is not None:
        dataset = dataset.map(finish, num_parallel_calls=num_parallel_calls, deterministic=True)
    dataset = watched(dataset.prefetch(tf.data.AUTOTUNE))  # an eager loop's wait for a batch is known
    dataset.hvdp_position = position
    return dataset


def _position(dataset) -> ShardPosition:
    position = getattr(dataset, "hvdp_position", None)
    if position is None:
        raise ConfigError("the dataset was not made by hvdp's shard() (or was transformed after it: .map() "
                          "returns a new dataset); pass the dataset shard() returned")
    return position
