"""hvdp.tensorflow's gradient averaging: allreduce_gradients and DistributedGradientTape."""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf

from hvdp.core.errors import ConfigError
from hvdp.tensorflow.runtime import hvd

_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def _check_compression(compression: str) -> None:
    if compression not in _COMPRESSIONS:
        raise ConfigError(f"compression={compression!r} is not one of {', '.join(_COMPRESSIONS)}")


def allreduce_gradients(grads: Iterable, *, compression: str = "none") -> list:
    """Average gradients over all ranks with one grouped all-reduce; None entries stay None.

    Works eagerly and inside tf.function. fp16 compression halves the bytes on the wire; the result is
    cast back to each gradient's dtype. Every rank must call it, with gradients of the same shapes and
    dtypes, None at the same places. No collective in a world of size 1 or when every entry is None.

    Args:
        grads: the gradients, tensors, tf.IndexedSlices (densified) or None, in a fixed order.
        compression: "none" (default) or "fp16".

    Returns:
        A list of the averaged gradients, in the same order.

    Raises:
        ConfigError: `compression` is not "none" or "fp16".
    """
    _check_compression(compression)
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if hvd.size() == 1 or not present:
        return grads
    dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices (embeddings) densified
    # An explicit name: the default derives from tensor names, which hold Keras's per-process layer
    # counters (a rank that built one more model than the others would wait forever).
    reduced = hvd.grouped_allreduce(dense, op=hvd.Average, compression=_COMPRESSIONS[compression],
                                    name="hvdp_gradients")
    out = list(grads)
    for i, g in zip(present, reduced):
        out[i] = g
    return out


class DistributedGradientTape:
    """Wraps a tf.GradientTape so that gradient() returns gradients averaged over all ranks.

        with tf.GradientTape() as tape:
            loss = ...
        tape = hvdp_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)     # identical on every rank

    For clipping by the global norm, clip these (already averaged) gradients, then apply them with a
    plain optimizer whose rate hvdp_tf.scale_learning_rate set. LR scaling, warmup and accumulation of
    several backward passes live in DistributedOptimizer: a tape cannot hold back an optimizer step.
    Use one or the other, not both (they would average twice: harmless, but twice the traffic).
    Other tape methods (watch, stop_recording, jacobian...) are the wrapped tape's.

    Args:
        tape: the tf.GradientTape that recorded the loss.
        compression: "none" (default) or "fp16" on the wire.

    Raises:
        ConfigError: `compression` is not "none" or "fp16".
    """

    def __init__(self, tape: tf.GradientTape, *, compression: str = "none"):
        _check_compression(compression)
        self._tape = tape
        self._compression = compression

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """tf.GradientTape.gradient, then the gradients averaged over all ranks (allreduce_gradients).

        Every rank must call it, for sources of the same structure, shapes and dtypes.

        Args:
            target: the tensor to differentiate (the loss).
            sources: a variable, or a nested structure of them; the result has the same structure.
            output_gradients: as for tf.GradientTape.gradient (default None).
            kwargs: further keywords for tf.GradientTape.gradient (unconnected_gradients).
        """
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, allreduce_gradients(flat, compression=self._compression))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):  # watch(), stop_recording(), reset(), jacobian()...
        return getattr(self._tape, name)
