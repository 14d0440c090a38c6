"""shard() of a map-style dataset: ShardSampler (this rank's batches of each epoch, its resumable position)
and the DataLoader that tells the gradient hooks which batch is being trained on. Streams: streams.py."""

from __future__ import annotations

import dataclasses
import warnings
from time import perf_counter
from typing import Any, Callable

import numpy as np
import torch
import torch.utils.data

from hvdp import _horovod, _stragglers
from hvdp._horovod import agree
from hvdp.core.consistency import fingerprint_of, sample_positions
from hvdp.core.errors import ConfigError
from hvdp.core.sharding import ShardPlan, StreamSplit
from hvdp.torch.collectives import _raw_bytes
from hvdp.torch.runtime import hvd, init, world
from hvdp.torch.streams import _stream
from hvdp.torch.weights import _handing_out
from hvdp.torch.workers import LOADING, STARTING_WORKERS, _configure


class PeekWarning(UserWarning):
    """An iteration over shard()'s loader stopped after its first batch and the next one began: the batches
    of that epoch not handed out were never trained on (each iter(loader) is the next epoch)."""


class ShardSampler(torch.utils.data.Sampler):
    """A batch sampler yielding this rank's batches; each iteration starts the next epoch by itself.

    Its position is (epoch, offset): the next iteration runs `epoch` from `offset` samples into the
    epoch order. Under an ElasticState it also counts the optimizer steps of the iteration in progress,
    so that a commit records exactly what was trained on and a resized world carries on from there.
    shard() builds one; use it as a DataLoader's batch_sampler. len() is the number of batches left in
    the next iteration.

    Args:
        plan: the hvdp.core.sharding.ShardPlan of this rank; replaced by one for the new rank and size when
            an elastic reset changes them.
    """

    def __init__(self, plan: ShardPlan):
        self.plan = plan
        self.epoch, self.offset = 0, 0
        self._running: list[int] | None = None  # [epoch, offset, steps, steps trained] of this iteration

    def __len__(self) -> int:
        return self.plan.steps_for(self.plan.n - self.offset)

    def __iter__(self):
        self._follow_world()
        epoch, offset = self.epoch, self.offset
        self.epoch, self.offset = epoch + 1, 0
        self._running = [epoch, offset, self.plan.steps_for(self.plan.n - offset), 0]
        for batch in self.plan.batches(epoch, offset=offset):
            yield batch.tolist()

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (used when resuming a checkpoint).

        Args:
            epoch: the epoch to run next.
            step: batches of that epoch already done, at the current world size (default 0).
        """
        self.resume(int(epoch), self.plan.consumed(0, int(step)))

    def resume(self, epoch: int, offset: int) -> None:
        """Make the next iteration run `epoch` from `offset` samples into its order.

        Args:
            epoch: the epoch to run next.
            offset: samples of its epoch order already trained on, by a world of any size.
        """
        self.epoch, self.offset, self._running = epoch, offset, None

    def position(self) -> tuple[int, int]:
        """(epoch, offset) of the first sample not trained on yet, counting recorded steps."""
        if self._running is not None:
            epoch, offset, steps, trained = self._running
            if trained < steps:
                return epoch, self.plan.consumed(offset, trained)
        return self.epoch, self.offset

    def record_steps(self, batches: int) -> None:
        """Record that `batches` batches of the iteration in progress were trained on.

        Called after each optimizer step under an ElasticState; a no-op between iterations.
        """
        if self._running is not None:
            self._running[3] += batches

    def gradient_weight(self, index: int, passes: int = 1) -> float:
        """The weight of batch `index` of the iteration in progress when `passes` batches make one step
        (ShardPlan.gradient_weight): 1.0 for a full step, size*passes*real/(the step's real samples) otherwise."""
        offset = self._running[1] if self._running is not None else self.offset
        return self.plan.gradient_weight(index, offset, passes)

    def _follow_world(self) -> None:
        """Re-split the data when an elastic reset changed this rank's place in the world."""
        if hvd.is_initialized() and (hvd.rank(), hvd.size()) != (self.plan.rank, self.plan.size):
            self.plan = dataclasses.replace(self.plan, rank=hvd.rank(), size=hvd.size())


def shard(dataset: torch.utils.data.Dataset, *, batch_size: int, shuffle: bool = True, seed: int = 0,
          drop_last: bool = False, transform: Callable | None = None, check_items: bool = True,
          **loader_kwargs: Any) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's share of `dataset`; `batch_size` is per rank.

    The epoch order depends only on (seed, epoch); ranks get disjoint slices of each global batch, so
    N ranks with batch b see at every step exactly what one process with batch N*b sees. Each iteration
    over the loader is the next epoch (no set_epoch to forget); every rank gets the same number of batches.
    Calls init() if Horovod is not initialised yet.

    Every rank must call it, with the same data and settings: they are compared across the ranks (one small
    all-gather): batch_size, seed, shuffle, drop_last, the data's length and a fingerprint of its contents
    (rows of a TensorDataset at fixed positions, the file list of a data set with `samples`, `imgs`, `files`
    or `paths`, a Subset's indices; for any other map-style dataset, a few items read through __getitem__ at
    fixed positions with the global generators seeded alike). seed=rank, a per-node copy with one file more, a
    listing in another order, or a custom Dataset that builds its data with an unseeded torch.rand is a
    ConfigError on every rank, naming the rank and the value.

    A stream (a torch IterableDataset: WebDataset, a Hugging Face streaming dataset, a database cursor) is
    split the same way with the stream's own order as the epoch order: every rank and loader worker reads
    the whole stream, keeps its part, and applies `transform` to that part only. The ranks agree every few
    batches on how far their streams went, so all take the same number of steps, and a stream that ends
    early or differs on one rank is a DataError on every rank instead of a hang. Each iteration calls the
    dataset's set_epoch(epoch) if it has one (its shuffle per epoch); hvdp cannot reorder a stream. Resuming
    mid-epoch reads the stream again from its start and drops the steps already trained on.

    Args:
        dataset: a map-style dataset (len() and indexing), or a torch IterableDataset whose every copy yields
            the whole stream in the same order on every rank (do not split it by rank or worker yourself).
        batch_size: samples per rank per batch, from 1 to len(dataset) // size.
        shuffle: a new order every epoch (default True); False keeps the dataset's order. A stream keeps
            its own order (shuffle it in the stream, by epoch through set_epoch).
        seed: the seed of the epoch order (default 0); the same on every rank.
        drop_last: drop the last, partial global batch of each epoch (default False: split it evenly).
        transform: a stream's function applied to each of this rank's elements after the split, in the
            loader workers (decoding, augmentation: the elements of other ranks are never transformed);
            default None. A map-style dataset transforms in its __getitem__ (it reads only this rank's).
        check_items: compare a few items of a dataset hvdp cannot otherwise fingerprint (default True); False
            for one whose __getitem__ draws from a generator of its own, unseeded (then only its length is
            compared).
        loader_kwargs: passed to torch.utils.data.DataLoader (num_workers, collate_fn, pin_memory...), but
            not batch_size, shuffle or sampler; `generator` defaults to one seeded with seed + rank. With
            num_workers > 0, `multiprocessing_context` defaults to forkserver (fork can deadlock in a rank
            whose threads run), and persistent_workers to True for a map-style dataset (workers start once
            per run); the dataset, collate_fn, worker_init_fn and transform must pickle, and the script must
            keep its training code under `if __name__ == "__main__":` (each worker imports it). A stream
            refuses persistent_workers=True (the workers would keep the first epoch's position).

    Returns:
        A DataLoader whose batch_sampler is a ShardSampler; for a stream, one that yields this rank's
        collated batches (its len() is known when the dataset has a len()).

    Raises:
        ConfigError: the ranks passed different settings or data (on every rank, naming the rank and the
            value); batch_size < 1, fewer samples than ranks, or batch_size larger than each rank's share;
            a map-style dataset without len(); `transform` with a map-style dataset; persistent_workers with
            a stream; with num_workers > 0, an object the workers cannot receive (named), or a script that
            started Horovod at its unguarded top level (the line named). For a stream the sample counts are
            checked as it is read, on every rank.
    """
    w = world() if hvd.is_initialized() else init()
    if isinstance(dataset, torch.utils.data.IterableDataset):
        _agree(dataset, batch_size=batch_size, seed=seed, drop_last=drop_last)
        return _stream(dataset, StreamSplit(batch_size=batch_size, rank=w.rank, size=w.size, drop_last=drop_last),
                       transform, seed, loader_kwargs)
    if transform is not None:
        raise ConfigError("shard(transform=...) is for a stream (a torch IterableDataset); a map-style dataset "
                          "transforms in its __getitem__, which reads only this rank's samples")
    try:
        len(dataset)
    except TypeError:
        raise ConfigError(f"shard() needs len(dataset) for a map-style dataset; {type(dataset).__name__} has "
                          f"none: give it a __len__, or make it a torch.utils.data.IterableDataset (a stream)",
                          rank=w.rank) from None
    _agree(dataset, check_items=check_items, batch_size=batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
    plan = ShardPlan(n=len(dataset), batch_size=batch_size, rank=w.rank, size=w.size, seed=seed,
                     shuffle=shuffle, drop_last=drop_last)
    # Its own generator: a DataLoader otherwise draws from the global RNG at every epoch start, which
    # would make a resumed run's dropout masks differ from an uninterrupted one's.
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed + w.rank))
    # Workers started by forkserver, once per run: the sampler is here, so a kept worker needs nothing new.
    _configure(loader_kwargs, {"dataset": dataset}, persistent=True)
    return _ShardLoader(dataset, batch_sampler=ShardSampler(plan), **loader_kwargs)


class _ShardLoader(torch.utils.data.DataLoader):
    """shard()'s DataLoader: as it hands out each batch it tells prepare()'s gradient hooks which one it is
    (_Batch), so that an epoch's uneven last step is weighted exactly. Workers prefetch ahead; what the
    loop receives is the batch it trains on."""

    def __iter__(self):
        before = _horovod.enter(STARTING_WORKERS) if self.num_workers else None
        try:
            batches = super().__iter__()  # starts the workers (the first time only, when they persist)
        finally:
            _horovod.leave(before)
        if self._peeked is not None:
            warnings.warn(f"shard()'s loader: the pass over epoch {self._peeked} stopped after its first batch (a "
                          f"`next(iter(loader))` to peek at a batch?), and each iter(loader) is the next epoch, so "
                          f"that epoch's other batches were never trained on; look at a sample with "
                          f"loader.dataset[0] instead", PeekWarning, stacklevel=2)
            self._peeked = None
        handed = 0
        # hvdp (issue 47, step accounting): the time this rank waits for each batch; the report at the epoch's end
        steps_before, asked = _stragglers.steps, perf_counter()
        _stragglers.epoch_start()
        try:
            for batch in _handing_out(self.batch_sampler, enumerate(_horovod.watched(batches, LOADING))):
                _stragglers.loader_wait(asked, perf_counter())
                handed += 1
                yield batch
                asked = perf_counter()
        finally:  # an iteration abandoned after one batch of several
            running = getattr(self.batch_sampler, "_running", None)
            if handed == 1 and running is not None and running[2] > 1:
                self._peeked = running[0]
        _stragglers.epoch_end(hvd, steps_before)  # every rank, after the same batches (not when abandoned)

    _peeked: int | None = None  # the epoch whose iteration stopped after its first batch

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (load_checkpoint calls it)."""
        self.batch_sampler.set_position(epoch, step)


def _agree(dataset, *, check_items: bool = True, **settings) -> None:
    """Raise ConfigError on every rank, naming the rank and the value, unless every rank passed shard() the
    same settings and a dataset of the same length and fingerprint (one small all-gather per loader)."""
    agree(hvd, lambda: {**settings, **_data_identity(dataset, check_items)}, call="shard()")


def _data_identity(dataset, check_items: bool = True) -> dict:
    """What the ranks compare of a data set (shard() and evaluate()): its length, the fingerprint of what
    identifies it, and, for a data set hvdp cannot look into, a fingerprint of a few of its items."""
    try:
        samples = len(dataset)
    except TypeError:  # a stream without len()
        samples = None
    found = {"samples": samples, "fingerprint": _data_fingerprint(dataset)}
    if check_items and not found["fingerprint"] and samples and not isinstance(dataset, torch.utils.data.IterableDataset):
        found["items"] = _items_fingerprint(dataset, samples)
    return found


READING_ITEMS = "reading a few of its dataset's items, to compare the data across the ranks (shard(), evaluate())"

# Attributes that hold a data set's file list (torchvision's DatasetFolder/ImageFolder: samples, imgs).
_FILE_LISTS = ("samples", "imgs", "files", "paths", "file_list")


def _data_fingerprint(dataset) -> str:
    """A digest of what identifies `dataset` without reading its samples through __getitem__ (which may
    decode or augment at random): the rows of in-memory tensors at a few fixed positions, a file list, the
    indices of a Subset, the parts of a ConcatDataset. "" for a data set hvdp cannot look into (then its
    items are compared: _items_fingerprint)."""
    parts: list[bytes] = []

    def visit(d) -> None:
        if isinstance(d, torch.utils.data.TensorDataset):
            for t in d.tensors:
                parts.append(repr((tuple(t.shape), str(t.dtype))).encode())
                parts.extend(_raw_bytes(t[i]) for i in sample_positions(len(t)))
        elif isinstance(d, torch.utils.data.Subset):
            parts.append(np.asarray(d.indices, dtype=np.int64).tobytes())
            visit(d.dataset)
        elif isinstance(d, torch.utils.data.ConcatDataset):
            for part in d.datasets:
                visit(part)
        else:
            for attr in _FILE_LISTS:
                files = getattr(d, attr, None)
                if isinstance(files, (list, tuple)):
                    parts.append(repr(list(files)).encode())
                    break

    visit(dataset)
    return fingerprint_of(parts) if parts else ""


def _items_fingerprint(dataset, n: int) -> str:
    """A digest of the items at sample_positions(n), read through __getitem__ with torch's, numpy's and
    Python's global generators seeded alike on every rank (and restored after), so that an augmentation
    drawing from them reads the same on every rank. A custom Dataset that builds its data with an unseeded
    torch.rand differs here (the DDP tutorial's). Tensors, arrays, numbers and strings count; other objects
    count by their type."""
    import random

    parts: list[bytes] = []

    def add(item) -> None:
        if isinstance(item, torch.Tensor):
            parts.append(repr((tuple(item.shape), str(item.dtype))).encode())
            parts.append(_raw_bytes(item.detach().cpu()))
        elif isinstance(item, np.ndarray) or hasattr(item, "__array_interface__"):
            a = np.asarray(item)
            parts.append(repr((a.shape, str(a.dtype))).encode())
            parts.append(np.ascontiguousarray(a).tobytes() if a.dtype != object else b"object array")
        elif isinstance(item, (bool, int, float, complex, str, bytes, np.generic)) or item is None:
            parts.append(repr(item).encode())
        elif isinstance(item, dict):
            for key in sorted(item, key=repr):
                parts.append(repr(key).encode())
                add(item[key])
        elif isinstance(item, (list, tuple)):
            parts.append(f"{type(item).__name__}[{len(item)}]".encode())
            for x in item:
                add(x)
        else:
            parts.append(type(item).__qualname__.encode())

    kept = random.getstate(), np.random.get_state()
    before = _horovod.enter(READING_ITEMS)  # a read that hangs on one rank is named where it hangs
    try:
        with torch.random.fork_rng(devices=[]):
            for i in sample_positions(n):
                torch.manual_seed(i)
                np.random.seed(i)
                random.seed(i)
                add(dataset[i])
    finally:
        _horovod.leave(before)
        random.setstate(kept[0])
        np.random.set_state(kept[1])
    return fingerprint_of(parts)
