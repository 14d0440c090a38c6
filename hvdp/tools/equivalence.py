"""The N x b == 1 x N*b experiment behind `hvdp verify` and the equivalence tests.

Runs inside a launched job. Every rank builds the model from a different seed (so the broadcast is
exercised), trains `steps` optimizer steps through the hvdp adapter on its shard, and rank 0 replays the
same steps as one plain process on the union batches. Returns a dict on every rank:
{"rank", "size", "framework", "optimizer", "steps", "max_abs_diff", "replicas_identical"}. sharded() runs the
torch experiment with sharded optimizer state and through the allreduce path, per optimizer (`hvdp verify
--sharded`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hvdp._horovod import gather_or_raise
from hvdp.core.scaling import lr_multiplier
from hvdp.core.sharding import ShardPlan


def synthetic_data(n: int, input_shape: tuple[int, ...], classes: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *input_shape)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


# The optimizers `hvdp verify` compares (torch), by --optimizer name; each takes param_groups() and nothing else.
WEIGHT_DECAY = 0.01  # the first param group's, with groups=2


def _sgd(groups):
    import torch
    return torch.optim.SGD(groups, momentum=0.9)


def _adam(groups):
    import torch
    return torch.optim.Adam(groups)


def _adamw(groups):
    import torch
    return torch.optim.AdamW(groups)


OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def param_groups(module, lr: float, groups: int = 1) -> list[dict]:
    """One group at `lr`, or 2 as a fine-tuning recipe makes them: the matrices (dim >= 2) at `lr` with weight
    decay WEIGHT_DECAY, the biases and other vectors at lr / 2 without (an empty group is left out)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if groups == 1:
        return [{"params": params, "lr": lr}]
    out = [{"params": [p for p in params if p.dim() >= 2], "lr": lr, "weight_decay": WEIGHT_DECAY},
           {"params": [p for p in params if p.dim() < 2], "lr": lr / 2, "weight_decay": 0.0}]
    return [g for g in out if g["params"]]


def run(framework: str, **kw) -> dict:
    return {"torch": _torch, "tensorflow": _tensorflow, "keras": _keras}[framework](**kw)


def _leftover(leftover: int | None, size: int, batch_size: int) -> int:
    """How many samples the data has beyond whole steps: a last step of fewer than `accumulate` batches, its
    last global batch partial and split unevenly among the ranks (by default N*b - 1 samples: N ranks cannot
    split it evenly), which hvdp weights so that the step is one process's (ShardPlan.gradient_weight)."""
    if leftover is None:
        return size * batch_size - 1 if size > 1 else 0
    return leftover


def _torch(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
           factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None,
           compile: str | None = None, amp: str | None = None, stream: int | None = None,
           shard: bool = False, clip: float | None = None, groups: int = 1, keep: list | None = None) -> dict:
    """`compile`: the ranks train hvdp.torch.compile(model, backend=compile), the reference stays eager.
    `amp` ("bf16" or "fp16"): both sides run the forward pass under torch.autocast of that dtype, fp16 with
    a GradScaler (the recipe of docs/pytorch.md: unscale after the all-reduce).
    `stream` (a number of DataLoader workers, 0 for none): the ranks read the data as a stream of unknown
    length (an IterableDataset) and step after the loop for a short last accumulation; the reference reads
    it in the stream's order.
    `shard`: the ranks train with prepare(..., shard_optimizer_state=True) (ZeRO-1/2).
    `clip`: both sides clip the (averaged) gradients to this global norm before each step (the sharded
    optimizer's clip_grad_norm_, else torch.nn.utils.clip_grad_norm_ after synchronize()).
    `groups`: 1, or 2 param groups (param_groups()) on both sides.
    `keep`: a list the trained model is appended to (every rank), for a comparison between runs."""
    import copy

    import torch
    import torch.nn.functional as F

    import hvdp.torch as ht
    from hvdp.core.errors import DivergenceError

    world = ht.init()
    torch.manual_seed(seed + 1000 * world.rank + 1)  # deliberately different initial weights per rank
    if factory is not None:
        model = factory()
    else:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 32),
                                    torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        classes = model(torch.zeros(2, *input_shape)).shape[-1]  # before the model moves to the rank's device

    def make_optimizer(module, rate):
        return OPTIMIZERS[optimizer](param_groups(module, rate, groups))

    leftover = _leftover(leftover, world.size, batch_size)
    n = steps * accumulate * world.size * batch_size + leftover
    x, y = (torch.from_numpy(a) for a in synthetic_data(n, input_shape, classes, seed))
    where = ht.device()  # the rank's GPU when there is one: both sides compute there
    model.to(where)
    # Rank 0's initial weights are what every rank holds after the broadcast in prepare().
    reference = copy.deepcopy(model) if world.rank == 0 else None

    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]

    def loss_of(module, xb, yb):
        with torch.autocast(where.type, dtype=dtype, enabled=dtype is not None):
            return F.cross_entropy(module(xb.to(where)), yb.to(where))

    def scaler():  # fp16 gradients underflow without loss scaling; bf16 and fp32 need none
        return torch.amp.GradScaler(where.type, enabled=amp == "fp16")

    dist = ht.prepare(model, make_optimizer(model, lr), backward_passes_per_step=accumulate,
                      shard_optimizer_state=shard)
    forward = ht.compile(model, backend=compile) if compile else model
    if stream is None:
        loader = ht.shard(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, seed=seed)
        batches = len(loader)
    else:
        loader = ht.shard(_pair_stream(x, y), batch_size=batch_size, seed=seed, num_workers=stream)
        batches = None  # unknown until the stream ends: the short last step comes after the loop
    scale, i, clipped = scaler(), -1, []

    def clip_(module, opt):  # the global norm of the averaged gradients, as one process clips its own
        if clip is None:
            return
        norm = opt.clip_grad_norm_(clip) if shard and opt is dist else \
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        if opt is dist:
            clipped.append(float(norm) > clip)

    def step():
        if scale.is_enabled() or (clip is not None and not shard):
            dist.synchronize()  # the all-reduce first, then unscale: every rank sees the same inf/NaN
            scale.unscale_(dist)
            clip_(model, dist)
            with dist.skip_synchronize():
                scale.step(dist)
            scale.update()
        else:
            clip_(model, dist)  # sharded: reduce-scatter, then the norm across the shards
            dist.step()
        dist.zero_grad()

    for i, (xb, yb) in enumerate(loader):
        scale.scale(loss_of(forward, xb, yb)).backward()
        if (i + 1) % accumulate == 0 or i + 1 == batches:
            step()
    if batches is None and (i + 1) % accumulate:
        step()

    try:
        ht.check_consistency(model)
        identical = True
    except DivergenceError:
        identical = False

    def reference_diff():  # rank 0 alone: one process with the global batch, from the same initial weights
        if reference is None:
            return None
        ref_opt = make_optimizer(reference, lr * lr_multiplier(
            "linear", world.size, backward_passes_per_step=accumulate))
        plan = ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed, shuffle=stream is None)
        ref_scale = scaler()
        for idx in plan.batches(epoch=0):
            idx = torch.from_numpy(idx)
            ref_scale.scale(loss_of(reference, x[idx], y[idx])).backward()
            ref_scale.unscale_(ref_opt)
            clip_(reference, ref_opt)
            ref_scale.step(ref_opt)
            ref_scale.update()
            ref_opt.zero_grad()
        return max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                              reference.state_dict().values()))

    # An error in rank 0's reference run is raised on every rank (the others would wait for its result).
    diff = gather_or_raise(ht.hvd, reference_diff, name="hvdp.verify.diff", operation="hvdp verify")[0]
    if keep is not None:
        keep.append(model)
    return {"rank": world.rank, "size": world.size, "framework": "torch", "optimizer": optimizer,
            "steps": steps + (1 if leftover else 0), "accumulate": accumulate, "leftover": leftover,
            "compile": compile, "amp": amp, "stream": stream, "device": str(where),
            "sharded": shard, "groups": groups, "clip": clip, "clipped_steps": sum(clipped),
            "parameters": sum(p.numel() for p in model.parameters()),
            "max_abs_diff": diff, "replicas_identical": identical}


def _uneven_mlp(input_shape: tuple[int, ...]):
    """--sharded's default model: 763 parameters at input 20, divisible by neither 2 nor 3. Under
    param_groups(..., 2) the matrices' bucket (725 elements) splits unevenly among 2 and 3 ranks (363/362,
    242/242/241), the vectors' (38) among 3 (13/13/12)."""
    import torch
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 19), torch.nn.Tanh(),
                               torch.nn.Linear(19, 15), torch.nn.Tanh(), torch.nn.Linear(15, 4))


def sharded(*, optimizers: tuple[str, ...], **kw) -> dict:
    """`hvdp verify --sharded`: for each optimizer, the same run through prepare(..., shard_optimizer_state=True)
    and through the allreduce path, from the same initial weights and data, each compared with one process
    (two param groups, clipping when kw has a clip). Returns {"rank", "size", "cases": [...]}: per optimizer
    the sharded run's result, with "allreduce_max_abs_diff" (the allreduce path against one process) and
    "vs_allreduce_max_abs_diff" (the two runs' weights against each other, on this rank)."""
    if kw.get("factory") is None:
        kw["factory"] = functools.partial(_uneven_mlp, kw.get("input_shape", (20,)))
    cases = []
    for name in optimizers:
        trained: list = []
        plain = _torch(optimizer=name, shard=False, keep=trained, **kw)
        result = _torch(optimizer=name, shard=True, keep=trained, **kw)
        unsharded, zero = (m.state_dict().values() for m in trained)
        result["allreduce_max_abs_diff"] = plain["max_abs_diff"]
        result["allreduce_replicas_identical"] = plain["replicas_identical"]
        result["vs_allreduce_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(zero, unsharded))
        cases.append(result)
    return {"rank": cases[0]["rank"], "size": cases[0]["size"], "cases": cases}


def _pair_stream(x, y):
    """(x[i], y[i]) for i in order, as a stream: an IterableDataset without len()."""
    return __getattr__("_PairStream")(x, y)


def __getattr__(name: str):
    # _PairStream is made on first use (this module imports torch only when the torch experiment runs), and
    # found by name, as pickle finds it in the DataLoader's worker processes that shard() starts by forkserver.
    if name != "_PairStream":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    class _PairStream(torch.utils.data.IterableDataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __iter__(self):
            return zip(self.x, self.y)

    _PairStream.__module__, _PairStream.__qualname__ = __name__, "_PairStream"
    globals()["_PairStream"] = _PairStream
    return _PairStream


def _keras_setup(framework: str, *, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float,
                 seed: int, factory, input_shape: tuple[int, ...], leftover: int | None):
    """What the TensorFlow and Keras experiments share: rank-dependent model, data, rank 0's reference copy.
    "keras" runs on Keras's backend (KERAS_BACKEND: TensorFlow or torch, the ranks and the reference alike)."""
    import keras

    if framework == "keras":
        import hvdp.keras as hk
        world = hk.init()  # horovod.torch on Keras's torch backend, horovod.tensorflow on TensorFlow
    else:
        import hvdp.tensorflow as htf
        world = htf.init()

    def build():
        if factory is not None:
            return factory()
        return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                                 keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])

    makers = {"sgd": lambda rate: keras.optimizers.SGD(rate, momentum=0.9), "adam": keras.optimizers.Adam,
              "adamw": keras.optimizers.AdamW}  # hvdp verify's OPTIMIZERS; AdamW with Keras's weight decay

    def make_optimizer(rate):
        return makers[optimizer](rate)

    keras.utils.set_random_seed(seed + 1000 * world.rank + 1)  # deliberately different weights (and TF seed) per rank
    model = build()
    classes = int(model.output_shape[-1])
    leftover = _leftover(leftover, world.size, batch_size)
    n = steps * accumulate * world.size * batch_size + leftover
    x, y = synthetic_data(n, input_shape, classes, seed)
    reference = None
    if world.rank == 0:  # rank 0's initial weights are what every rank holds after the broadcast
        reference = build()
        reference.set_weights(model.get_weights())
    multiplier = lr_multiplier("linear", world.size, backward_passes_per_step=accumulate)
    return world, model, reference, make_optimizer, x, y, n, multiplier, leftover


def _keras_result(framework, world, model, reference, x, y, n, *, batch_size, accumulate, optimizer,
                  optimizer_class, steps, seed, leftover, replay) -> dict:
    import numpy as np_

    import hvdp.tensorflow as htf
    from hvdp import _keras_backend
    from hvdp.core.errors import DivergenceError

    try:
        htf.check_consistency(model)
        identical = True
    except DivergenceError:
        identical = False
    def reference_diff():  # rank 0 alone; an error there is raised on every rank
        if reference is None:
            return None
        plan = ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed)
        for idx in plan.batches(epoch=0):
            replay(x[idx], y[idx])
        return max(float(np_.max(np_.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights()))

    # hvdp.keras's Horovod is the one of Keras's backend (horovod.torch on torch); the custom loop's is TensorFlow's.
    horovod = _keras_backend.horovod() if framework == "keras" else htf.hvd
    diff = gather_or_raise(horovod, reference_diff, name="hvdp.verify.diff", operation="hvdp verify")[0]
    extra = {"keras_backend": _keras_backend.name()} if framework == "keras" else {}
    return {"rank": world.rank, "size": world.size, "framework": framework, "optimizer": optimizer,
            "optimizer_class": optimizer_class, "steps": steps + (1 if leftover else 0), "accumulate": accumulate,
            "leftover": leftover, "max_abs_diff": diff, "replicas_identical": identical, **extra}


def _tensorflow(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
                factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None) -> dict:
    """A tf.function custom loop: plain GradientTape + hvdp.tensorflow.DistributedOptimizer, the loss
    weighted by shard(weights=True), flush() after the epoch (docs/tensorflow-keras.md)."""
    import keras
    import tensorflow as tf

    import hvdp.tensorflow as htf

    world, model, reference, make_optimizer, x, y, n, multiplier, leftover = _keras_setup(
        "tensorflow", optimizer=optimizer, steps=steps, batch_size=batch_size, accumulate=accumulate, lr=lr,
        seed=seed, factory=factory, input_shape=input_shape, leftover=leftover)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inner = make_optimizer(lr)
    dist = htf.DistributedOptimizer(inner, backward_passes_per_step=accumulate)
    htf.broadcast(model, dist)

    @tf.function
    def train_step(xb, yb, wb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True), sample_weight=wb)
        variables = model.trainable_variables
        dist.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for xb, yb, wb in htf.shard((x, y), batch_size=batch_size, seed=seed, weights=True,
                                backward_passes_per_step=accumulate):
        train_step(xb, yb, wb)
    dist.flush()

    ref_opt = make_optimizer(lr * multiplier) if reference is not None else None

    def replay(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, reference(xb, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))

    return _keras_result("tensorflow", world, model, reference, x, y, n, batch_size=batch_size,
                         accumulate=accumulate, optimizer=optimizer, optimizer_class=type(inner).__name__,
                         steps=steps, seed=seed, leftover=leftover, replay=replay)


def _keras(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
           factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None) -> dict:
    """Keras 3 model.fit with hvdp.keras's optimizer, shard and callbacks; the reference uses train_on_batch. Both
    run on Keras's backend (KERAS_BACKEND, which `hvdp verify --keras-backend` sets before Keras is imported)."""
    import keras

    import hvdp.keras as hk

    world, model, reference, make_optimizer, x, y, n, multiplier, leftover = _keras_setup(
        "keras", optimizer=optimizer, steps=steps, batch_size=batch_size, accumulate=accumulate, lr=lr,
        seed=seed, factory=factory, input_shape=input_shape, leftover=leftover)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inner = make_optimizer(lr)
    model.compile(optimizer=hk.DistributedOptimizer(inner, backward_passes_per_step=accumulate), loss=loss_fn)
    data = hk.shard((x, y), batch_size=batch_size, seed=seed)
    model.fit(data, epochs=1, verbose=0, callbacks=hk.callbacks(data=data))
    if reference is not None:
        reference.compile(optimizer=make_optimizer(lr * multiplier), loss=loss_fn)
    return _keras_result("keras", world, model, reference, x, y, n, batch_size=batch_size, accumulate=accumulate,
                         optimizer=optimizer, optimizer_class=type(inner).__name__, steps=steps, seed=seed,
                         leftover=leftover, replay=lambda xb, yb: reference.train_on_batch(xb, yb))
