"""Train a small CNN on scikit-learn's handwritten digits with a TensorFlow custom loop, data-parallel over Horovod.

    python examples/train_tf.py                                   # one process
    horovodrun -np 2 -H localhost:2 python examples/train_tf.py   # two ranks
    mpirun --allow-run-as-root -np 2 python examples/train_tf.py  # OpenMPI directly

Every line that distribution costs is tagged `# hvdp:`. The last line printed is `result: {json}`.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp  # noqa: E402
import hvdp.tensorflow as hvdp_tf  # noqa: E402
from common import DEFAULTS, fail, load_data, num_classes, parse_config, report  # noqa: E402
from hvdp.core.checkpoint import write_atomic  # noqa: E402
from hvdp.core.errors import ConfigError, HvdpError  # noqa: E402
from train_keras import build_model, training_data  # noqa: E402  (the same CNN and data)


def main() -> None:
    cfg = parse_config(__doc__.splitlines()[0], **DEFAULTS)
    world = hvdp_tf.init(timeline=cfg.timeline, device=cfg.device)  # hvdp: rank, size; its own GPU if any
    if cfg.adasum:
        raise ConfigError("--adasum is implemented by the PyTorch adapter only; the TensorFlow/Keras adapters "
                          "average gradients: drop --adasum")
    keras.utils.set_random_seed(cfg.seed)

    x_train, y_train, x_test, y_test = load_data(cfg.data)
    x_train, x_test = (np.moveaxis(x, 1, -1) for x in (x_train, x_test))  # channels last
    model = build_model(x_train.shape[1:], num_classes(y_train, y_test))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # hvdp: this rank's batches, each with its samples' gradient weights (the last, partial step exact)
    train = training_data(hvdp_tf, cfg, x_train, y_train, world, weights=True,
                          backward_passes_per_step=cfg.accumulate)
    batches = train.hvdp_position.plan.steps_per_epoch
    optimizer = hvdp_tf.DistributedOptimizer(  # hvdp: scale LR (+ warmup), average gradients in apply()
        keras.optimizers.SGD(cfg.lr, momentum=0.9), lr_scaling=cfg.lr_scaling,
        warmup_steps=round(cfg.warmup_epochs * batches // cfg.accumulate), compression=cfg.compression,
        backward_passes_per_step=cfg.accumulate)
    hvdp_tf.broadcast(model, optimizer)  # hvdp: every rank starts from rank 0's weights
    resumed = hvdp_tf.load_checkpoint(cfg.checkpoint_dir, model, optimizer, train)  # hvdp: resume (all ranks)
    start_epoch, start_step = (resumed["epoch"], resumed["step"]) if resumed else (0, 0)
    if resumed:
        hvdp_tf.log(f"resumed from epoch {start_epoch} step {start_step} (optimizer step {int(optimizer.iterations)})")

    writer = tf.summary.create_file_writer(cfg.logdir) if cfg.logdir and world.is_main else None  # hvdp: rank 0 logs

    @tf.function
    def train_step(x, y, w):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True), sample_weight=w)  # hvdp: w is 1 but in the last step
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # hvdp: averaged across ranks
        return loss

    hvdp_tf.log(f"training on {world.size} rank(s): batch {cfg.batch_size}/rank x {cfg.accumulate} accumulated "
                f"= {world.size * cfg.batch_size * cfg.accumulate}/step, lr {cfg.lr} -> "
                f"{cfg.lr * optimizer.multiplier:g} (x{optimizer.multiplier:g})")
    samples, started = 0, time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        epoch_loss, count = 0.0, 0
        for x, y, w in train:  # a new order every epoch; a resumed epoch starts at its saved batch
            epoch_loss, count, samples = epoch_loss + float(train_step(x, y, w)), count + 1, samples + len(y)
        optimizer.flush()  # hvdp: with --accumulate k, the epoch's last j < k batches are a step too
        train_loss = hvdp_tf.average(epoch_loss / max(count, 1))  # hvdp: mean over ranks
        metrics = hvdp_tf.evaluate(model, (x_test, y_test))  # hvdp: every test sample counted once
        lr = float(optimizer.learning_rate)
        hvdp_tf.log(f"epoch {epoch}: loss {train_loss:.4f}  test accuracy {metrics['accuracy']:.4f}  lr {lr:.4f}")
        if writer:
            with writer.as_default():
                for name, value in (("loss/train", train_loss), ("accuracy/test", metrics["accuracy"]), ("lr", lr),
                                    ("samples_per_sec", samples * world.size / (time.perf_counter() - started)),
                                    *hvdp.straggler_scalars()):  # step_ms/<part>/rank<r>: the straggler report's
                    tf.summary.scalar(name, value, step=epoch)
        if cfg.checkpoint_dir:  # hvdp: rank 0 writes atomically, every rank calls
            hvdp_tf.save_checkpoint(cfg.checkpoint_dir, model, optimizer, epoch=epoch + 1, step=0,
                                    global_step=int(optimizer.iterations), keep=cfg.keep_checkpoints)
    seconds = time.perf_counter() - started

    hvdp_tf.check_consistency(model)  # hvdp: raises, naming rank and variable, if replicas diverged
    metrics = hvdp_tf.evaluate(model, (x_test, y_test))
    if world.is_main:  # hvdp: rank 0 saves and reports
        if cfg.save_model:
            weights = {f"w{i:03d}": w for i, w in enumerate(model.get_weights())}
            write_atomic(cfg.save_model, lambda f: np.savez(f, **weights))
        report(metrics, framework="tensorflow", world_size=world.size, epochs=cfg.epochs,
               samples=samples * world.size, seconds=seconds)


if __name__ == "__main__":
    try:
        main()
    except HvdpError as e:
        fail(e)
