"""hvdp.keras.shard's batches as model.fit takes them (issue 50 rows 6 and 11): hvdp's per-sample weights shaped to
each target's rank and folded into the user's own weights, and fit(class_weight=...) folded into them too.

shard()'s weights (hvdp.tensorflow.shard's `weights`: 1.0 except in an epoch's short last step, where they make
that step one process's) are one number per sample. Keras multiplies a loss's values by the sample weights after
bringing them to the same rank (a trailing 1 squeezed, or a trailing axis added), so a (b,) vector against
per-timestep or per-pixel losses of shape (b, T) or (b, H, W) would meet the wrong axis: the weights are shaped
(b, 1, ..., 1) to each target instead, which scales each sample's losses along the batch axis only.

fit(class_weight=...) on a tf.data dataset maps Keras's own class-weight function over it, which refuses data that
already carries sample weights (hvdp's). The datasets shard() returns take that map themselves: Keras's function
gives each sample's class weight as it would in one process, and it is multiplied into hvdp's weights, so the loss
is one process's with those class weights. Data with its own sample weights stays refused, as one process refuses
it (Keras: "cannot class_weight and sample_weight"), with a ConfigError saying what to do.
"""

from __future__ import annotations

import tensorflow as tf

from hvdp.core.errors import ConfigError


def finisher(seen: dict):
    """shard()'s `finish`: a batch's elements with hvdp's weights last -> (x, y, w), (x, y, sw * w), or x alone.
    Records in `seen["user_weights"]` whether the data carried its own sample weights (at tracing)."""

    def finish(*element):
        *sample, weight = element
        seen["user_weights"] = len(sample) == 3
        if len(sample) == 2:
            return (*sample, tf.nest.map_structure(lambda y: along_batch(weight, y), sample[1]))
        if len(sample) == 3:
            return (*sample[:2], tf.nest.map_structure(
                lambda sw: sw * along_batch(tf.cast(weight, sw.dtype), sw), sample[2]))
        return sample[0] if len(sample) == 1 else tuple(sample)
    return finish


def along_batch(weight, like):
    """The per-sample `weight` (shape (b,)) shaped (b, 1, ..., 1) to the rank of `like` (a target, or the user's
    own weights): it then scales each sample's per-timestep or per-pixel losses along the batch axis (Keras
    squeezes a trailing 1 where the loss has one value per sample), never a wrong axis."""
    ones = tf.ones([tf.maximum(tf.rank(like) - 1, 0)], tf.int32)
    return tf.reshape(weight, tf.concat([tf.shape(weight), ones], 0))


def _is_keras_class_weight(function) -> bool:
    """Whether `function` is the one Keras's TFDatasetAdapter maps over a dataset for fit(class_weight=...)."""
    return (getattr(function, "__name__", "") == "class_weights_map_fn"
            and getattr(function, "__module__", "").startswith("keras."))


def accept_class_weight(dataset: tf.data.Dataset, seen: dict, rewrap) -> tf.data.Dataset:
    """`dataset` (a shard's batches (x, y, w)) whose map() takes Keras's class-weight function: it then yields
    (x, y, w * class weight of y), the class weight from Keras's own function (one process's); any other function
    is mapped as usual. `seen` is finisher()'s record; `rewrap` re-applies the watchdog's wrapper to the result."""
    plain_map = dataset.map

    def map(function, *args, **kwargs):  # noqa: A001 - stands in for tf.data.Dataset.map on this instance
        if not _is_keras_class_weight(function):
            return plain_map(function, *args, **kwargs)
        if seen.get("user_weights"):
            raise ConfigError(
                "fit(class_weight=...) with data that carries its own sample weights (x, y, sw): Keras refuses "
                "both together in one process too. Multiply the class weights into your sample weights (sw * "
                "class_weight[y]) and drop class_weight=")

        def folded(x, y, weight):
            _, _, class_weight = function(x, y)  # Keras's own: one process's class weight of each sample
            return x, y, weight * along_batch(tf.cast(class_weight, weight.dtype), weight)
        return rewrap(plain_map(folded, *args, **kwargs))

    dataset.map = map
    return dataset
