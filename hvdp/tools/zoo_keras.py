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


CASES = {"text_cnn": case_text_cnn, "text_gru": case_text_gru, "tf_loop_embedding": case_tf_loop_embedding,
         "unused_branch": case_unused_branch}
FRAMEWORKS = {"text_cnn": "keras", "text_gru": "keras", "tf_loop_embedding": "tensorflow",
              "unused_branch": "keras"}

__all__ = ["CASES", "FRAMEWORKS", "case_text_cnn", "case_text_gru", "case_tf_loop_embedding", "case_unused_branch"]
