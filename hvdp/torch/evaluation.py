"""evaluate(): a classifier's loss and accuracy over a dataset, every sample counted exactly once."""

from __future__ import annotations

import torch
import torch.utils.data

from hvdp.core.sharding import eval_bounds, eval_metrics
from hvdp.torch.runtime import _module_device, hvd, world


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: torch.utils.data.Dataset, *, batch_size: int = 256,
             loss_fn=torch.nn.functional.cross_entropy) -> dict[str, float]:
    """Loss and accuracy of a classifier over `dataset`, counting every sample exactly once on any world size.

    Each rank scores a contiguous, unpadded slice; the sums are all-reduced. Every rank must call it, with
    the same dataset. Runs under torch.no_grad() with the model in eval mode, then restores its mode; the
    batches go to the model's device (its first parameter's: the rank's GPU when it is there).

    Args:
        model: a classifier: model(x) returns logits of shape (N, classes); accuracy uses argmax(1).
        dataset: a map-style dataset of (x, y) pairs, the same on every rank.
        batch_size: samples per forward pass on each rank (default 256).
        loss_fn: called as loss_fn(logits, y, reduction="sum") (default torch's cross_entropy).

    Returns:
        {"loss": mean loss, "accuracy": fraction correct, "samples": len(dataset)}, the same on every rank.

    Raises:
        ConfigError: `dataset` is empty (on every rank).
    """
    w = world()
    start, stop = eval_bounds(len(dataset), w.rank, w.size)
    subset = torch.utils.data.Subset(dataset, range(start, stop))
    was_training = model.training
    model.eval()
    where = _module_device(model)  # the batches go where the model is (the rank's GPU)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y in torch.utils.data.DataLoader(subset, batch_size=batch_size, pin_memory=where.type == "cuda"):
        x, y = x.to(where, non_blocking=True), y.to(where, non_blocking=True)
        out = model(x)
        sums += torch.tensor([float(loss_fn(out, y, reduction="sum")),
                              float((out.argmax(1) == y).sum()), len(y)], dtype=torch.float64)
    model.train(was_training)
    total = hvd.allreduce(sums, op=hvd.Sum, name="hvdp.evaluate").tolist()
    return eval_metrics(*total, rank=w.rank)
