"""hvdp.tensorflow's evaluation: evaluate(), every test sample counted exactly once on any world size."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

from hvdp.core.sharding import eval_bounds, eval_metrics
from hvdp.tensorflow.runtime import _ensure_init, hvd


def evaluate(model, data, *, batch_size: int = 256, from_logits: bool = True) -> dict[str, float]:
    """Sparse-categorical loss and accuracy of a classifier over `data` = (x, y), counting every sample
    exactly once on any world size: each rank scores a contiguous, unpadded slice, the sums are all-reduced.
    Returns {"loss", "accuracy", "samples"}. Every rank must call it.

    Args:
        model: a classifier: model(x, training=False) returns (N, classes) logits or probabilities.
        data: (x, y) arrays with integer labels y, the same on every rank.
        batch_size: samples per forward pass on each rank (default 256).
        from_logits: the model outputs logits (default True) or probabilities (False).

    Returns:
        {"loss": mean loss, "accuracy": fraction correct, "samples": len(x)}, the same on every rank.

    Raises:
        ConfigError: `data` is empty (on every rank).
    """
    w = _ensure_init()
    x, y = (np.asarray(a) for a in data)
    start, stop = eval_bounds(len(x), w.rank, w.size)
    sums = np.zeros(3)  # loss sum, correct, count
    for lo in range(start, stop, batch_size):
        xb, yb = x[lo:min(lo + batch_size, stop)], y[lo:min(lo + batch_size, stop)]
        out = model(xb, training=False)
        loss = keras.losses.sparse_categorical_crossentropy(yb, out, from_logits=from_logits)
        pred = np.argmax(keras.ops.convert_to_numpy(out), axis=-1)
        sums += [float(np.sum(keras.ops.convert_to_numpy(loss), dtype=np.float64)), float(np.sum(pred == yb)), len(yb)]
    total = hvd.allreduce(tf.constant(sums, tf.float64), op=hvd.Sum, name="hvdp.evaluate").numpy().tolist()
    return eval_metrics(*total, rank=w.rank)
