"""Keras fit with hvdp.keras.callbacks and preemption on, a stop signal sent from inside a compiled step
(tests/test_preemption.py::test_keras_acts_on_a_signal_within_2_steps_whatever_steps_per_execution).

    worker_keras_preempt.py --spe S --epochs E --checkpoint-dir D [--signal-at K]

With --signal-at K, rank 1 sends itself SIGTERM from its K-th training step (counted from 1 over the run, inside
the step: a tf.py_function in the model, so mid-way through a steps_per_execution loop), as a scheduler's
signal lands while the step runs. Prints `result: {...}` (the final weights' digest) when fit ends."""

import argparse
import hashlib
import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import hvdp.keras as hk

parser = argparse.ArgumentParser()
parser.add_argument("--spe", type=int, default=1)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--signal-at", type=int, default=0)
args = parser.parse_args()

world = hk.init(preemption=True)
keras.utils.set_random_seed(7)
steps = {"n": 0}


def count(x):
    steps["n"] += 1
    if world.rank == 1 and steps["n"] == args.signal_at:
        with open(os.path.join(args.checkpoint_dir, "signalled-at"), "w") as f:
            f.write(str(steps["n"]))
        os.kill(os.getpid(), signal.SIGTERM)
    return x


class Counting(keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(count, [x], Tout=x.dtype)
        y.set_shape(x.shape)
        return y


rng = np.random.default_rng(0)
x = rng.normal(size=(768, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
model = keras.Sequential([keras.Input((8,)), Counting(), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss="mse",
              steps_per_execution=args.spe)
train = hk.shard((x, y), batch_size=16, seed=3)  # 24 steps per epoch at np=2
model.fit(train, epochs=args.epochs, verbose=0,
          callbacks=hk.callbacks(data=train, checkpoint_dir=args.checkpoint_dir))
digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
print("result: " + json.dumps({"rank": world.rank, "weights_sha256": digest, "steps_run": steps["n"]}), flush=True)
