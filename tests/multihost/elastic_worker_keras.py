"""Elastic Keras worker for test_elastic.py, through hvdp.keras's ElasticState and elastic_run (Keras 3 on the
TensorFlow backend): the Keras twin of elastic_worker.py.

The model's train step records the ids of the samples it trained on (an id column its first layer drops), and
a callback that runs before the state's commit (every 3 batches: a failure rolls back up to 2) allgathers them
into the elastic state itself, so the final state says exactly what the final model learned from: the test
checks that each epoch covers every sample exactly once although the world changed size mid-epoch. Rank 0 appends a progress line per step to
--progress (the test watches it to act mid-epoch) and writes --result at the end.

The first --epochs epochs are one state.fit call, so its callbacks span the reset (issue 50 row 8): an
EarlyStopping on a value that never improves (its best stays epoch 0, its wait counts every epoch) and a
CSVLogger (one header, a row per epoch, none rewritten) continue from the last commit, not anew.
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp.keras as hk  # noqa: E402
from elastic_args import parse_args  # noqa: E402

PENDING: list[int] = []  # ids of the samples this rank's train steps took since the last batch end


class Recording(keras.Model):
    """A functional model whose train step also records the ids in the input's last column."""

    def train_step(self, data):
        x = data[0]
        tf.py_function(lambda ids: PENDING.extend(int(i) for i in ids.numpy()), [x[:, -1]], [])
        return super().train_step(data)


class Record(keras.callbacks.Callback):
    """Moves the step's ids (all ranks') into state.seen before the commit that follows it."""

    def __init__(self, state, progress):
        super().__init__()
        self.state, self.progress = state, progress

    def on_train_batch_begin(self, batch, logs=None):
        PENDING.clear()  # a step that failed with its peer may have recorded its ids

    def on_train_batch_end(self, batch, logs=None):
        epoch = self.state.epoch
        batches = hk.hvd.allgather_object(list(PENDING), name="test.seen")
        PENDING.clear()
        # A new dict and list, not the committed ones changed in place: a rollback to the last commit
        # (ElasticState.restore) then also forgets the steps after it, as it makes the model forget them.
        seen = [*self.state.seen.get(epoch, []), *(i for b in batches for i in b)]
        self.state.seen = {**self.state.seen, epoch: seen}
        if hk.hvd.rank() == 0:
            with open(self.progress, "a") as f:
                f.write(json.dumps({"size": hk.hvd.size(), "epoch": epoch, "offset": len(seen),
                                    "batches": batches}) + "\n")


class Flat(keras.callbacks.Callback):
    """A monitored value that never improves, for EarlyStopping to count epochs with."""

    def on_epoch_end(self, epoch, logs=None):
        logs["flat"] = 1.0


def main():
    args = parse_args()

    hk.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int64)
    x = np.concatenate([x, np.arange(args.samples, dtype=np.float32)[:, None]], axis=1)  # the id column
    inputs = keras.Input((9,))
    model = Recording(inputs, keras.layers.Dense(2)(keras.layers.Lambda(lambda t: t[:, :8])(inputs)))
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = hk.shard((x, y), batch_size=args.batch_size)
    state = hk.ElasticState(model, data, seen={}, sizes=[], lrs={})
    record = Record(state, args.progress)
    early = keras.callbacks.EarlyStopping(monitor="flat", mode="min", patience=100)
    csv_path = os.path.join(os.path.dirname(args.result), "epochs.csv")
    callbacks = [record, Flat(), early, keras.callbacks.CSVLogger(csv_path)]
    spanned = {}  # EarlyStopping at the end of the fit call of the first --epochs epochs

    def readmitted(sizes):
        return any(a > b < c for a, b, c in zip(sizes, sizes[1:], sizes[2:]))

    def shrunk(sizes):
        return any(a > b for a, b in zip(sizes, sizes[1:]))

    @hk.elastic_run
    def train(state):
        size = hk.hvd.size()
        if not state.sizes or state.sizes[-1] != size:
            state.sizes.append(size)
        state.lrs[size] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        if state.epoch < args.epochs:  # one call, across any reset in it
            state.fit(epochs=args.epochs, commit_every=3, callbacks=callbacks, verbose=0)
            spanned.update(best_epoch=early.best_epoch, wait=early.wait)
        while (state.position[1] or (args.until_readmitted and not readmitted(state.sizes))
               or (args.until_shrunk and not shrunk(state.sizes))):
            # then one epoch at a time: the loop condition is checked
            state.fit(epochs=state.epoch + 1, commit_every=3, callbacks=[record], verbose=0)

    train(state)
    if hk.hvd.size() > 1:
        hk.check_consistency(model)
    if hk.hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"sizes": state.sizes, "lrs": state.lrs, "seen": state.seen, "samples": args.samples,
                       "early_stopping": spanned, "csv": open(csv_path).read().splitlines()}, f)


if __name__ == "__main__":
    main()
