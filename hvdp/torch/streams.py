"""shard() of a stream (a torch IterableDataset): every rank reads the whole stream and keeps its part, and
the ranks agree every few batches on how far they read, so a stream that ends early is an error on every rank."""

from __future__ import annotations

import itertools

import torch
import torch.utils.data

from hvdp import _horovod
from hvdp.core.errors import ConfigError, DataError
from hvdp.core.sharding import StreamSplit, exact_weight, real_count
from hvdp.torch.runtime import hvd
from hvdp.torch.weights import _Batch, _handing_out
from hvdp.torch.workers import LOADING, STARTING_WORKERS, _configure

# A stream's ranks agree on how far they have read once per this many batches (one small allgather).
_STREAM_WINDOW = 8


def _stream(dataset, split: StreamSplit, transform, seed: int, loader_kwargs: dict) -> torch.utils.data.DataLoader:
    for name in ("batch_size", "shuffle", "sampler", "batch_sampler"):
        if name in loader_kwargs:
            raise ConfigError(f"shard() of a stream sets the DataLoader's {name} itself; leave it out")
    if loader_kwargs.get("persistent_workers"):
        raise ConfigError("shard() of a stream refuses persistent_workers=True: the workers would keep the first "
                          "epoch's position (each epoch starts the stream's workers again); leave it out")
    # Workers started by forkserver every epoch: a kept worker would keep the position and set_epoch of the
    # epoch it started in (each iteration hands the workers a new start step).
    _configure(loader_kwargs, {"dataset": dataset, "transform": transform}, persistent=False)
    collate = loader_kwargs.pop("collate_fn", None) or torch.utils.data.default_collate
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed + split.rank))
    return _StreamLoader(_RankStream(dataset, split, transform, collate), **loader_kwargs)


def _as_is(item):
    return item


class _RankStream(torch.utils.data.IterableDataset):
    """What each loader worker iterates: this rank's batches of the stream (StreamSplit.batches), its
    elements transformed and collated, each with (step, count)."""

    def __init__(self, dataset, split: StreamSplit, transform, collate):
        self.dataset, self.split, self.transform, self.collate = dataset, split, transform, collate
        self.start_step = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for step, elements, count in self.split.batches(self.dataset, start_step=self.start_step, worker=worker,
                                                        workers=workers):
            if self.transform is not None:
                elements = [self.transform(e) for e in elements]
            yield self.collate(elements), (step, count)


class _StreamSteps:
    """The global sample counts of a stream iteration's batches, for prepare()'s gradient hooks (_Batch)."""

    def __init__(self, split: StreamSplit):
        self.split, self.counts = split, []

    def gradient_weight(self, index: int, passes: int = 1) -> float:
        first = index // passes * passes
        samples = sum(self.counts[first:first + passes])
        return exact_weight(real_count(self.counts[index], self.split.batch_size, self.split.size, self.split.rank),
                            samples, self.split.size, passes)


class _StreamLoader(torch.utils.data.DataLoader):
    """shard()'s DataLoader of a stream: its workers yield this rank's batches (_RankStream); here they are
    read ahead a window at a time, the ranks agree on each window's sample counts (so a rank whose stream
    ended early raises on every rank instead of leaving the others in an all-reduce), and each batch is
    handed out with its gradient weight known."""

    def __init__(self, stream: _RankStream, **kwargs):
        super().__init__(stream, batch_size=None, collate_fn=_as_is, **kwargs)
        self.epoch, self.start_step = 0, 0
        self._last_steps = None  # batches the previous iteration had (a one-shot stream has none after it)

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (load_checkpoint calls it)."""
        self.epoch, self.start_step = int(epoch), int(step)

    def __len__(self) -> int:
        try:
            n = len(self.dataset.dataset)
        except TypeError:
            raise TypeError(f"this stream ({type(self.dataset.dataset).__name__}) has no len(), so neither has "
                            f"its loader: count the batches as they come") from None
        split = self.dataset.split
        left = max(0, n - self.start_step * split.global_batch)
        full, rest = divmod(left, split.global_batch)
        return full + (1 if rest and not split.drop_last else 0)

    def __iter__(self):
        epoch, start = self.epoch, self.start_step
        self.epoch, self.start_step = epoch + 1, 0
        if hasattr(self.dataset.dataset, "set_epoch"):
            self.dataset.dataset.set_epoch(epoch)
        self.dataset.start_step = start  # the workers take a copy of it as the iteration starts them
        steps = _StreamSteps(self.dataset.split)
        before = _horovod.enter(STARTING_WORKERS) if self.num_workers else None
        try:
            source = super().__iter__()
        finally:
            _horovod.leave(before)
        yield from _handing_out(steps, self._batches(steps, _horovod.watched(source, LOADING), epoch, start))

    def _batches(self, steps: _StreamSteps, source, epoch: int, start: int):
        window = max(_STREAM_WINDOW, *_Batch.passes)
        ready, ended, index = [], False, 0
        while True:
            # read ahead until the step group of the next batch is known (its gradient weights need it)
            group_end = _Batch.read_until(index)
            while not ended and len(steps.counts) < group_end:
                read = list(itertools.islice(source, window))
                ended = len(read) < window
                self._agree(read, ended, window, epoch, start, len(steps.counts))
                ready += [batch for batch, _ in read]
                steps.counts += [count for _, (_, count) in read]
            if index == len(steps.counts):
                self._last_steps = index
                return
            yield index, ready[0]
            ready.pop(0)
            index += 1

    def _agree(self, read: list, ended: bool, window: int, epoch: int, start: int, before: int) -> None:
        """Compare this window's reads across the ranks; raise the same error on every rank if they differ."""
        split = self.dataset.split
        counts = [count for _, (_, count) in read]
        row = torch.tensor([[len(read), int(ended)] + counts + [-1] * (window - len(read))], dtype=torch.int64)
        rows = hvd.allgather(row, name="hvdp.stream").tolist() if split.size > 1 else row.tolist()
        at = f"epoch {epoch}, step {start + before}"
        if any(r != rows[0] for r in rows):
            lengths = {rank: r[0] for rank, r in enumerate(rows)}
            short = min(lengths.values())
            if len(set(lengths.values())) > 1:
                early = sorted(rank for rank, n in lengths.items() if n == short)
                what = (f"the stream of rank(s) {early} ended after {start + before + short} steps of epoch {epoch}, "
                        f"while other ranks read on")
            else:
                odd = sorted(rank for rank, r in enumerate(rows) if r != rows[0])
                what = f"rank(s) {odd} read other sample counts than rank 0 near {at}"
            raise DataError(f"{what}: every rank reads the whole stream and keeps its part, so every rank's dataset "
                            f"must yield the same elements in the same order (the same files, the same seeded "
                            f"shuffle; not split by rank or by DataLoader worker itself)", rank=split.rank)
        if before == 0 and not read:
            if start:
                why = (f"nothing is left at the resume position ({at}): the stream ended before that step, or it "
                       f"does not start over when iterated again")
            elif self._last_steps:
                why = (f"the stream yielded nothing in epoch {epoch} after {self._last_steps} steps in the epoch "
                       f"before: it does not start over when iterated again (a generator or a cursor can be read "
                       f"once); give shard() a dataset whose __iter__ reads the stream from its start")
            else:
                why = f"the stream yielded no samples in epoch {epoch}"
            raise DataError(why, rank=split.rank)
        if before == 0 and start == 0 and counts[0] < split.size:
            raise ConfigError(f"the stream has {counts[0]} samples but the job has {split.size} ranks: every rank "
                              f"needs at least one sample; use more data or fewer ranks", rank=split.rank)
