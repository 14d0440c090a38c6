"""A Horovod 0.28 Keras script, as its users write it (horovod.tensorflow.keras, no hvdp): it runs unchanged on
hvdp's Horovod build with Keras 3 (docs/porting.md#from-horovod). Run it as Horovod's scripts run:

    horovodrun -np 2 -H localhost:2 python examples/horovod_keras.py

The data: scikit-learn's bundled handwritten digits (no download), each rank reading its shard. The last line,
per rank: `result: {...}` with the first and last epoch's averaged loss, the test accuracy and a checksum of
the weights (the same on every rank when the gradients were averaged).
"""

import json

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import horovod.tensorflow.keras as hvd

# Horovod: initialize Horovod.
hvd.init()
tf.keras.utils.set_random_seed(1 + hvd.rank())  # Horovod: every rank starts from its own weights ...

digits = load_digits()
x = (digits.images / 16.0).reshape(-1, 64).astype("float32")
y = digits.target.astype("int64")
x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]

# Horovod: each rank trains on its own shard of the data.
dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
           .shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=0).batch(32))

model = tf.keras.Sequential([
    tf.keras.Input(shape=(64,)),
    tf.keras.layers.Dense(64, activation="relu"),
    tf.keras.layers.Dense(10),
])

# Horovod: scale the learning rate by the number of workers.
scaled_lr = 0.002 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

model.compile(loss=tf.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
              metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes (... and this makes them
    # rank 0's).
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final accuracy. Scale the
    # learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during the first two epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
]

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Horovod: adjust number of steps based on number of GPUs.
history = model.fit(dataset, steps_per_epoch=1437 // 32 // hvd.size(), callbacks=callbacks, epochs=12,
                    verbose=verbose)

test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
print("result: " + json.dumps({"rank": hvd.rank(), "size": hvd.size(),
                               "first_loss": float(history.history["loss"][0]),
                               "last_loss": float(history.history["loss"][-1]),
                               "test_accuracy": float(test_accuracy), "weights_checksum": checksum}), flush=True)
