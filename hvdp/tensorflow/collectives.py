"""hvdp.tensorflow's collectives over model variables and scalars: broadcast, barrier, average, check_finite,
log, check_consistency, and which variables make up a model (shared with the checkpoints)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import keras

from hvdp import _keras_backend
from hvdp.core import consistency
from hvdp.core.errors import DivergenceError, NonFiniteLossError
from hvdp.tensorflow.optimizer import DistributedOptimizer
from hvdp.tensorflow.runtime import _ensure_init, hvd


# ------------------------------------------------------------------------------------------- variables

def _weights(model_or_variables) -> list:
    """The variables that define a model (parameters and statistics such as BatchNorm's), in a fixed order.

    A Keras model's `weights` (seed-generator states, which drive dropout, are per-rank RNG state and are
    not included); a tf.Module's `variables`; or a list of variables as given."""
    if isinstance(model_or_variables, keras.layers.Layer):
        return list(model_or_variables.weights)
    if isinstance(model_or_variables, tf.Module):
        return list(model_or_variables.variables)
    return list(model_or_variables)


def _rng_variables(model) -> list:
    """Per-rank random state of a Keras model: its seed generators' states (dropout masks, noise layers)."""
    if not isinstance(model, keras.layers.Layer):
        return []
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _local_variables(model, optimizer) -> list:
    """State that legitimately differs across ranks and so is saved for every rank, not just rank 0's: the
    seed generators (dropout) and a DistributedOptimizer's local gradient accumulators (mid-accumulation)."""
    local = _rng_variables(model)
    if isinstance(optimizer, DistributedOptimizer) and optimizer.backward_passes_per_step > 1 and optimizer.built:
        local += list(optimizer._accumulators)
    return local


def _trainable(model_or_variables) -> list:
    if isinstance(model_or_variables, (keras.layers.Layer, tf.Module)):
        return list(model_or_variables.trainable_variables)
    return [v for v in model_or_variables if getattr(v, "trainable", True)]


def _name(v) -> str:
    """A variable's structural name: Keras's short name ('kernel'), not its path ('dense_3/kernel'), whose
    layer counters depend on how many models this process built before."""
    return v.name


def _label(v) -> str:
    """The name to show a user: the full path where there is one."""
    return getattr(v, "path", None) or v.name


def _build_optimizer(optimizer, model_or_variables) -> None:
    """Create a Keras optimizer's (zero) state now, exactly as its first apply() would, so it can be
    broadcast or restored before the first step without taking a fake step."""
    if optimizer is not None and not optimizer.built:
        optimizer.build(_trainable(model_or_variables))


def broadcast(model_or_variables, optimizer: keras.optimizers.Optimizer | None = None, root_rank: int = 0) -> None:
    """Copy the model's variables and the optimizer's state from `root_rank` to every rank.

    Call it once before training (and after load_checkpoint is not needed: that already gives every rank
    the same state). A fresh Keras optimizer is built first, so its state exists (all zeros) and the
    first step on every rank starts from rank 0's everything. One broadcast per dtype. Every rank must
    call it, with models of the same variables. Calls init() if Horovod is not initialised yet.

    Args:
        model_or_variables: a Keras model (its weights: parameters and statistics such as BatchNorm's,
            not the dropout seed states), a tf.Module (its variables), or a list of variables.
        optimizer: also copy this Keras optimizer's state, building it first (default None: model only).
        root_rank: the rank whose values everyone gets (default 0).
    """
    _ensure_init()
    _build_optimizer(optimizer, model_or_variables)
    variables = _weights(model_or_variables) + (list(optimizer.variables) if optimizer is not None else [])
    if hvd.size() == 1 or not variables:
        return
    by_dtype: dict[str, list] = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype).name, []).append(v)
    for dtype, group in sorted(by_dtype.items()):
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        flat = hvd.broadcast(flat, root_rank=root_rank, name=f"hvdp.broadcast.{dtype}")
        sizes = [int(np.prod(v.shape)) for v in group]
        for v, part in zip(group, tf.split(flat, sizes)):
            v.assign(tf.reshape(part, v.shape))


# ----------------------------------------------------------------------------------------- collectives

def barrier() -> None:
    """Wait until every rank gets here (horovod.tensorflow has no barrier(): a one-number all-reduce is one).

    Every rank must call it; a no-op in a world of size 1. Call init() first.
    """
    if hvd.size() > 1:
        hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="hvdp.barrier")


def average(value, name: str = "hvdp.average") -> float:
    """The mean of a scalar over all ranks (for metrics and logging). Every rank must call it.

    Args:
        value: a number or a one-element tensor (computed in float64).
        name: the all-reduce's name in Horovod (default "hvdp.average"); every rank must pass the same.

    Returns:
        The mean as a float, the same on every rank.
    """
    t = tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float64), [])
    return float(hvd.allreduce(t, op=hvd.Average, name=name))


def check_finite(loss, step: int) -> None:
    """Raise NonFiniteLossError on every rank if the loss is NaN or inf on any rank (which is named).

    Every rank must call it, at the same steps; eagerly, outside tf.function (it reads the loss's value).

    Args:
        loss: this rank's loss, a scalar tensor or a float.
        step: the step number, shown in the message.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite on at least one rank (raised on every rank).
    """
    value = float(loss)
    flags = hvd.allgather(tf.constant([0.0 if np.isfinite(value) else 1.0], tf.float64), name="hvdp.finite")
    ranks = [int(r) for r in np.flatnonzero(flags.numpy())]
    if ranks:
        raise NonFiniteLossError(
            f"loss is not finite at step {step} on rank(s) {ranks} (loss on this rank: {value}); lower the "
            f"learning rate, enable warmup, or check the data", rank=hvd.rank())


def log(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (on every process before init()), flushed at once.

    Args:
        args: what to print, as for print().
        kwargs: print()'s keywords (sep, end, file), except flush, which is always True.
    """
    horovod = _keras_backend.horovod() if _keras_backend.on_torch() else hvd  # hvdp.keras.log on torch too
    if not horovod.is_initialized() or horovod.rank() == 0:
        print(*args, **kwargs, flush=True)


def check_consistency(model_or_variables) -> None:
    """Raise DivergenceError on every rank if any model variable differs across ranks, naming the first one
    and the ranks that differ from rank 0. Compares exact bytes, so it catches the smallest drift.

    Every rank must call it. One allgather of a sha256 digest per variable, no variable data.

    Args:
        model_or_variables: a Keras model (its weights), a tf.Module (its variables) or a list of variables.

    Raises:
        DivergenceError: a variable's shape or bytes differ from rank 0's on some rank (raised on every rank).
    """
    # Only the transport is TensorFlow's: hvdp.keras.check_consistency on Keras's torch backend gathers the
    # same digests of the same Keras variables through horovod.torch.
    horovod = _keras_backend.horovod() if _keras_backend.on_torch() else hvd
    variables = _weights(model_or_variables)
    digests = [consistency.digest(f"{i}:{_name(v)}", v.shape,
                                  np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
               for i, v in enumerate(variables)]
    problem = consistency.divergence(
        horovod.allgather_object(digests, name="hvdp.consistency"), labels=[_label(v) for v in variables],
        fix="Broadcast the initial state (hvdp.tensorflow.broadcast, or hvdp.keras.callbacks) and avoid "
            "rank-dependent code paths")
    if problem:
        raise DivergenceError(problem, rank=horovod.rank())
