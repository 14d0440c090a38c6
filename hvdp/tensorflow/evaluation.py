"""hvdp.tensorflow's evaluation: evaluate(), a model's mean loss and metrics (a classifier's accuracy by
default), every test sample counted exactly once on any world size."""

from __future__ import annotations

import keras
import numpy as np

from hvdp import _keras_backend
from hvdp._horovod import gather_or_raise
from hvdp.core.sharding import eval_bounds, eval_means
from hvdp.tensorflow.data import _agree_on_arrays
from hvdp.tensorflow.runtime import _ensure_init, hvd


def _binary(out) -> bool:
    """Whether `out` is a binary classifier's output: one value per sample, (N,) or (N, 1)."""
    return len(out.shape) == 1 or (len(out.shape) == 2 and out.shape[1] == 1)


def _correct(y, out, from_logits: bool = True) -> np.ndarray:
    """A classifier's per-sample correctness: argmax over the last axis equal to the integer label; for one
    output per sample, the output above the threshold (0 for a logit, 0.5 for a probability) equal to 0/1."""
    out = keras.ops.convert_to_numpy(out)
    if _binary(out):
        return (out.reshape(-1) > (0.0 if from_logits else 0.5)) == np.asarray(y).reshape(-1).astype(bool)
    return np.argmax(out, axis=-1) == y


def _classifier_loss(y, out, from_logits: bool = True):
    """Each sample's loss: the sparse categorical cross-entropy, or for one output per sample the binary
    cross-entropy with 0/1 labels (the categorical one over a single class is 0 whatever the model says)."""
    if _binary(out):
        return keras.losses.binary_crossentropy(keras.ops.reshape(keras.ops.cast(y, "float32"), (-1, 1)),
                                                keras.ops.reshape(out, (-1, 1)), from_logits=from_logits)
    return keras.losses.sparse_categorical_crossentropy(y, out, from_logits=from_logits)


def evaluate(model, data, *, batch_size: int = 256, from_logits: bool = True, loss=None,
             metrics: dict | None = None) -> dict[str, float]:
    """Mean loss (and, for a classifier, accuracy) over `data` = (x, y), counting every sample exactly once on
    any world size: each rank scores a contiguous, unpadded slice, the sums are gathered and added.

    By default it scores a classifier: the sparse categorical cross-entropy and "accuracy" (the argmax is
    the label); a binary classifier's one output per sample ((N,) or (N, 1), labels 0/1) with the binary
    cross-entropy and the output above 0 (a logit) or 0.5 (a probability). For any other model pass its per-sample `loss` and your own `metrics` (or none):
    `evaluate(model, (x, y), loss=keras.losses.mean_squared_error, metrics={})`. Every rank must call it.

    Args:
        model: model(x, training=False) gives the output `loss` and the metrics take (a classifier: (N, classes)
            logits or probabilities).
        data: (x, y) arrays, the same on every rank in the same order: compared across the ranks as shard()
            compares its data (the number of samples, the rows at fixed positions).
        batch_size: samples per forward pass on each rank (default 256).
        from_logits: the default loss's input: the model outputs logits (default True) or probabilities.
        loss: loss(y, out) giving each sample's loss (a Keras loss function); default None: the sparse
            categorical cross-entropy (with `from_logits`).
        metrics: name -> fn(y, out) giving each sample's value of that metric; each is reported as its mean.
            Default None: {"accuracy": 1 where argmax(out) == y}.

    Returns:
        {"loss": mean loss, each metric's mean, "samples": len(x)}, the same on every rank.

    Raises:
        ConfigError: `data` is empty, or differs across the ranks (another order: a test set shuffled without a
            seed; another copy), on every rank, naming the rank and the value.
        RankError: the model raised on some rank (on every rank, naming it and the exception).
    """
    if _keras_backend.on_torch():  # hvdp.keras.evaluate on Keras's torch backend: horovod.torch's ranks
        w, horovod = _keras_backend.ensure_init(), _keras_backend.horovod()
    else:
        w, horovod = _ensure_init(), hvd
    # hvdp: the ranks must score the same samples in the same order (each takes its slice of that order): the
    # data is compared as shard() compares it (its length and rows at fixed positions), one small all-gather.
    x, y = _agree_on_arrays(horovod, data, call="evaluate()")
    start, stop = eval_bounds(len(x), w.rank, w.size)
    if loss is None:
        def loss(yb, out):
            return _classifier_loss(yb, out, from_logits)
    if metrics is None:
        metrics = {"accuracy": lambda yb, out: _correct(yb, out, from_logits)}
    metrics = dict(metrics)

    def total(values) -> float:
        return float(np.sum(keras.ops.convert_to_numpy(values), dtype=np.float64))

    def score() -> list[float]:
        sums = np.zeros(len(metrics) + 2)  # count, loss sum, each metric's sum
        for lo in range(start, stop, batch_size):
            xb, yb = x[lo:min(lo + batch_size, stop)], y[lo:min(lo + batch_size, stop)]
            out = model(xb, training=False)
            sums += [len(yb), total(loss(yb, out)), *(total(fn(yb, out)) for fn in metrics.values())]
        return sums.tolist()

    # Each rank's sums gathered (an error on one rank raised on all), added in rank order: the same everywhere.
    gathered = gather_or_raise(horovod, score, name="hvdp.evaluate", operation="hvdp.tensorflow.evaluate")
    count, loss_sum, *sums = (sum(column) for column in zip(*gathered))
    return eval_means({"loss": loss_sum, **dict(zip(metrics, sums))}, count, rank=w.rank)
