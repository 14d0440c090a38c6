"""Which of shard()'s batches is being trained on, and its gradient weight: the link between the loaders
(data.py, streams.py) and prepare()'s gradient hooks (optimizer.py), so that an epoch's uneven last step is exact."""

from __future__ import annotations

from typing import Any, Callable

import torch


class _Batch:
    """The batch of shard()'s loader being trained on, for prepare()'s gradient hooks.

    Ranks average their mean gradients with equal weights, which is one process's step on the union batch
    only when every batch is full. At an epoch's end (a partial last global batch, split unevenly or topped
    up; a last step with fewer than k accumulated batches) each batch's gradient is multiplied by
    ShardPlan.gradient_weight(), so that the step is exactly the one process's mean over its samples.
    The loader sets `sampler` and `index` as it hands out each batch; the hooks ask for the factor.
    """

    sampler = None  # the ShardSampler (or a stream's _StreamSteps) of the batch handed out last, or None
    index = 0       # that batch's index in the sampler's iteration
    passes = {1}    # every backward_passes_per_step prepared in this process (the same on every rank)
    current = 1     # the backward_passes_per_step of the last prepare()
    _cached: tuple = (None, -1, 0, 1.0)

    @classmethod
    def accumulating(cls, passes: int) -> None:
        """Record that prepare() set up hooks weighting steps of `passes` batches (a stream reads ahead for them)."""
        cls.passes = cls.passes | {passes}
        cls.current = passes

    @classmethod
    def read_until(cls, index: int) -> int:
        """How many batches a stream's loader must have read before handing out batch `index`: up to the end of
        its step for every k prepared, since each hook weights it by the sample counts of its own k-batch step.
        A function of the prepare() calls alone, so every rank reads (and agrees on its reads) alike."""
        return max((index // k + 1) * k for k in cls.passes)

    @classmethod
    def is_top_up(cls) -> bool:
        """Whether the batch being trained on only tops up an epoch's last global batch (it has fewer samples
        than ranks): a repeated sample whose gradient weighs 0 and that SyncBatchNorm must not count."""
        return cls.sampler is not None and cls.sampler.gradient_weight(cls.index, 1) == 0.0

    @classmethod
    def factor(cls, passes: int) -> float:
        if cls.sampler is None:
            return 1.0
        key = (cls.sampler, cls.index, passes)
        if cls._cached[:3] != key:  # once per batch, not once per parameter
            cls._cached = (*key, cls.sampler.gradient_weight(cls.index, passes))
        return cls._cached[3]


def _gradient_hook(passes: int, schedule: Any = None, usage: Any = None) -> Callable:
    """The hook prepare() puts on each trainable parameter: it divides the gradient by the k accumulated passes
    and weights an epoch's uneven last step (_Batch), marks the step as having gradients (schedule.fresh), and
    tells the allreduce path's usage tracking (usage.gradient_arrived, hvdp.torch.usage) that a backward pass
    runs."""
    def hook(grad):
        if schedule is not None:
            schedule.fresh = True  # a backward pass of the coming optimizer step (see optimizer._counted)
        if usage is not None:
            usage.gradient_arrived()
        weight = _Batch.factor(passes)
        if weight == 1.0:
            return grad / passes if passes > 1 else None  # None: the gradient as it is
        return grad * (weight / passes)
    return hook


def _handing_out(sampler, batches):
    """Yield each (index, batch)'s batch, telling prepare()'s gradient hooks which one it is (_Batch)."""
    try:
        for index, batch in batches:
            _Batch.sampler, _Batch.index = sampler, index
            yield batch
    finally:
        if _Batch.sampler is sampler:
            _Batch.sampler = None


def at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Queue `callback` to run when the running backward pass ends (autograd's engine calls it once every
    gradient of the pass is accumulated); False when no pass is running (a hook called by hand)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True
