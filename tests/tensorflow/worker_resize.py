"""Resume at another world size (tests/test_resume_resize.py): `worker_resize.py LOAD_DIR SAVE_DIR`.

Loads the newest checkpoint in LOAD_DIR (when not '-') and the optimizer config saved there (from_config),
reports the learning rates they then have, trains one epoch and saves an end-of-epoch checkpoint and the
optimizer's config in SAVE_DIR. Rank 0 prints `result: {...}`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp.tensorflow as htf  # noqa: E402

BASE_LR = 0.05
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
result = {"size": world.size, "base": BASE_LR, "resumed_epoch": epoch,
          "lr": float(opt.learning_rate.numpy())}
if load_dir != "-":
    config = json.loads((Path(load_dir) / "optimizer.json").read_text())
    result["from_config_lr"] = float(keras.saving.deserialize_keras_object(config).learning_rate.numpy())
    warm = keras.saving.deserialize_keras_object(json.loads((Path(load_dir) / "warmup.json").read_text()))
    rate = warm.inner_optimizer._learning_rate  # a ScaledSchedule with N > 1, the plain rate at N = 1
    result["from_config_warmup_lr_after_ramp"] = float(rate(10) if callable(rate) else rate.numpy())


@tf.function
def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


for x, y in data:
    step_fn(x, y)
htf.save_checkpoint(save_dir, model, opt, epoch=epoch + 1, step=0, global_step=epoch + 1)
if world.rank == 0:
    warmup = htf.DistributedOptimizer(keras.optimizers.SGD(BASE_LR), warmup_steps=10)
    (Path(save_dir) / "optimizer.json").write_text(json.dumps(keras.saving.serialize_keras_object(opt)))
    (Path(save_dir) / "warmup.json").write_text(json.dumps(keras.saving.serialize_keras_object(warmup)))
    print("result: " + json.dumps(result), flush=True)
