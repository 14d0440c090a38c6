"""evaluate(): a model's mean loss and metrics (a classifier's accuracy by default) over a dataset, every
sample counted exactly once."""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.data

from hvdp import _horovod
from hvdp._horovod import gather_or_raise
from hvdp.core.consistency import settings_mismatch
from hvdp.core.errors import ConfigError
from hvdp.core.sharding import eval_bounds, eval_means
from hvdp.torch.data import _data_identity
from hvdp.torch.runtime import _module_device, hvd, world


def _binary(out: torch.Tensor) -> bool:
    """Whether `out` is a binary classifier's logits: one per sample, (N,) or (N, 1)."""
    return out.dim() == 1 or (out.dim() == 2 and out.shape[1] == 1)


def _classifier_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """A classifier's loss: the cross-entropy of its logits (N, classes) and labels (N,); for a binary
    classifier's one logit per sample, the binary cross-entropy with 0/1 labels (cross-entropy over one class
    is 0 whatever the model says)."""
    if _binary(out):
        return torch.nn.functional.binary_cross_entropy_with_logits(
            out.reshape(-1), y.reshape(-1).to(out.dtype), reduction=reduction)
    return torch.nn.functional.cross_entropy(out, y, reduction=reduction)


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A classifier's correct predictions in a batch: argmax over the logits (dim 1) equal to the label; for
    one logit per sample, logit > 0 equal to the 0/1 label."""
    if _binary(out):
        return ((out.reshape(-1) > 0) == y.reshape(-1).bool()).sum()
    return (out.argmax(1) == y).sum()


_CLASSIFIER = {"accuracy": _correct}


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: torch.utils.data.Dataset, *, batch_size: int = 256,
             loss_fn=_classifier_loss, metrics: dict[str, Callable] | None = None,
             check_items: bool = True) -> dict[str, float]:
    """Mean loss (and, for a classifier, accuracy) over `dataset`, counting every sample exactly once on any world size.

    By default it scores a classifier: loss_fn is the cross-entropy of the logits and "accuracy" the fraction
    whose argmax(1) is the label; a binary classifier's one logit per sample ((N,) or (N, 1), labels 0/1) is
    scored with the binary cross-entropy and logit > 0. For any other model pass its loss_fn and your own `metrics` (or none):
    `evaluate(model, data, loss_fn=F.mse_loss, metrics={})`, or
    `metrics={"mae": lambda out, y: (out - y).abs().sum()}`. Each rank scores a contiguous, unpadded slice;
    the sums are gathered and added. Every rank must call it, with the same dataset. Runs under
    torch.no_grad() with the model in eval mode, then restores its mode; the batches go to the model's device
    (its first parameter's: the rank's GPU when it is there).

    Args:
        model: model(x) gives the output that loss_fn and the metrics take (a classifier: logits (N, classes),
            or (N,)/(N, 1) for a binary one).
        dataset: a map-style dataset of (x, y) pairs, the same on every rank.
        batch_size: samples per forward pass on each rank (default 256).
        loss_fn: called as loss_fn(out, y, reduction="sum"): the batch's summed loss (default: torch's
            cross_entropy, binary_cross_entropy_with_logits for one logit per sample).
        metrics: name -> fn(out, y) giving the batch's sum of that metric (a number or a one-element tensor);
            each is reported as its mean per sample. Default None: {"accuracy": correct argmax predictions}.
        check_items: as shard()'s: compare a few items of a dataset hvdp cannot otherwise fingerprint.

    Returns:
        {"loss": mean loss, each metric's mean, "samples": len(dataset)}, the same on every rank.

    Raises:
        ConfigError: `dataset` is empty, or the ranks passed different data (its length or content, compared
            as shard() compares them, in the same all-gather as the sums; on every rank, naming the rank).
        RankError: the model or the data raised on some rank (on every rank, naming it and the exception;
            the failed rank's own hvdp error class instead when it raised one).
    """
    w = world()
    metrics = _CLASSIFIER if metrics is None else dict(metrics)
    start, stop = eval_bounds(len(dataset), w.rank, w.size)
    subset = torch.utils.data.Subset(dataset, range(start, stop))
    was_training = model.training
    where = _module_device(model)  # the batches go where the model is (the rank's GPU)

    def score() -> tuple[dict, list[float]]:
        identity = _data_identity(dataset, check_items)  # compared across the ranks with the sums
        model.eval()
        try:
            sums = torch.zeros(len(metrics) + 2, dtype=torch.float64)  # count, loss sum, each metric's sum
            for x, y in torch.utils.data.DataLoader(subset, batch_size=batch_size, pin_memory=where.type == "cuda"):
                x, y = x.to(where, non_blocking=True), y.to(where, non_blocking=True)
                out = model(x)
                sums += torch.tensor([len(y), float(loss_fn(out, y, reduction="sum")),
                                      *(float(fn(out, y)) for fn in metrics.values())], dtype=torch.float64)
            return identity, sums.tolist()
        finally:
            model.train(was_training)

    # Each rank's sums gathered (an error on one rank, a bad sample or out of memory, raised on all), then
    # added in rank order: the same total on every rank.
    before = _horovod.enter("evaluating (hvdp.torch.evaluate)")  # where this rank is, for the watchdog
    try:
        gathered = gather_or_raise(hvd, score, name="hvdp.evaluate", operation="hvdp.torch.evaluate")
    finally:
        _horovod.leave(before)
    problem = settings_mismatch([identity for identity, _ in gathered], call="evaluate()")
    if problem:
        raise ConfigError(problem, rank=w.rank)
    count, loss, *totals = (sum(column) for column in zip(*(sums for _, sums in gathered)))
    return eval_means({"loss": loss, **dict(zip(metrics, totals))}, count, rank=w.rank)
