"""One Keras/TensorFlow training-throughput measurement, the counterpart of train_worker.py.

`--impl`:
- hvdp-keras: model.fit with hvdp.keras.DistributedOptimizer and hvdp.keras.callbacks(), as hvdp's docs show;
- hvdp-tf: a tf.function custom loop with hvdp.tensorflow.DistributedGradientTape;
- horovod-tf: the same loop averaging each gradient with horovod.tensorflow's allreduce, as its
  DistributedGradientTape does (neither that tape nor horovod.tensorflow.keras works on Keras 3);
- alone: model.fit in one plain process, the reference for scaling efficiency.

Rank 0 prints `bench: {json}` with the median samples/s per rank and the spread over repetitions.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models_tf import MODELS  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp-keras", "hvdp-tf", "horovod-tf", "alone"], required=True)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    # The same thread setting for every implementation, before TensorFlow starts its pools.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rank, size = 0, 1
    if args.impl.startswith("hvdp"):
        import hvdp.keras as hk
        import hvdp.tensorflow as htf
        world = htf.init()  # hvdp: its tuned runtime defaults apply here
        rank, size = world.rank, world.size
    elif args.impl == "horovod-tf":
        import horovod.tensorflow as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    factory, shape, batch = MODELS[args.model]
    keras.utils.set_random_seed(0)
    model = factory()
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.standard_normal((batch, *shape), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)

    if args.impl in ("hvdp-keras", "alone"):
        callbacks = []
        if args.impl == "hvdp-keras":
            optimizer = hk.DistributedOptimizer(optimizer, lr_scaling="none")
            callbacks = hk.callbacks()
        model.compile(optimizer=optimizer, loss=loss_fn)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        model.fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0, callbacks=callbacks)
        timer = EpochTimer()
        model.fit(data, epochs=args.reps, steps_per_epoch=args.steps, verbose=0, callbacks=[timer, *callbacks])
        seconds = timer.seconds
    else:
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if args.impl == "hvdp-tf":
                grads = htf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            else:
                # What horovod.tensorflow.DistributedGradientTape does (one averaging allreduce per gradient,
                # fused by Horovod's background thread). The tape itself cannot be used: it keys gradients by
                # tf.Variable.ref(), which Keras 3 variables lack ("'Variable' object has no attribute 'ref'").
                grads = [hvd.allreduce(g, op=hvd.Average) for g in tape.gradient(loss, model.trainable_variables)]
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step()  # builds the optimizer's state; then every rank starts from rank 0's
        if args.impl == "hvdp-tf":
            htf.broadcast(model, optimizer)
        else:  # hvd.broadcast_variables fails on Keras 3 variables too (it calls assign on a read tensor)
            for i, v in enumerate([*model.variables, *optimizer.variables]):
                v.assign(hvd.broadcast(v.value, root_rank=0, name=f"broadcast.{i}"))
        for _ in range(args.warmup - 1):
            step()
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            loss.numpy()
            seconds.append(time.perf_counter() - start)

    rates = [batch * args.steps / s for s in seconds]
    if rank == 0:
        print("bench: " + json.dumps({
            "impl": args.impl, "model": args.model, "np": size, "threads": args.threads,
            "samples_per_sec": statistics.median(rates), "spread": [min(rates), max(rates)]}), flush=True)


class EpochTimer(keras.callbacks.Callback):
    """Seconds per fit() epoch; first in the callback list, so hvdp's epoch-end metric averaging is not timed."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


if __name__ == "__main__":
    main()
