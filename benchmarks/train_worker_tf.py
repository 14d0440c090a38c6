"""One Keras/TensorFlow training-throughput measurement, the counterpart of train_worker.py.

`--impl`:
- hvdp-keras: model.fit with hvdp.keras.DistributedOptimizer and hvdp.keras.callbacks(), as hvdp's docs show;
- hvdp-tf: a tf.function custom loop with hvdp.tensorflow.DistributedGradientTape;
- horovod-tf: the same loop averaging each gradient with horovod.tensorflow's allreduce, as its
  DistributedGradientTape does (neither that tape nor horovod.tensorflow.keras works on Keras 3);
- alone: model.fit in one plain process, the reference for scaling efficiency.

hvdp-keras and alone run on either Keras backend, the one KERAS_BACKEND names (`hvdp bench --keras-backend
torch` sets it to torch): on torch, fit reads the numpy batch from a generator and this worker never imports
TensorFlow itself (hvdp.keras does). hvdp-tf and horovod-tf are TensorFlow loops: TensorFlow backend only.

Rank 0 prints `bench: {json}` with the median samples/s per rank and the spread over repetitions; it and each
repetition's record name the backend Keras ran on (`keras_backend`).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models_tf import MODELS  # noqa: E402
from turns import Turns, add_arguments  # noqa: E402

TORCH_IMPLS = ("hvdp-keras", "alone")  # the fit ones; hvdp-tf and horovod-tf are tf.function loops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp-keras", "hvdp-tf", "horovod-tf", "alone"], required=True)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (with --turns: one per turn)")
    add_arguments(p)
    args = p.parse_args()
    backend = keras.backend.backend()
    if backend == "torch":
        if args.impl not in TORCH_IMPLS:
            p.error(f"--impl {args.impl} is a tf.function loop: it runs on Keras's tensorflow backend only, and "
                    f"KERAS_BACKEND is torch here; on torch: {', '.join(TORCH_IMPLS)}")
        return fit_on_torch(args)
    import tensorflow as tf

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
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        seconds = timed_fit(args, rank, model, optimizer, loss_fn, data, batch,
                            hk if args.impl == "hvdp-keras" else None)
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

        turns = Turns.from_args(args, rank)  # set up: from here it runs only in its turns
        turns.wait("warmup")
        step()  # builds the optimizer's state; then every rank starts from rank 0's
        if args.impl == "hvdp-tf":
            htf.broadcast(model, optimizer)
        else:  # hvd.broadcast_variables fails on Keras 3 variables too (it calls assign on a read tensor)
            for i, v in enumerate([*model.variables, *optimizer.variables]):
                v.assign(hvd.broadcast(v.value, root_rank=0, name=f"broadcast.{i}"))
        for _ in range(args.warmup - 1):
            step()
        turns.done("warmup", {})
        seconds = []
        for rep in range(args.reps):
            turns.wait(rep)
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            loss.numpy()
            seconds.append(time.perf_counter() - start)
            turns.done(rep, {"samples_per_sec": batch * args.steps / seconds[-1], "keras_backend": backend})
    report(args, rank, size, batch, seconds)


def fit_on_torch(args):
    """hvdp-keras or alone on Keras's torch backend: the same model, optimizer, loss, batch and turns as on
    TensorFlow, the batch a numpy array that a generator yields forever."""
    import torch

    rank, size, hk = 0, 1, None
    if args.impl == "hvdp-keras":
        import hvdp.keras as hk
        world = hk.init()  # hvdp: horovod.torch (through hvdp.torch.init) on this backend, its runtime defaults
        rank, size = world.rank, world.size
    torch.set_num_threads(args.threads)  # after init, as train_worker.py does (hvdp.torch.init sets its own)

    factory, shape, batch = MODELS[args.model]
    keras.utils.set_random_seed(0)
    model = factory()
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((batch, *shape), dtype=np.float32), rng.integers(0, 10, batch)

    def same_batch():
        while True:
            yield x, y

    seconds = timed_fit(args, rank, model, keras.optimizers.SGD(0.01, momentum=0.9),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True), same_batch(), batch, hk)
    report(args, rank, size, batch, seconds)


def timed_fit(args, rank: int, model, optimizer, loss_fn, data, batch: int, hk=None) -> list[float]:
    """model.fit on `data` (the same batch forever): a warm-up turn, then --reps epochs of --steps steps, one
    per turn; with `hk` (hvdp.keras), its DistributedOptimizer and callbacks. Returns each epoch's seconds."""
    callbacks = []
    if hk is not None:
        optimizer = hk.DistributedOptimizer(optimizer, lr_scaling="none")
        callbacks = hk.callbacks()
    model.compile(optimizer=optimizer, loss=loss_fn)
    turns = Turns.from_args(args, rank)  # set up: from here it runs only in its turns
    turns.wait("warmup")
    # shuffle=False: there is nothing to shuffle (a tf.data.Dataset ignores it; a generator warns without it)
    model.fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0, callbacks=callbacks, shuffle=False)
    turns.done("warmup", {})
    timer = EpochTimer(turns, batch * args.steps)
    model.fit(data, epochs=args.reps, steps_per_epoch=args.steps, verbose=0, callbacks=[timer, *callbacks],
              shuffle=False)
    return timer.seconds


def report(args, rank: int, size: int, batch: int, seconds: list[float]) -> None:
    rates = [batch * args.steps / s for s in seconds]
    if rank == 0:
        print("bench: " + json.dumps({
            "impl": args.impl, "model": args.model, "np": size, "threads": args.threads,
            "keras_backend": keras.backend.backend(),
            "samples_per_sec": statistics.median(rates), "spread": [min(rates), max(rates)]}), flush=True)


class EpochTimer(keras.callbacks.Callback):
    """Seconds per fit() epoch, each epoch one repetition run in its turn; first in the callback list, so
    hvdp's epoch-end metric averaging is not timed."""

    def __init__(self, turns: Turns, samples: int):
        super().__init__()
        self.turns, self.samples, self.seconds = turns, samples, []

    def on_epoch_begin(self, epoch, logs=None):
        self.turns.wait(epoch)
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)
        self.turns.done(epoch, {"samples_per_sec": self.samples / self.seconds[-1],
                                "keras_backend": keras.backend.backend()})


if __name__ == "__main__":
    main()
