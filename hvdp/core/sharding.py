"""Which samples each rank sees, as pure functions of (dataset size, seed, epoch, rank, size).

The epoch order is a permutation that depends only on (seed, epoch): not on the world size, not on any
global RNG. Step j of the epoch consumes the global batch order[j*N*b : (j+1)*N*b], and rank r takes the
r-th contiguous slice of it. So at every step a size-1 run with batch N*b sees exactly the union of what N
ranks see with batch b, and ranks never see the same sample within an epoch. Training so far in an epoch is
therefore one number, the offset into its order: an elastic job that changes size mid-epoch splits the
rest, order[offset:], among the ranks it has now, and no sample is skipped or seen twice.

Evaluation shards are contiguous, unshuffled and unpadded, so summed metrics count every sample once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvdp.core.errors import ConfigError


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global order of the n sample indices for `epoch`: a function of (seed, epoch) alone.

    Args:
        n: the number of samples.
        seed: the run's seed; together with `epoch` it seeds a private generator (never the global RNG).
        epoch: the epoch, 0-based.
        shuffle: False gives 0..n-1 in order, every epoch (default True: a permutation).

    Returns:
        An int64 array holding each index 0..n-1 once. The same on every rank and every world size.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def _split(count: int, parts: int, part: int) -> tuple[int, int]:
    """Bounds of `part` when `count` items are split into `parts` contiguous pieces differing by <= 1."""
    base, extra = divmod(count, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def rank_bounds(count: int, batch_size: int, size: int, rank: int) -> tuple[int, int]:
    """`rank`'s [start, stop) of a global batch of `count` elements (count >= size).

    A full global batch (batch_size * size) gives each rank its contiguous batch_size; the last, partial one
    is split as evenly as possible. A batch of fewer elements than ranks is topped up first (to `size`
    elements, from the start of the epoch) by the caller, so that no rank gets an empty batch.
    """
    if count == batch_size * size:
        return rank * batch_size, (rank + 1) * batch_size
    return _split(count, size, rank)


def real_count(count: int, batch_size: int, size: int, rank: int) -> int:
    """How many of `rank`'s samples in a global batch of `count` of the epoch's own elements are real.

    batch_size in a full global batch (batch_size * size); its share of a partial one; with fewer elements
    than ranks, 1 for the first `count` ranks and 0 for the ones whose batch only tops it up (see rank_bounds()).
    """
    if count < size:
        return 1 if rank < count else 0
    start, stop = rank_bounds(count, batch_size, size, rank)
    return stop - start


def exact_weight(real: int, step_samples: int, size: int, passes: int) -> float:
    """The factor for a batch's mean gradient that makes the ranks' average one process's step.

    The ranks' average weights each of a step's size * passes batch means alike; one process weights each
    sample alike. Multiplying a batch of `real` real samples by size * passes * real / step_samples (the
    step's real samples over all ranks and passes) makes the two agree. Exactly 1.0 for full steps.
    """
    mine = size * passes * real
    return 1.0 if mine == step_samples else mine / step_samples


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """The training batches of one rank. `batch_size` is per rank; all ranks get the same number of steps.

    Attributes (also the constructor's arguments):
        n: the number of training samples; at least `size`.
        batch_size: samples per rank per step, >= 1 and at most n // size.
        rank: this rank, 0 <= rank < size (default 0).
        size: the number of ranks (default 1).
        seed: the seed of the epoch order (default 0).
        shuffle: shuffle the order every epoch (default True); False keeps 0..n-1.
        drop_last: drop the last, partial global batch of an epoch (default False: split it as evenly as
            possible among the ranks, topped up from the start of the epoch if it has fewer samples
            than ranks, so no rank gets an empty batch).

    Raises:
        ConfigError: batch_size < 1, rank outside [0, size), fewer samples than ranks, or batch_size larger
            than each rank's share of the data (the message says which batch size fits).
    """

    n: int
    batch_size: int
    rank: int = 0
    size: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside a world of size {self.size}")
        if self.n < self.size:
            raise ConfigError(
                f"the dataset has {self.n} samples but the job has {self.size} ranks: every rank needs "
                f"at least one sample; use more data or fewer ranks", rank=self.rank)
        if self.batch_size > self.n // self.size:
            raise ConfigError(
                f"batch_size ({self.batch_size}) is larger than each rank's shard of the data "
                f"({self.n} samples / {self.size} ranks = {self.n // self.size}); use --batch-size "
                f"{max(1, self.n // self.size)} or less", rank=self.rank)

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks: batch_size * size."""
        return self.batch_size * self.size

    @property
    def steps_per_epoch(self) -> int:
        """Steps in a whole epoch (the same on every rank): ceil(n / global_batch), or floor with drop_last."""
        return self.steps_for(self.n)

    def steps_for(self, count: int) -> int:
        """How many steps `count` samples of the epoch order take, global batch by global batch.

        A partial last global batch counts as a step unless drop_last is set.
        """
        full, rest = divmod(count, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def consumed(self, offset: int, steps: int) -> int:
        """How far into the epoch order training is after `steps` steps taken from `offset`.

        Args:
            offset: samples of the epoch order already trained on when those steps began.
            steps: steps taken since; each consumes one global batch.

        Returns:
            The new offset, at most n.
        """
        return min(self.n, offset + steps * self.global_batch)

    def batch(self, epoch: int, step: int, order: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        """The sample indices this rank uses at `step` of `epoch`, counting steps from `offset`.

        Args:
            epoch: the epoch, 0-based; with `seed` it fixes the order.
            step: the step, counted from `offset`: 0 <= step < steps_for(n - offset).
            order: epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle), when the caller already has it
                (default None: computed here).
            offset: how many samples of the epoch order were already trained on, by a world of any size:
                after an elastic resize, the rest of the epoch is split among the ranks there are now.

        Returns:
            The int64 sample indices, batch_size of them except in a partial last global batch.

        Raises:
            IndexError: `offset` is outside [0, n] or `step` outside the steps left in the epoch.
        """
        if order is None:
            order = epoch_order(self.n, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        if not 0 <= offset <= self.n:
            raise IndexError(f"offset {offset} outside an epoch of {self.n} samples")
        rest = order[offset:]
        if not 0 <= step < self.steps_for(len(rest)):
            raise IndexError(f"step {step} outside the {self.steps_for(len(rest))} steps left in the epoch")
        lo = step * self.global_batch
        chunk = rest[lo:lo + self.global_batch]
        if len(chunk) < self.size:
            chunk = np.concatenate([chunk, order[:self.size - len(chunk)]])
        start, stop = rank_bounds(len(chunk), self.batch_size, self.size, self.rank)
        return chunk[start:stop]

    def real_samples(self, step: int, offset: int = 0) -> int:
        """How many of this rank's samples at `step` (counted from `offset`) are the epoch's own.

        batch_size at a full global batch; this rank's share of a partial last one; 0 for a rank whose
        batch only tops the last one up (it has fewer samples than ranks; see batch()).
        """
        left = self.n - offset
        return real_count(min(self.global_batch, left - step * self.global_batch), self.batch_size, self.size,
                          self.rank)

    def gradient_weight(self, step: int, offset: int = 0, passes: int = 1) -> float:
        """The factor for this rank's mean gradient at `step` that makes the ranks' average exact.

        An optimizer step averages, over the ranks and its `passes` accumulated batches, each batch's mean
        gradient with the same weight. One process taking that step on the same samples weights every
        sample alike. The two agree when every batch has batch_size samples; they differ at an epoch's
        end: the last global batch is partial and split unevenly (or topped up with repeated samples),
        and the last step may accumulate fewer than `passes` batches. Multiplying each batch's mean
        gradient by size * passes * (its real samples) / (the step's real samples) makes the average the
        mean over the step's samples, as one process computes it. Steps are grouped `passes` batches at a
        time from `offset` (the loop steps after every `passes` batches and after the last).

        Args:
            step: the batch, counted from `offset`, as in batch().
            offset: samples of the epoch order trained on before the iteration began (default 0).
            passes: backward passes per optimizer step (default 1).

        Returns:
            Exactly 1.0 for every batch of a step of full batches; else the factor (0.0 for a top-up batch).
        """
        left = self.n - offset
        first = step // passes * passes
        last = min(first + passes, self.steps_for(left))
        samples = min(left, last * self.global_batch) - first * self.global_batch
        return exact_weight(self.real_samples(step, offset), samples, self.size, passes)

    def batches(self, epoch: int, start_step: int = 0, offset: int = 0):
        """Yield this rank's batches of `epoch` from `offset` samples in, skipping `start_step` steps.

        Args:
            epoch: the epoch, 0-based.
            start_step: the first step to yield, counted from `offset` (default 0).
            offset: samples of the epoch order already trained on (default 0: the epoch's start).

        Yields:
            The sample indices of each step, as batch() returns them.
        """
        order = epoch_order(self.n, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        for step in range(start_step, self.steps_for(self.n - offset)):
            yield self.batch(epoch, step, order, offset)


@dataclass(frozen=True, slots=True)
class StreamSplit:
    """The training batches of one rank from a stream: an iterable of unknown length, read in its own order.

    The stream's order for the epoch plays the part of ShardPlan's epoch order: step j is the global batch
    of elements [j*N*b, (j+1)*N*b), rank r takes the r-th b of them, and a partial last global batch is split
    as ShardPlan splits it (evenly; topped up from the epoch's first elements if it has fewer than N). So N
    ranks with batch b see at every step what one process reading the same stream with batch N*b sees. Every
    rank (and every loader worker) reads the whole stream and keeps its part: skipping an element costs only
    what the stream itself costs to yield it, so expensive work (decoding, augmentation) belongs after the
    split (hvdp.torch.shard's `transform`).

    Attributes (also the constructor's arguments):
        batch_size: elements per rank per step, >= 1.
        rank: this rank, 0 <= rank < size (default 0).
        size: the number of ranks (default 1).
        drop_last: drop the epoch's last, partial global batch (default False).

    Raises:
        ConfigError: batch_size < 1, or rank outside [0, size).
    """

    batch_size: int
    rank: int = 0
    size: int = 1
    drop_last: bool = False

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside a world of size {self.size}")

    @property
    def global_batch(self) -> int:
        """Elements per step over all ranks: batch_size * size."""
        return self.batch_size * self.size

    def batches(self, stream, *, start_step: int = 0, worker: int = 0, workers: int = 1):
        """Yield (step, elements, count) for this rank's batches of one pass over `stream`.

        Args:
            stream: an iterable, read once from its start.
            start_step: the first step to yield (resuming mid-epoch): the elements of the steps before it
                are read and dropped (default 0).
            worker, workers: this loader worker and their number (default 0 of 1): worker w yields the
                steps start_step + w, start_step + w + workers, ... so that taking the workers' outputs in
                turn gives every step in order.

        Yields:
            step: the step, counted from the epoch's start.
            elements: this rank's elements of that step, as the stream yielded them (a list; with fewer
                elements in the step than ranks, a rank's may be a repeated first element of the epoch).
            count: how many of the epoch's elements the step has (global_batch but in the last one): with
                real_count() and exact_weight() it gives the gradient weights.
        """
        g, head, chunk, step, position = self.global_batch, [], [], start_step, -1
        mine = (lambda j: (j - start_step) % workers == worker) if workers > 1 else (lambda j: True)
        skip = start_step * g
        for position, element in enumerate(stream):
            if len(head) < self.size:  # the epoch's first elements, for topping up a tiny last batch
                head.append(element)
            if position < skip:
                continue
            if mine(step):
                chunk.append(element)
            if (position + 1) % g == 0:
                if mine(step):
                    yield step, chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size], g
                chunk, step = [], step + 1
        count = (position + 1 - skip) % g if position >= skip else 0
        if count and not self.drop_last and mine(step):
            # `chunk` is the whole partial global batch: split as ShardPlan splits one (a stream of fewer
            # elements than ranks leaves some ranks empty-handed: the loader refuses it on every rank)
            chunk = chunk + head[:max(0, self.size - count)]
            start, stop = rank_bounds(len(chunk), self.batch_size, self.size, self.rank)
            yield step, chunk[start:stop], count


def eval_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous [start, stop) slice of an n-sample evaluation set that `rank` scores.

    Slices differ in length by at most one, cover all n samples and never overlap, so metric sums
    (correct, loss*count, count) all-reduced with op=sum count every sample exactly once. A rank may get
    an empty slice when n < size; the sums stay exact.

    Args:
        n: the number of evaluation samples.
        rank: the rank, 0 <= rank < size.
        size: the number of ranks.

    Raises:
        ConfigError: `rank` is outside [0, size).
    """
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is outside a world of size {size}")
    return _split(n, size, rank)


def eval_batches(n: int, batch_size: int, rank: int, size: int) -> list[list[int]]:
    """`rank`'s evaluation batches (sample indices) when a loop steps through the data together (hvdp.lightning).

    Each global batch of size * batch_size consecutive samples is split as a training batch is (rank_bounds: the
    last one as evenly as possible), never padded: every sample is scored exactly once, and every rank takes the
    same number of batches, except that a last global batch of fewer samples than ranks gives one sample to
    each of its first ranks and none to the others.

    Args:
        n: the number of evaluation samples.
        batch_size: samples per rank per batch, >= 1.
        rank: the rank, 0 <= rank < size.
        size: the number of ranks.

    Raises:
        ConfigError: batch_size < 1, or `rank` outside [0, size).
    """
    if batch_size < 1:
        raise ConfigError(f"an evaluation batch_size must be >= 1, got {batch_size}", rank=rank)
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is outside a world of size {size}")
    batches = []
    for start in range(0, n, size * batch_size):
        count = min(size * batch_size, n - start)
        if count < size:
            if rank < count:
                batches.append([start + rank])
            continue
        lo, hi = rank_bounds(count, batch_size, size, rank)
        batches.append(list(range(start + lo, start + hi)))
    return batches


def eval_means(sums: dict[str, float], count: float, rank: int) -> dict[str, float]:
    """What evaluate() returns from the summed metrics of every rank's slice (`eval_bounds`): each sum divided
    by the number of samples scored, and that number as "samples".

    Args:
        sums: each metric's sum over the samples of all ranks ("loss" and, for a classifier, "accuracy": the
            number correct), in the same order on every rank.
        count: the number of samples scored over all ranks.
        rank: this rank, named in the error.

    Returns:
        {name: sum / count for each metric, "samples": count}, the same on every rank.

    Raises:
        ConfigError: nothing was scored (an empty evaluation set): on every rank, since the sums are the same.
    """
    if count == 0:
        raise ConfigError("evaluate() was given an empty dataset: nothing to score; pass at least one sample",
                          rank=rank)
    return {**{name: float(total / count) for name, total in sums.items()}, "samples": int(count)}


def keepers(hosts: list[str]) -> list[int]:
    """keepers(hosts)[r]: the rank that keeps a copy of rank r's slice of the sharded optimizer state at an
    elastic commit, for ranks on `hosts` (one host name per rank, the same list on every rank).

    The ranks are listed host by host (hosts in order of their first rank, each host's ranks in rank order)
    and each rank's keeper is the one m places further round that list, m being the largest host's rank
    count: a permutation, so every rank keeps exactly one slice besides its own (2/N of the state), and when
    no host holds more than half the ranks, every keeper is on another host (a host's ranks are m or fewer
    consecutive places, and the list is at least 2m long): any single host lost, every slice it held is kept
    elsewhere. With 2 hosts x 8 ranks, a rank's keeper is the same local rank on the other host. With every
    rank on one host, the keeper is the next rank. A host with more than half the ranks cannot have all its
    slices kept elsewhere at 2/N: its ranks past the others' count keep each other's.
    """
    size = len(hosts)
    if size < 2:
        return list(range(size))
    order = sorted(range(size), key=lambda r: (hosts.index(hosts[r]), r))
    largest = max(hosts.count(h) for h in set(hosts))
    shift = largest if largest < size else 1
    out = [0] * size
    for place, r in enumerate(order):
        out[r] = order[(place + shift) % size]
    return out


__all__ = ["keepers", "epoch_order", "rank_bounds", "real_count", "exact_weight", "ShardPlan", "StreamSplit", "eval_bounds", "eval_batches",
           "eval_means"]
