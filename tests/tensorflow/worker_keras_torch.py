"""Checks of hvdp.keras on Keras's PyTorch backend (KERAS_BACKEND=torch) that need a real job; run under
horovodrun by tests/tensorflow/test_keras_torch.py. Every assertion holds at any world size."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import hvdp.keras as hk  # noqa: E402
from hvdp.core.errors import ConfigError, DivergenceError, NonFiniteLossError  # noqa: E402
from hvdp.core.sharding import ShardPlan  # noqa: E402
from tests.checks import check, main  # noqa: E402

assert keras.backend.backend() == "torch", keras.backend.backend()
world = hk.init()
import horovod.torch as hvd  # noqa: E402  (hvdp.keras's own Horovod on this backend)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH, STEPS, LEFTOVER, LR, EPOCHS, SEED = 4, 3, 3, 0.05, 2, 7  # LEFTOVER < size*BATCH: a short last step


def _build():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _data():
    n = STEPS * world.size * BATCH + LEFTOVER
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


class _Logs(keras.callbacks.Callback):
    def __init__(self, into):
        super().__init__()
        self.into = into

    def on_epoch_end(self, epoch, logs=None):
        self.into.append(dict(logs))


@check
def init_uses_horovod_torch_only(tmp):
    import horovod.tensorflow as hvd_tf
    assert hvd.is_initialized() and not hvd_tf.is_initialized()
    assert (hk.world().rank, hk.world().size) == (hvd.rank(), hvd.size())


def _fit_against_one_process(build_ranks, build_reference, label, *, data=None, tolerance=1e-5, out=None):
    """Rank-dependent initial weights (the broadcast must fix them), SGD with momentum, two epochs whose last
    step is short (LEFTOVER samples spread over the ranks, weighted by shard's sample weights): fit on every
    rank, then rank 0 trains `build_reference()` from its own initial weights on one process with batch
    size*BATCH in the same order at LR*size, within `tolerance`. Returns the model and the data (`data`, default
    _data()); `out` (a dict) gets rank 0's reference model ("reference")."""
    keras.utils.set_random_seed(SEED + 1000 * world.rank)
    model = build_ranks()
    initial = model.get_weights()
    x, y = _data() if data is None else data
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss=LOSS)
    data = hk.shard((x, y), batch_size=BATCH, seed=SEED)
    local, averaged = [], []
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[_Logs(local), *hk.callbacks(data=data), _Logs(averaged)])
    weights = model.get_weights()
    everyone = hvd.allgather_object([w.tolist() for w in weights], name=f"kt.weights.{label}")
    for other in everyone:
        assert all(np.array_equal(np.asarray(a, np.float32), b) for a, b in zip(other, weights)), "replicas differ"
    losses = hvd.allgather_object([logs["loss"] for logs in local], name=f"kt.losses.{label}")
    for epoch in range(EPOCHS):
        mean = float(np.mean([r[epoch] for r in losses]))
        assert abs(averaged[epoch]["loss"] - mean) < 1e-6, (averaged, losses)
    if world.rank == 0:
        reference = build_reference()
        reference.set_weights(initial)
        reference.compile(optimizer=keras.optimizers.SGD(LR * world.size, momentum=0.9), loss=LOSS)
        plan = ShardPlan(n=len(x), batch_size=BATCH * world.size, seed=SEED)
        for epoch in range(EPOCHS):
            for idx in plan.batches(epoch=epoch):
                reference.train_on_batch(x[idx], y[idx])
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference.get_weights()))
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, initial))
        print(f"[rank 0] keras-torch {label} fit vs one process: max |dw| = {diff:.3g} (weights moved {moved:.3g})",
              file=sys.stderr, flush=True)
        assert moved > 1e-2, moved  # the comparison means something: training changed the weights
        assert diff <= tolerance, diff
        if out is not None:
            out["reference"] = reference
    return model, x, y


@check
def fit_equals_one_process_with_the_global_batch_and_evaluate_counts_each_sample_once(tmp):
    model, x, y = _fit_against_one_process(_build, _build, "dense")
    metrics = hk.evaluate(model, (x, y))  # each rank scores its slice; the sums gathered through horovod.torch
    out = keras.ops.convert_to_numpy(model(x, training=False))
    assert metrics["samples"] == len(x), metrics
    assert abs(metrics["loss"] - float(np.mean(keras.ops.convert_to_numpy(LOSS(y, out))))) < 1e-5, metrics
    assert abs(metrics["accuracy"] - float(np.mean(out.argmax(1) == y))) < 1e-9, metrics


def _with_norm(layer):
    return lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), layer(), keras.layers.Activation("tanh"),
                                     keras.layers.Dense(3)])


@check
def sync_batchnorm_fit_equals_one_process_batchnorm_on_the_global_batch(tmp):
    # N ranks with SyncBatchNormalization on batch b train as one process with BatchNormalization on batch N*b:
    # the statistics (forward) and their gradients (backward) are the global batch's; moving statistics too.
    _fit_against_one_process(_with_norm(hk.SyncBatchNormalization), _with_norm(keras.layers.BatchNormalization),
                             "sync-batchnorm")


OVERFLOW = 5  # the sample that overflows float16


@check
def mixed_precision_fit_equals_one_process_and_a_one_rank_overflow_is_skipped_everywhere(tmp):
    """Under mixed_float16 compile wraps the optimizer in a LossScaleOptimizer, which the callbacks turn into
    DistributedOptimizer(LossScaleOptimizer(SGD)): the skip-on-overflow decision is taken on the averaged gradients,
    the same on every rank. One sample overflows float16 (1e6 > 65504): in each epoch the rank holding it has
    non-finite gradients, the others finite ones, and every rank must skip that step and halve the loss scale, as
    one process with the global batch does. mixed_bfloat16 has no loss scaling. Tolerances: one process's matmuls
    over N*b samples against N over b, rounded to 16 bits (measured 1.2e-4 under float16, 1.8e-3 under bfloat16;
    the weights move by 0.2-0.4)."""
    for policy, tolerance in (("mixed_float16", 1e-3), ("mixed_bfloat16", 1e-2)):
        keras.mixed_precision.set_global_policy(policy)
        try:
            x, y = _data()
            if policy == "mixed_float16":
                x[OVERFLOW, 0] = 1e6  # inf in float16: tanh's forward stays finite, the gradient is NaN
            model, _, _ = _fit_against_one_process(_build, _build, policy, data=(x, y), tolerance=tolerance,
                                                   out=(out := {}))
            dist = model.optimizer
            assert isinstance(dist, hk.DistributedOptimizer), type(dist)
            weights = model.get_weights()
            assert all(np.isfinite(w).all() for w in weights), f"rank {world.rank}: non-finite weights"
            if policy == "mixed_bfloat16":
                assert not isinstance(dist.inner_optimizer, keras.optimizers.LossScaleOptimizer)
                continue
            scaled = dist.inner_optimizer
            assert isinstance(scaled, keras.optimizers.LossScaleOptimizer), type(scaled)
            for epoch in range(EPOCHS):  # the overflowing sample is on one rank only, every epoch
                holders = [r for r in range(world.size) if any(
                    OVERFLOW in idx for idx in ShardPlan(n=len(x), batch_size=BATCH, rank=r, size=world.size,
                                                         seed=SEED).batches(epoch))]
                assert len(holders) == 1, (epoch, holders)
            state = (int(scaled.iterations), float(keras.ops.convert_to_numpy(scaled.dynamic_scale)))
            states = hvd.allgather_object(state, name="kt.mixed.scale")  # before any assert that may differ by rank
            assert len(set(states)) == 1, f"the ranks' (steps taken, loss scale) differ: {states}"
            steps = ShardPlan(n=len(x), batch_size=BATCH, size=world.size).steps_per_epoch
            assert state == (EPOCHS * (steps - 1), scaled.initial_scale / 2 ** EPOCHS), state  # one skip per epoch
            if world.rank == 0:  # as one process with the global batch: the same steps taken, the same scale
                ref = out["reference"].optimizer
                assert state == (int(ref.iterations), float(keras.ops.convert_to_numpy(ref.dynamic_scale))), state
        finally:
            keras.mixed_precision.set_global_policy("float32")


def _fresh(seed, rng):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.3),
                              keras.layers.Dense(3)])
    torch.manual_seed(rng)  # Dropout without a seed draws from torch's RNG on this backend: rank-dependent masks
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), warmup_steps=3), loss=LOSS)
    return model, hk.shard(_data(), batch_size=BATCH, seed=4)


@check
def checkpoint_resume_is_bit_identical(tmp):
    d = Path(hvd.broadcast_object(str(tmp / "resume"), root_rank=0, name="kt.dir"))
    model, data = _fresh(0, rng=50 + world.rank)
    model.fit(data, epochs=3, verbose=0, callbacks=hk.callbacks(data=data))
    uninterrupted = [w.copy() for w in model.get_weights()]

    model, data = _fresh(0, rng=50 + world.rank)  # the run that stops after epoch 1
    model.fit(data, epochs=1, verbose=0, callbacks=hk.callbacks(data=data, checkpoint_dir=d))
    # "restart": other weights, other dropout RNG, a fresh optimizer; fit(epochs=3) resumes from the checkpoint
    model, data = _fresh(seed=7 + world.rank, rng=999)
    cbs = hk.callbacks(data=data, checkpoint_dir=d, keep=2)
    history = model.fit(data, epochs=3, verbose=0, callbacks=cbs)
    assert cbs[0].resumed is not None and cbs[0].resumed["epoch"] == 1, cbs[0].resumed
    assert len(history.history["loss"]) == 2, "fit must continue from epoch 1, not start over"
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), _fresh(0, 0)[0].get_weights()))
    assert moved > 1e-2, moved
    for a, b in zip(model.get_weights(), uninterrupted):
        assert np.array_equal(a, b), f"resumed run differs from the uninterrupted one by {np.max(np.abs(a - b))}"
    steps = ShardPlan(n=len(_data()[0]), batch_size=BATCH, size=world.size).steps_per_epoch
    if world.rank == 0:
        assert sorted(p.name for p in d.iterdir()) == [f"ckpt-{2 * steps:08d}.npz", f"ckpt-{3 * steps:08d}.npz"]


def _raises(error, fn, *args):
    try:
        fn(*args)
    except error as e:
        return str(e)
    raise AssertionError(f"{fn.__name__}{args} raised no {error.__name__} on rank {world.rank}")


@check
def collectives_called_by_hand_go_through_horovod_torch(tmp):
    """average, barrier, broadcast, check_finite and check_consistency of hvdp.keras on this backend: exact
    answers against values computed here from every rank's inputs, horovod.tensorflow never initialised."""
    import horovod.tensorflow as hvd_tf
    last = world.size - 1  # not rank 0: root_rank and the rank named in errors are really passed through

    # average: of rank-dependent values (float, a torch scalar with a gradient, a Keras variable) is the exact mean
    mean = sum(r * 1.5 + 0.25 for r in range(world.size)) / world.size
    assert hk.average(world.rank * 1.5 + 0.25) == mean, (hk.average(world.rank * 1.5 + 0.25), mean)
    loss = (torch.tensor([world.rank * 1.5 + 0.25], requires_grad=True) * 1.0).sum()
    assert hk.average(loss, name="kt.average.tensor") == mean
    assert hk.average(keras.Variable(world.rank * 1.5 + 0.25, dtype="float32"), name="kt.average.variable") == mean

    # barrier: rank r writes its file r * 0.4 s late; after the barrier every rank sees all of them
    d = Path(hvd.broadcast_object(str(tmp / "barrier"), root_rank=0, name="kt.barrier.dir"))
    d.mkdir(parents=True, exist_ok=True)
    time.sleep(0.4 * world.rank)
    (d / str(world.rank)).write_text("here")
    hk.barrier()
    seen = hvd.allgather_object(sorted(p.name for p in d.iterdir()), name="kt.barrier.seen")  # fail on every rank
    assert all(s == sorted(str(r) for r in range(world.size)) for s in seen), f"files seen by each rank: {seen}"

    # broadcast: rank-dependent weights and a fresh optimizer; afterwards everyone holds rank `last`'s weights
    keras.utils.set_random_seed(SEED + 100 * world.rank)
    model = _build()
    optimizer = keras.optimizers.SGD(LR, momentum=0.9)
    mine = [w.copy() for w in model.get_weights()]
    everyone = hvd.allgather_object([w.tolist() for w in mine], name="kt.broadcast.before")
    assert world.size == 1 or not np.array_equal(np.asarray(everyone[0][0]), np.asarray(everyone[last][0]))
    if world.size > 1:  # every rank's weights differ from rank 0's
        msg = _raises(DivergenceError, hk.check_consistency, model)
        assert f"rank(s) {list(range(1, world.size))}" in msg, msg
    hk.broadcast(model, optimizer, root_rank=last)
    for got, want in zip(model.get_weights(), everyone[last]):
        assert np.array_equal(got, np.asarray(want, np.float32)), f"rank {world.rank} did not get rank {last}'s"
    assert optimizer.built and int(optimizer.iterations) == 0, "broadcast built the optimizer without a step"
    hk.check_consistency(model)  # the replicas agree now: no error
    # a list of variables; the bias of the last layer only
    bias = model.layers[-1].bias
    bias.assign(np.full(bias.shape, world.rank, np.float32))
    hk.broadcast([bias])
    assert np.array_equal(keras.ops.convert_to_numpy(bias), np.zeros(bias.shape, np.float32))

    # check_finite: nothing on finite losses; a NaN on rank `last` raises on every rank, naming rank `last`
    hk.check_finite(loss, step=3)
    hk.check_finite(world.rank + 0.5, step=4)
    bad = torch.tensor(float("nan")) if world.rank == last else loss
    msg = _raises(NonFiniteLossError, hk.check_finite, bad, 5)
    assert f"at step 5 on rank(s) [{last}]" in msg, msg
    assert hvd.is_initialized() and not hvd_tf.is_initialized(), "horovod.tensorflow was initialised"


@check
def zoo_cases_equal_one_process_and_unused_variables_are_skipped(tmp):
    # hvdp verify --zoo's Keras cases on this backend (hvdp/tools/zoo_keras.py; the TF custom loop needs
    # TensorFlow's Horovod). fit runs eagerly here: unused_branch's expert has a gradient on the ranks whose batch
    # took its branch and None on the others (before issue 44 the ranks' all-reduces then differed: an error
    # or a stall), and its unused head has none on any rank (AdamW must not decay it, as one process does not).
    from hvdp.tools import zoo_keras

    diffs = {name: zoo_keras.CASES[name](steps=3) for name in ("text_cnn", "unused_branch")}
    print(f"[rank {world.rank}] zoo_keras {diffs}", file=sys.stderr, flush=True)
    assert max(diffs.values()) <= 1e-5, diffs


@check
def evaluate_refuses_a_test_set_ordered_differently_per_rank(tmp):
    keras.utils.set_random_seed(SEED)
    model = _build()
    x, y = _data()
    hk.evaluate(model, (x, y))  # the same everywhere: accepted
    if world.size > 1:
        order = np.random.default_rng(world.rank).permutation(len(x))  # an unseeded shuffle: another order per rank
        msg = _raises(ConfigError, hk.evaluate, model, (x[order], y[order]))
        assert "evaluate() with different data" in msg and "on rank 1" in msg, msg


if __name__ == "__main__":
    main(lambda obj: hvd.allgather_object(obj, name="checks"), world.rank)
