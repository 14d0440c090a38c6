"""Train a small CNN on scikit-learn's handwritten digits with Keras 3 model.fit, data-parallel over Horovod.

    python examples/train_keras.py                                   # one process
    horovodrun -np 2 -H localhost:2 python examples/train_keras.py   # two ranks
    mpirun --allow-run-as-root -np 2 python examples/train_keras.py  # OpenMPI directly
    horovodrun -np 2 -H localhost:2 python examples/train_keras.py --keras-backend torch   # Keras on PyTorch

`--keras-backend {tensorflow,torch}` sets KERAS_BACKEND before Keras is imported (setting KERAS_BACKEND
yourself does the same); on torch hvdp.keras averages through horovod.torch. Every line that distribution
costs is tagged `# hvdp:`. The last line printed is `result: {json}`, with the backend as `keras_backend`.
train(cfg) is the whole job as a function, which examples/train_on_cluster.py runs on Spark and Ray.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import (DEFAULTS, digest, fail, load_data, num_classes, parse_config, print_result,  # noqa: E402
                    record_files, select_keras_backend, summary, write_files)

if __name__ == "__main__":
    select_keras_backend()  # --keras-backend: Keras reads KERAS_BACKEND once, when it is imported (next line)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp  # noqa: E402
import hvdp.keras as hvdp_keras  # noqa: E402
from hvdp.core.checkpoint import write_atomic  # noqa: E402
from hvdp.core.errors import ConfigError, HvdpError  # noqa: E402


def build_model(shape: tuple[int, ...], classes: int) -> keras.Model:
    h, w = shape[:2]
    return keras.Sequential([
        keras.Input(shape),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D((max(1, h // 4), max(1, w // 4))),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes)])


def training_data(adapter, cfg, x: np.ndarray, y: np.ndarray, world, **options) -> tf.data.Dataset:
    """This rank's batches (`adapter`: hvdp.keras or hvdp.tensorflow): of the arrays, or of TFRecord files;
    `options` go to shard() (hvdp.tensorflow's weights=True)."""
    if not cfg.files:
        return adapter.shard((x, y), batch_size=cfg.batch_size, seed=cfg.seed, **options)
    if world.is_main:  # hvdp: one rank writes the files, the others wait for them
        write_files(cfg.files, x, y, "tfrecord")
    adapter.barrier()
    shape = x.shape[1:]

    def parse(record):  # one sample, in tf.data's threads, after the split
        label = tf.io.decode_raw(tf.strings.substr(record, 0, 8), tf.int64)[0]
        pixels = tf.io.decode_raw(tf.strings.substr(record, 8, tf.strings.length(record) - 8), tf.float32)
        return tf.reshape(pixels, shape), label

    records = adapter.index_records(record_files(cfg.files))  # hvdp: the records, by position
    return adapter.shard(records, batch_size=cfg.batch_size, seed=cfg.seed, map=parse, **options)  # hvdp: this rank's


def train(cfg) -> dict:
    """Train and evaluate on every rank (every rank must call it); returns this rank's summary, with its
    rank and the digest of its final weights. Rank 0 also saves the model (--save-model)."""
    # hvdp: rank, size; its own GPU if any; with a checkpoint directory, SIGTERM/SIGUSR1 (preemption) checkpoint
    world = hvdp_keras.init(timeline=cfg.timeline, device=cfg.device, preemption=cfg.checkpoint_dir is not None)
    if cfg.adasum:
        raise ConfigError("--adasum is implemented by the PyTorch adapter only; the TensorFlow/Keras adapters "
                          "average gradients: drop --adasum")
    keras.utils.set_random_seed(cfg.seed)

    x_train, y_train, x_test, y_test = load_data(cfg.data)
    x_train, x_test = (np.moveaxis(x, 1, -1) for x in (x_train, x_test))  # Keras wants channels last
    model = build_model(x_train.shape[1:], num_classes(y_train, y_test))

    train = training_data(hvdp_keras, cfg, x_train, y_train, world)  # hvdp: this rank's batches
    steps_per_epoch = int(train.cardinality()) // cfg.accumulate
    optimizer = hvdp_keras.DistributedOptimizer(  # hvdp: scale LR (+ warmup), average gradients in the train step
        keras.optimizers.SGD(cfg.lr, momentum=0.9), lr_scaling=cfg.lr_scaling,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch), compression=cfg.compression,
        backward_passes_per_step=cfg.accumulate)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    history: list[dict] = []

    def on_epoch_end(epoch, logs):  # every rank calls evaluate (a collective); rank 0 prints
        metrics = hvdp_keras.evaluate(model, (x_test, y_test))  # hvdp: every test sample counted once
        history.append({"epoch": epoch, "loss": logs["loss"], "accuracy": metrics["accuracy"],
                        "lr": float(optimizer.learning_rate)})
        hvdp_keras.log(f"epoch {epoch}: loss {logs['loss']:.4f}  test accuracy {metrics['accuracy']:.4f}  "
                       f"lr {history[-1]['lr']:.4f}")

    callbacks = hvdp_keras.callbacks(  # hvdp: broadcast rank 0's state, average metrics, checkpoint + resume
        data=train, checkpoint_dir=cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
    callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end))
    if cfg.logdir and world.is_main:  # hvdp: only rank 0 writes logs
        callbacks.append(_TensorBoardScalars(cfg.logdir, history))

    hvdp_keras.log(f"training on {world.size} rank(s), Keras on {keras.backend.backend()}: batch {cfg.batch_size}"
                   f"/rank x {cfg.accumulate} accumulated = {world.size * cfg.batch_size * cfg.accumulate}/step, "
                   f"lr {cfg.lr} -> "
                   f"{cfg.lr * optimizer.multiplier:g} (x{optimizer.multiplier:g})")
    started = time.perf_counter()
    model.fit(train, epochs=cfg.epochs, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - started
    samples = len(history) * len(x_train)  # the epochs this run trained (fewer after a resume), all ranks

    hvdp_keras.check_consistency(model)  # hvdp: raises, naming rank and variable, if replicas diverged
    metrics = hvdp_keras.evaluate(model, (x_test, y_test))
    weights = {f"w{i:03d}": w for i, w in enumerate(model.get_weights())}
    if world.is_main and cfg.save_model:  # hvdp: rank 0 saves
        write_atomic(cfg.save_model, lambda f: np.savez(f, **weights))
    return summary(metrics, framework="keras", world_size=world.size, epochs=cfg.epochs, samples=samples,
                   seconds=seconds, rank=world.rank, weights_sha256=digest(weights.values()),
                   keras_backend=keras.backend.backend())


def main() -> None:
    result = train(parse_config(__doc__.splitlines()[0], keras_backend=True, **DEFAULTS))
    if result["rank"] == 0:  # hvdp: rank 0 reports
        print_result(result)


class _TensorBoardScalars(keras.callbacks.Callback):
    """The same scalars as the PyTorch example, written by rank 0."""

    def __init__(self, logdir: str, history: list[dict]):
        super().__init__()
        import tensorflow as tf
        self.tf, self.writer, self.history, self.started = tf, tf.summary.create_file_writer(logdir), history, None

    def on_train_begin(self, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        h = self.history[-1]
        with self.writer.as_default():
            for name, value in (("loss/train", h["loss"]), ("accuracy/test", h["accuracy"]), ("lr", h["lr"]),
                                *hvdp.straggler_scalars()):  # step_ms/<part>/rank<r>: the straggler report's figures
                self.tf.summary.scalar(name, value, step=epoch)
        self.writer.flush()


if __name__ == "__main__":
    try:
        main()
    except HvdpError as e:
        fail(e)
