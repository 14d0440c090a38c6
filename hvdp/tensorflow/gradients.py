"""hvdp.tensorflow's gradient averaging: allreduce_gradients and DistributedGradientTape."""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf

from hvdp import _keras_steps
from hvdp.core.errors import ConfigError
from hvdp.tensorflow.runtime import hvd

_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def _check_compression(compression: str) -> None:
    if compression not in _COMPRESSIONS:
        raise ConfigError(f"compression={compression!r} is not one of {', '.join(_COMPRESSIONS)}")


def allreduce_gradients(grads: Iterable, *, compression: str = "none", variables: Iterable | None = None) -> list:
    """Average gradients over all ranks so that the step is the one a single process takes on the union batch.

    - a dense gradient is averaged with one grouped all-reduce (fp16 compression halves its bytes; the result
      is cast back to its dtype);
    - a tf.IndexedSlices gradient (an Embedding's, a tf.gather's) stays sparse: every rank's slices are
      all-gathered, values divided by the number of ranks, so the optimizer gets the slices one process
      would have got for the union batch, a row once per occurrence. Keras's optimizers treat the slices
      of a repeated row one by one (Adam's and RMSprop's second moment, Adagrad's accumulator add the
      square of each slice, not the square of the row's sum): a densified average would take another step
      than one process (Adam: 0.10 apart after 6 steps on a text model), this takes the same;
    - a gradient None on every rank stays None (the optimizer skips that variable, as one process does); one
      that some ranks have and others not (a branch taken on some ranks' data) is averaged with zeros for the
      ranks without it.

    Which variables have a gradient, and which kind, is agreed inside the same collective: inside a
    tf.function it is fixed by the trace, the same on every rank (every rank traces the same function), and
    nothing more is sent; run eagerly, a rank cannot know the others', so every variable travels in the
    grouped all-reduce (zeros where this rank has none or a sparse one) with two flags per variable
    (dense here, sparse here), and the slices of a variable sparse on any rank are gathered after it (the
    variables' shapes are needed there: pass `variables`). Every rank must call it, with gradients of the
    same variables in the same order. No collective in a world of size 1.

    Args:
        grads: the gradients, tensors, tf.IndexedSlices or None, in a fixed order.
        compression: "none" (default) or "fp16".
        variables: the variables of `grads`, in the same order (default None); needed run eagerly when a
            gradient is None or sparse on this rank (DistributedGradientTape and DistributedOptimizer pass them).

    Returns:
        A list of the averaged gradients, in the same order: tensors, tf.IndexedSlices or None.

    Raises:
        ConfigError: `compression` is not "none" or "fp16"; run eagerly, a gradient is None or sparse and
            `variables` was not given.
    """
    _check_compression(compression)
    grads = list(grads)
    if hvd.size() == 1:
        return grads
    if tf.executing_eagerly():
        return _allreduce_eager(grads, compression, None if variables is None else list(variables))
    return _allreduce_traced(grads, compression)


def _allreduce_traced(grads: list, compression: str) -> list:
    """allreduce_gradients inside a tf.function: which gradient is None, dense or sparse is fixed by the trace."""
    out = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    if dense:
        # An explicit name: the default derives from tensor names, which hold Keras's per-process layer
        # counters (a rank that built one more model than the others would wait forever).
        reduced = hvd.grouped_allreduce([grads[i] for i in dense], op=hvd.Average,
                                        compression=_COMPRESSIONS[compression], name="hvdp_gradients")
        for i, g in zip(dense, reduced):
            out[i] = g
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            out[i] = _gathered_slices(g, i, compression)
    return out


def _gathered_slices(g: tf.IndexedSlices, i: int, compression: str) -> tf.IndexedSlices:
    """Every rank's slices of gradient `i`, in rank order, values divided by the number of ranks (indices as
    int64 on the wire: a rank without slices sends an empty int64 vector)."""
    wire = _COMPRESSIONS[compression]
    values, ctx = wire.compress(g.values)
    values = wire.decompress(hvd.allgather(values, name=f"hvdp_gradients.slices.{i}.values"), ctx)
    indices = hvd.allgather(tf.cast(g.indices, tf.int64), name=f"hvdp_gradients.slices.{i}.indices")
    return tf.IndexedSlices(values / tf.cast(hvd.size(), values.dtype), indices, g.dense_shape)


def _allreduce_eager(grads: list, compression: str, variables: list | None) -> list:
    """allreduce_gradients run eagerly: the ranks may differ in which variables have a gradient and of which
    kind, so every variable travels (zeros for none or a sparse one) with its flags in one grouped all-reduce;
    the slices of variables sparse on some rank are gathered after it, in order (they need the flags)."""
    sparse_here = [isinstance(g, tf.IndexedSlices) for g in grads]
    if variables is None and any(g is None or s for g, s in zip(grads, sparse_here)):
        raise ConfigError("allreduce_gradients run eagerly got a None or sparse gradient but no variables: pass "
                          "variables=<the variables of the gradients>, so that this rank can take part with zeros "
                          "of their shapes", rank=hvd.rank())
    slots = [tf.zeros(tuple(v.shape), tf.as_dtype(v.dtype)) if g is None or s else g
             for g, s, v in zip(grads, sparse_here, variables or [None] * len(grads))]
    floating = [t.dtype for t in slots if t.dtype.is_floating]
    flags = tf.constant([[float(g is not None and not s), float(s)] for g, s in zip(grads, sparse_here)],
                        floating[0] if floating else tf.float32)  # in the gradients' own dtype
    reduced = hvd.grouped_allreduce(slots + [tf.reshape(flags, [-1])], op=hvd.Average,
                                    compression=_COMPRESSIONS[compression], name="hvdp_gradients")
    used = tf.reshape(reduced[-1], [-1, 2]).numpy() > 0  # the same on every rank
    out = []
    for i, (g, (dense, sparse)) in enumerate(zip(grads, used)):
        result = reduced[i] if dense else None
        if sparse:
            mine = g if sparse_here[i] else tf.IndexedSlices(
                tf.zeros((0, *variables[i].shape[1:]), tf.as_dtype(variables[i].dtype)), tf.zeros([0], tf.int64),
                tf.constant(tuple(variables[i].shape), tf.int64))
            slices = _gathered_slices(mine, i, compression)
            result = slices if result is None else result + tf.convert_to_tensor(slices)
        out.append(result)
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

    # Plain Python inside a tf.function (no tensor-dependent control flow here): autograph's conversion of the
    # constructor failed in a traced step ("tf____init__() takes from 1 to 2 positional arguments but 3 were
    # given") after other tf.functions of the process had converted code.
    @tf.autograph.experimental.do_not_convert
    def __init__(self, tape: tf.GradientTape, *, compression: str = "none"):
        _check_compression(compression)
        self._tape = tape
        self._compression = compression

    @tf.autograph.experimental.do_not_convert
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
        flat = _keras_steps.ready(None, tf.nest.flatten(grads))  # a custom loop's step marks (issue 47)
        reduced = allreduce_gradients(flat, compression=self._compression, variables=tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, _keras_steps.reduced(None, reduced))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):  # watch(), stop_recording(), reset(), jacobian()...
        return getattr(self._tape, name)
