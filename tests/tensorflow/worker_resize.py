"""Resume at another world size (tests/test_resume_resize.py): `worker_resize.py LOAD_DIR SAVE_DIR`.

Loads the newest checkpoint in LOAD_DIR (when not '-') and the optimizer config saved there (from_config),
reports the learning rates they then have, trains one epoch and saves an end-of-epoch checkpoint and the
optimizer's config in SAVE_DIR. Rank 0 prints `result: {...}`.

With a warmup of WARMUP optimizer steps, the same through a custom loop (LOAD_DIR/warmup) and through
model.fit with hvdp.keras.callbacks(checkpoint_dir=...) (a copy of LOAD_DIR/keras in SAVE_DIR/keras): each
measures the rate of every step it takes as how far a weight whose averaged gradient is 1 moves under SGD.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp.keras as hk  # noqa: E402
import hvdp.tensorflow as htf  # noqa: E402

BASE_LR = 0.05
WARMUP = 6  # optimizer steps: the ramp runs into the second run of the chain
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

world = htf.init()
load_dir, save_dir = sys.argv[1], sys.argv[2]
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
opt = htf.DistributedOptimizer(keras.optimizers.SGD(BASE_LR, momentum=0.9))
htf.broadcast(model, opt)
rng = np.random.default_rng(1)
data = htf.shard((rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 2, 32)), batch_size=4)
state = htf.load_checkpoint(load_dir, model, opt, data) if load_dir != "-" else None
epoch = state["epoch"] if state else 0
result = {"size": world.size, "base": BASE_LR, "resumed_epoch": epoch, "warmup": WARMUP,
          "lr": float(opt.learning_rate.numpy())}
if load_dir != "-":
    config = json.loads((Path(load_dir) / "optimizer.json").read_text())
    result["from_config_lr"] = float(keras.saving.deserialize_keras_object(config).learning_rate.numpy())
    warm = keras.saving.deserialize_keras_object(json.loads((Path(load_dir) / "warmup.json").read_text()))
    rate = warm.inner_optimizer._learning_rate  # a ScaledSchedule, at every world size
    result["from_config_warmup_lr_after_ramp"] = float(rate(10))


@tf.function
def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


for x, y in data:
    step_fn(x, y)
htf.save_checkpoint(save_dir, model, opt, epoch=epoch + 1, step=0, global_step=epoch + 1)

# A custom loop with a warmup, resumed at each world size.
w = keras.Variable(np.zeros(1, np.float32), name="w")
ramped = htf.DistributedOptimizer(keras.optimizers.SGD(BASE_LR), warmup_steps=WARMUP)
warm_state = htf.load_checkpoint(Path(load_dir) / "warmup", [w], ramped) if load_dir != "-" else None
step, result["warmup_rates"] = (warm_state["global_step"] if warm_state else 0), []
for _ in range(32 // (4 * world.size)):  # an epoch's steps
    before = float(w.numpy()[0])
    ramped.apply([tf.ones(1)], [w])  # gradient 1 on every rank: the average is 1
    result["warmup_rates"].append([step, before - float(w.numpy()[0])])
    step += 1
htf.save_checkpoint(Path(save_dir) / "warmup", [w], ramped, epoch=epoch + 1, step=0, global_step=step)

# model.fit with a warmup and hvdp.keras.callbacks(checkpoint_dir=...), resumed at each world size.
if world.rank == 0 and load_dir != "-":
    shutil.copytree(Path(load_dir) / "keras", Path(save_dir) / "keras")
htf.barrier()
fitted = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
fitted.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(BASE_LR), warmup_steps=WARMUP),
               loss=lambda y, p: keras.ops.mean(p, axis=-1))  # d loss / d kernel = mean(x) = 1
ones = hk.shard((np.ones((32, 1), np.float32), np.zeros(32, np.float32)), batch_size=4)
result["fit_rates"] = []


class Moves(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.before = (int(self.model.optimizer.iterations), float(self.model.layers[0].kernel.numpy()[0, 0]))

    def on_train_batch_end(self, batch, logs=None):
        moved = self.before[1] - float(self.model.layers[0].kernel.numpy()[0, 0])
        result["fit_rates"].append([self.before[0], moved])


fitted.fit(ones, epochs=epoch + 1, verbose=0,
           callbacks=[*hk.callbacks(data=ones, checkpoint_dir=Path(save_dir) / "keras"), Moves()])
if world.rank == 0:
    warmup = htf.DistributedOptimizer(keras.optimizers.SGD(BASE_LR), warmup_steps=10)
    (Path(save_dir) / "optimizer.json").write_text(json.dumps(keras.saving.serialize_keras_object(opt)))
    (Path(save_dir) / "warmup.json").write_text(json.dumps(keras.saving.serialize_keras_object(warmup)))
    print("result: " + json.dumps(result), flush=True)
