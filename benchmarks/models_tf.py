"""The Keras versions of models.py's benchmark models: the same layers, parameter counts and per-rank batches
(channels last, as Keras lays images out)."""

import keras
from keras import layers


def _cnn():
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3, padding="same", activation="relu"), layers.GlobalAveragePooling2D(),
        layers.Dense(10)])


def _mlp():
    return keras.Sequential([
        keras.Input((1024,)), layers.Dense(2048, activation="relu"), layers.Dense(2048, activation="relu"),
        layers.Dense(10)])


# name -> (factory, input shape of one sample, per-rank batch), as in models.py
MODELS = {"cnn": (_cnn, (32, 32, 3), 32), "mlp": (_mlp, (1024,), 64)}
