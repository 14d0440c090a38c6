"""hvdp.tensorflow's evaluation: evaluate(), a model's mean loss and metrics (a classifier's accuracy by
default), every test sample counted exactly once on any world size."""

from __future__ import annotations

import keras
import numpy as np

from hvdp import _keras_backend
from hvdp._horovod import gather_or_raise
from hvdp.core.errors import ConfigError
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


def _per_sample_loss(loss):
    """The function of (y, out) giving each sample's loss for `loss`: a keras.losses.Loss object's own `call`
    (its __call__ reduces the batch to one number, by default its mean, which would count as one sample), or
    `loss` itself (a function such as keras.losses.mean_squared_error)."""
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    return loss


def _per_sample(values, n: int, what: str, rank: int) -> np.ndarray:
    """`values` as one number per sample of a batch of `n` (the mean over any further axes, as Keras's
    "sum_over_batch_size" for equal lengths), or ConfigError if it is not one value (or row) per sample."""
    values = np.asarray(keras.ops.convert_to_numpy(values), dtype=np.float64)
    if values.ndim == 0 or values.shape[0] != n:
        raise ConfigError(
            f"evaluate()'s {what} returned shape {tuple(values.shape)} for a batch of {n} samples: it must give each "
            f"sample's value, shape ({n},) (a reduced value, such as a loss object's batch mean, would be counted "
            f"as one sample). Pass a per-sample function (keras.losses.mean_squared_error), a keras.losses.Loss "
            f"object (its per-sample call() is used) or a keras.metrics.Metric", rank=rank)
    return values.reshape(n, -1).mean(axis=1)


def _metric_variables(metrics) -> list:
    seen, variables = set(), []
    for m in metrics:
        for v in m.variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    return variables


def _combine_parts(variables, rank: int, size: int) -> np.ndarray:
    """This rank's part, flat float64, of each variable's combination over the ranks as tf.distribute combines a
    variable: aggregation "sum" (every Keras metric variable's default) its value, "mean" its value / size,
    any other rank 0's (the others contribute 0). Summed over the ranks, the parts give the combined values."""
    parts = []
    for v in variables:
        value = np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64).ravel()
        aggregation = getattr(v, "aggregation", "sum")
        if aggregation == "mean":
            value = value / size
        elif aggregation != "sum" and rank != 0:
            value = np.zeros_like(value)
        parts.append(value)
    return np.concatenate(parts) if parts else np.zeros(0)


def _results(metrics, variables, combined: np.ndarray) -> list:
    """Each metric's result() over the `combined` values of `variables` (assigned, read, then the local values
    put back): a float, or for a metric returning a dict (fit's compiled metrics) a dict of its scalar entries."""
    local = [keras.ops.convert_to_numpy(v) for v in variables]
    at = 0
    for v in variables:
        size = int(np.prod(v.shape))
        v.assign(combined[at:at + size].reshape(v.shape).astype(keras.backend.standardize_dtype(v.dtype)))
        at += size
    try:
        out = []
        for m in metrics:
            result = m.result()
            if isinstance(result, dict):
                values = {k: np.asarray(keras.ops.convert_to_numpy(r)) for k, r in result.items()}
                out.append({k: float(r.reshape(())) for k, r in values.items() if r.size == 1})
            else:
                out.append(float(np.asarray(keras.ops.convert_to_numpy(result)).reshape(())))
        return out
    finally:
        for v, value in zip(variables, local):
            v.assign(value)


def _sum_over_ranks(horovod, values: np.ndarray, name: str) -> np.ndarray:
    """The float64 sum over the ranks of `values` (one all-reduce of the backend's Horovod)."""
    if _keras_backend.on_torch():
        import torch
        return horovod.allreduce(torch.from_numpy(values), op=horovod.Sum, name=name).numpy()
    import tensorflow as tf
    return horovod.allreduce(tf.constant(values, tf.float64), op=horovod.Sum, name=name).numpy()


def _summed_metric_results(metrics, horovod, name: str = "hvdp.metric_state") -> dict[str, float]:
    """The results of the Keras metrics `metrics` (their state as this rank accumulated it) over every rank's
    samples, as Keras computes them under tf.distribute: the metric variables combined over the ranks (summed:
    true/false positives, AUC's confusion counts, a Mean's total and count), then result(); each metric's own
    state is left as it was. Exact for ratio metrics, which averaging each rank's result is not. One float64
    all-reduce; every rank must call it with the same metrics.

    Returns:
        {metric name: value} (a metric whose result is a dict gives each of its scalar entries).
    """
    variables = _metric_variables(metrics)
    parts = _combine_parts(variables, horovod.rank(), horovod.size())
    combined = _sum_over_ranks(horovod, parts, name) if horovod.size() > 1 and parts.size else parts
    out = {}
    for m, result in zip(metrics, _results(metrics, variables, combined)):
        out.update(result if isinstance(result, dict) else {m.name: result})
    return out


def evaluate(model, data, *, batch_size: int = 256, from_logits: bool = True, loss=None,
             metrics: dict | None = None) -> dict[str, float]:
    """Mean loss (and, for a classifier, accuracy) over `data` = (x, y), counting every sample exactly once on
    any world size: each rank scores a contiguous, unpadded slice, the sums are gathered and added.

    By default it scores a classifier: the sparse categorical cross-entropy and "accuracy" (the argmax is
    the label); a binary classifier's one output per sample ((N,) or (N, 1), labels 0/1) with the binary
    cross-entropy and the output above 0 (a logit) or 0.5 (a probability). For any other model pass its
    per-sample `loss` and your own `metrics` (or none):
    `evaluate(model, (x, y), loss=keras.losses.MeanSquaredError(), metrics={"auc": keras.metrics.AUC()})`.
    Every rank must call it.

    Args:
        model: model(x, training=False) gives the output `loss` and the metrics take (a classifier: (N, classes)
            logits or probabilities).
        data: (x, y) arrays, the same on every rank in the same order: compared across the ranks as shard()
            compares its data (the number of samples, the rows at fixed positions).
        batch_size: samples per forward pass on each rank (default 256).
        from_logits: the default loss's input: the model outputs logits (default True) or probabilities.
        loss: a Keras loss function giving each sample's loss (keras.losses.mean_squared_error) or a
            keras.losses.Loss object (its per-sample call() is used: its reduction and __call__'s batch mean are
            not); values per sample and step (shape (n, T)) are averaged over the step axis first. Default None:
            the sparse categorical cross-entropy (with `from_logits`).
        metrics: name -> fn(y, out) giving each sample's value of that metric, reported as its mean, or name ->
            a keras.metrics.Metric (Precision, Recall, AUC, ...), its state reset, updated on each rank's batches,
            summed over the ranks, then result(): exactly one process's value. Default None:
            {"accuracy": 1 where argmax(out) == y}.

    Returns:
        {"loss": mean loss, each metric's value, "samples": len(x)}, the same on every rank.

    Raises:
        ConfigError: `data` is empty, or differs across the ranks (another order: a test set shuffled without a
            seed; another copy), or `loss` or a metric function does not give one value per sample (a reduced
            batch mean), on every rank, naming the rank and the value.
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
    loss = _per_sample_loss(loss)
    if metrics is None:
        metrics = {"accuracy": lambda yb, out: _correct(yb, out, from_logits)}
    functions = {k: fn for k, fn in metrics.items() if not isinstance(fn, keras.metrics.Metric)}
    stateful = {k: m for k, m in metrics.items() if isinstance(m, keras.metrics.Metric)}
    variables = _metric_variables(stateful.values())

    def total(values, n: int, what: str) -> float:
        return float(np.sum(_per_sample(values, n, what, w.rank)))

    def score() -> tuple[list[float], np.ndarray]:
        for m in stateful.values():
            m.reset_state()
        sums = np.zeros(len(functions) + 2)  # count, loss sum, each function's sum
        for lo in range(start, stop, batch_size):
            xb, yb = x[lo:min(lo + batch_size, stop)], y[lo:min(lo + batch_size, stop)]
            out = model(xb, training=False)
            sums += [len(yb), total(loss(yb, out), len(yb), "loss"),
                     *(total(fn(yb, out), len(yb), f"metric {k!r}") for k, fn in functions.items())]
            for m in stateful.values():
                m.update_state(yb, out)
        return sums.tolist(), _combine_parts(variables, w.rank, w.size)

    # Each rank's sums gathered (an error on one rank raised on all), added in rank order: the same everywhere.
    gathered = gather_or_raise(horovod, score, name="hvdp.evaluate", operation="hvdp.tensorflow.evaluate")
    count, loss_sum, *sums = (sum(column) for column in zip(*(g[0] for g in gathered)))
    means = eval_means({"loss": loss_sum, **dict(zip(functions, sums))}, count, rank=w.rank)
    combined = np.sum([g[1] for g in gathered], axis=0)
    means.update(zip(stateful, _results(stateful.values(), variables, combined)))
    return {**{k: means[k] for k in ("loss", *metrics)}, "samples": means["samples"]}
