"""The Keras and TensorFlow cases of `hvdp verify --zoo`: models people train, each with the optimizer it is
trained with, checked as `hvdp verify` checks its MLP (hvdp.tools.equivalence): N ranks with batch b through
hvdp against one plain process with batch N*b at N times the rate, from the same initial weights.

Each case is a function `case_<name>(steps=4, batch_size=8) -> float` called on every rank of a running job
(hvdp.keras.init() done); it returns on every rank the largest |difference| of a weight after `steps` steps
(the harness broadcasts rank 0's figure). CASES maps each name to its function; hvdp/tools/zoo.py runs them.
"keras" cases run on Keras's backend (KERAS_BACKEND: TensorFlow or torch), "tensorflow" ones need TensorFlow.

The inputs are the harness's standard-normal features; the text models turn them into token ids with a
Discretization layer over a vocabulary of 12, so every batch repeats tokens within a rank and across ranks
(an Embedding's gradient then holds a row several times: tf.IndexedSlices on TensorFlow, which hvdp gathers
rather than densifies).
"""

from __future__ import annotations

import keras
import numpy as np

from hvdp.tools import equivalence

VOCAB = 12  # token ids 0..11
LENGTH = 10  # tokens per sample
LR = 0.01
SEED = 3

# Bin edges over the standard-normal features: VOCAB ids, each frequent.
_EDGES = [float(e) for e in np.linspace(-1.5, 1.5, VOCAB - 1)]


def _tokens():
    return [keras.Input((LENGTH,)), keras.layers.Discretization(bin_boundaries=_EDGES),
            keras.layers.Embedding(VOCAB, 8)]


def _text_cnn():
    """Embedding -> Conv1D -> global max pooling -> Dense: keras-io's text classifier, small."""
    return keras.Sequential([*_tokens(), keras.layers.Conv1D(8, 3, activation="relu"),
                             keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(4)])


def _text_gru():
    """Embedding -> GRU -> Dense."""
    return keras.Sequential([*_tokens(), keras.layers.GRU(8), keras.layers.Dense(4)])


def _bag_of_embeddings():
    """Embedding -> global average pooling -> Dense (a custom loop's model: the Embedding's gradient is sparse)."""
    return keras.Sequential([*_tokens(), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])


class _Branches(keras.layers.Layer):
    """A trunk and head, an expert for the samples whose first feature is above THRESHOLD (a batch of 8 holds
    one about one time in 4: in some steps some ranks use it and others not, in some none), and a head no step
    uses (its gradient is None: one process skips it, AdamW's decay included)."""

    THRESHOLD = 1.8

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.trunk = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(4)
        self.expert = keras.layers.Dense(4)
        self.unused = keras.layers.Dense(4)

    def build(self, input_shape):
        self.trunk.build(input_shape)
        for layer in (self.head, self.expert, self.unused):
            layer.build((input_shape[0], 16))

    def call(self, x):
        h = self.trunk(x)
        out = self.head(h)
        # Routed as a mixture-of-experts layer routes: the expert adds to the samples sent to it only, and runs
        # only when a sample of the batch is (a Python branch on the torch backend: None gradients when not
        # taken; tf.cond in a traced step). Each sample's output does not depend on the rest of its batch.
        routed = x[:, :1] > self.THRESHOLD
        return keras.ops.cond(keras.ops.any(routed), lambda: out + keras.ops.where(routed, self.expert(h), 0.0),
                              lambda: out)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 4)


def _branches():
    inputs = keras.Input((20,))
    return keras.Model(inputs, _Branches()(inputs))


def _verify(framework: str, optimizer: str, factory, input_shape, steps: int, batch_size: int) -> float:
    result = equivalence.run(framework, optimizer=optimizer, steps=steps, batch_size=batch_size, accumulate=1,
                             lr=LR, seed=SEED, factory=factory, input_shape=input_shape, leftover=0)
    return float(result["max_abs_diff"])


def case_text_cnn(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of Embedding -> Conv1D -> pooling -> Dense with Adam."""
    return _verify("keras", "adam", _text_cnn, (LENGTH,), steps, batch_size)


def case_text_gru(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of Embedding -> GRU -> Dense with Adam."""
    return _verify("keras", "adam", _text_gru, (LENGTH,), steps, batch_size)


def case_tf_loop_embedding(steps: int = 4, batch_size: int = 8) -> float:
    """A tf.function custom loop (GradientTape + hvdp.tensorflow.DistributedOptimizer) over an Embedding model
    with Adam: the Embedding's gradient is tf.IndexedSlices."""
    return _verify("tensorflow", "adam", _bag_of_embeddings, (LENGTH,), steps, batch_size)


def case_unused_branch(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of a model with an expert some ranks use in a step and a head none uses, with AdamW."""
    return _verify("keras", "adamw", _branches, (20,), steps, batch_size)


# ------------------------------------------------ model.fit as users write it (issue 50): targets, weights, metrics

def _fit_against_one_process(build, data, *, steps: int, batch_size: int, loss, leftover: int, epochs: int = 1,
                             metrics=None, callbacks=None, build_reference=None, relative: bool = False) -> float:
    """model.fit of build() through hvdp.keras (per-rank initial weights, fixed by the broadcast; shard() without
    shuffling) against one process's model.fit of the same arrays in the same order with batch N*b at N times the
    rate, from rank 0's initial weights. `data(n)` gives the (x, y[, sample weights]) of n samples; `callbacks()`
    builds fresh callbacks for each side; with `metrics()`, the fit logs' last-epoch values of each metric are
    compared too (their state summed over the ranks); `build_reference()` builds one process's model where it is
    not build()'s (the same weights in the same order); `relative`: a weight's |difference| is taken relative to
    its size where that is above 1 (a moving mean near a large input mean holds 7 digits of it in float32).
    Returns the largest |difference|, rank 0's, on every rank."""
    import hvdp.keras as hk
    from hvdp import _keras_backend

    world = hk.world()
    arrays = data(steps * world.size * batch_size + leftover)
    keras.utils.set_random_seed(SEED + 1000 * world.rank + 1)
    model = build()
    initial = model.get_weights()
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss=loss,
                  metrics=metrics() if metrics else None)
    train = hk.shard(arrays, batch_size=batch_size, shuffle=False)
    fitted = model.fit(train, epochs=epochs, verbose=0,
                       callbacks=[*hk.callbacks(data=train), *(callbacks() if callbacks else [])]).history
    diff = None
    if world.rank == 0:
        reference = (build_reference or build)()
        reference.set_weights(initial)
        reference.compile(optimizer=keras.optimizers.SGD(LR * world.size, momentum=0.9), loss=loss,
                          metrics=metrics() if metrics else None)
        x, y, *weights = arrays
        one = reference.fit(x, y, sample_weight=weights[0] if weights else None, batch_size=batch_size * world.size,
                            shuffle=False, epochs=epochs, verbose=0, callbacks=callbacks() if callbacks else None).history
        if len(one["loss"]) != len(fitted["loss"]):  # a callback stopped one of them at another epoch
            diff = float("inf")
        else:
            scale = (lambda b: np.maximum(1.0, np.abs(b))) if relative else (lambda b: 1.0)
            diff = max(float(np.max(np.abs(a - b) / scale(b)))
                       for a, b in zip(model.get_weights(), reference.get_weights()))
            for name in (k for k in one if k != "loss"):  # the metrics (a name fit did not log: a KeyError)
                diff = max(diff, abs(one[name][-1] - fitted[name][-1]))
    return float(_keras_backend.horovod().broadcast_object(diff, root_rank=0, name="hvdp.zoo.diff"))


def _tagger():
    """Embedding -> Conv1D -> per-token Dense: a token tagger (LENGTH tokens, 3 tags)."""
    return keras.Sequential([*_tokens(), keras.layers.Conv1D(8, 3, padding="same", activation="tanh"),
                             keras.layers.Dense(3)])


def _tagged(n: int):
    """Features (tokenised by _tokens), a tag per token, and per-token weights: 1 on a sample's valid tokens, 0 on
    its padding (what the masking refusal of hvdp.keras tells a tagger to pass instead of a Keras mask)."""
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(2, LENGTH + 1, n)
    valid = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.float32)
    return (rng.standard_normal((n, LENGTH)).astype(np.float32), rng.integers(0, 3, (n, LENGTH)), valid)


def case_tagger_weights(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of a per-token tagger with per-token sample weights (padding 0), the epoch's short last step
    included: hvdp's last-step weights shaped to the (b, T) losses and multiplied into the user's."""
    return _fit_against_one_process(_tagger, _tagged, steps=steps, batch_size=batch_size, leftover=3,
                                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _segmenter():
    """Conv2D -> Conv2D 1x1: per-pixel logits of 2 classes on 8x8 images."""
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, padding="same", activation="tanh"),
                             keras.layers.Conv2D(2, 1)])


def _images(n: int):
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n, 8, 8, 1)).astype(np.float32)
    return x, (x[..., 0] + 0.5 * rng.standard_normal((n, 8, 8)) > 0).astype(np.int64)


def case_segmentation(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of a per-pixel classifier (losses of shape (b, 8, 8)), the epoch's short last step included."""
    return _fit_against_one_process(_segmenter, _images, steps=steps, batch_size=batch_size, leftover=3,
                                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _binary():
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1, activation="sigmoid")])


def _labelled(n: int):
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n, 20)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] + rng.standard_normal(n) > 0).astype(np.float32)[:, None]


def case_binary_metric_stop(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of a binary classifier with Precision, Recall and AUC (their fit logs against one process's:
    state summed over the ranks), EarlyStopping (on a loss that never improves by 10: both stop after epoch 2
    of 4) and TerminateOnNaN, over whole global batches (an uneven last step weighs the metrics' samples)."""
    return _fit_against_one_process(
        _binary, _labelled, steps=steps, batch_size=batch_size, leftover=0, epochs=4,
        loss="binary_crossentropy",
        metrics=lambda: [keras.metrics.Precision(name="precision"), keras.metrics.Recall(name="recall"),
                         keras.metrics.AUC(name="auc")],
        callbacks=lambda: [keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1),
                           keras.callbacks.TerminateOnNaN()])


class TwoPassBatchNormalization(keras.layers.BatchNormalization):
    """One process's BatchNormalization in the layer's own dtype with the variance around the batch mean (two
    passes), normalised by the backend's ops.batch_normalization as Keras's: the reference of case_syncbn_offset
    and of tests/tensorflow/worker_keras_fit.py's SyncBN check. Keras's own computes the variance as
    E[x^2] - E[x]^2 on its torch backend, in float32 even as a float64 layer (its call and ops.mean compute in
    result_type(dtype, "float32")): at an input mean of 1e3 no reference (relative error about 1e-1 in the
    variance; 0.45 at 3,000). Sums over n, not ops.mean, for the same reason."""

    def call(self, inputs, training=None, mask=None):
        x = keras.ops.cast(inputs, self.compute_dtype)
        if training:
            n = keras.ops.cast(keras.ops.shape(x)[0], x.dtype)
            mean = keras.ops.sum(x, axis=self._reduction_axes) / n
            variance = keras.ops.sum(keras.ops.square(x - mean), axis=self._reduction_axes) / n
            self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        return keras.ops.batch_normalization(x, mean, variance, axis=self.axis, offset=self.beta, scale=self.gamma,
                                             epsilon=self.epsilon)


OFFSET, SPREAD = 1e3, 10.0  # case_syncbn_offset's input mean and standard deviation


def _normalised(layer):
    def build():
        return keras.Sequential([keras.Input((20,)), layer(), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(4)])
    return build


def _offset(n: int):
    """Features of mean OFFSET and standard deviation SPREAD, 4 classes from two of them."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n, 20)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0)).astype(np.int64)
    return (x * SPREAD + OFFSET).astype(np.float32), y


def case_syncbn_offset(steps: int = 4, batch_size: int = 8) -> float:
    """model.fit of hvdp.keras.SyncBatchNormalization -> Dense -> Dense on inputs of mean 1e3 and spread 10 (the
    global batch's statistics with the variance around the mean), the epoch's short last step included, against
    one process's two-pass BatchNormalization (TwoPassBatchNormalization); the moving mean (about 49 after 5
    steps) compared relative to its size (2 float32 ulps of it are 7.6e-6). At spread 1 float32 itself is the
    limit: TensorFlow normalises as x*inv + (beta - mean*inv), terms of 1e3 (up to 2.2e-5 from one process at
    np=3); at 10 hvdp's SyncBN is within 5e-7 and the E[x^2] - E[x]^2 form 7.4e-4 away."""
    import hvdp.keras as hk

    return _fit_against_one_process(_normalised(hk.SyncBatchNormalization), _offset, steps=steps,
                                    batch_size=batch_size, leftover=3,
                                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                    build_reference=_normalised(TwoPassBatchNormalization), relative=True)


CASES = {"text_cnn": case_text_cnn, "text_gru": case_text_gru, "tf_loop_embedding": case_tf_loop_embedding,
         "unused_branch": case_unused_branch, "tagger_weights": case_tagger_weights,
         "segmentation": case_segmentation, "binary_metric_stop": case_binary_metric_stop,
         "syncbn_offset": case_syncbn_offset}
FRAMEWORKS = {"text_cnn": "keras", "text_gru": "keras", "tf_loop_embedding": "tensorflow",
              "unused_branch": "keras", "tagger_weights": "keras", "segmentation": "keras",
              "binary_metric_stop": "keras", "syncbn_offset": "keras"}

__all__ = ["CASES", "FRAMEWORKS", "case_text_cnn", "case_text_gru", "case_tf_loop_embedding", "case_unused_branch",
           "case_tagger_weights", "case_segmentation", "case_binary_metric_stop", "case_syncbn_offset"]
