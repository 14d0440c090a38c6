"""Which Horovod hvdp.keras talks through: the one of the framework Keras computes in.

Keras 3 holds its variables and gradients as tensors of its backend (keras.backend.backend(), set by
KERAS_BACKEND before Keras is imported). On the TensorFlow backend they are TensorFlow tensors and every
collective goes through hvdp.tensorflow (horovod.tensorflow), unchanged; on the PyTorch backend they are torch
tensors and the gradient average, the initial broadcast and the rank/size queries go through hvdp.torch
(horovod.torch), whose init() also gives each rank its own GPU as torch's current device (where Keras's torch
backend puts its tensors). Only one of the two Horovods is ever initialised in a process. Any other backend
(JAX, NumPy) is refused at init() with the backends that work.

Everything else (LR scaling, accumulation bookkeeping, the data order, the callbacks) is hvdp.keras's and
hvdp.tensorflow's, shared by both backends; only the transport of the tensors lives here.
"""

from __future__ import annotations

import keras

from hvdp.core.errors import ConfigError
from hvdp.core.world import World

BACKENDS = ("tensorflow", "torch")


def name() -> str:
    """The Keras backend ("tensorflow", "torch", "jax", "numpy")."""
    return keras.backend.backend()


def on_torch() -> bool:
    """Whether Keras runs on its PyTorch backend (KERAS_BACKEND=torch)."""
    return name() == "torch"


def check(rank: int | None = None) -> None:
    """Raise ConfigError unless Keras runs on a backend hvdp.keras supports (every rank reads the same
    KERAS_BACKEND, so every rank raises, before any collective)."""
    backend = name()
    if backend not in BACKENDS:
        raise ConfigError(
            f"Keras runs on the {backend!r} backend (keras.backend.backend()); hvdp.keras works on the "
            f"{' and '.join(repr(b) for b in BACKENDS)} backends: set KERAS_BACKEND=tensorflow or "
            f"KERAS_BACKEND=torch before Keras is imported", rank=rank)


def horovod():
    """The horovod module of the backend (horovod.torch or horovod.tensorflow), not initialised by this."""
    check()
    if on_torch():
        from hvdp.torch.runtime import hvd
    else:
        from hvdp.tensorflow.runtime import hvd
    return hvd


def init(**kwargs) -> World:
    """hvdp.torch.init(**kwargs) on the torch backend, hvdp.tensorflow.init(**kwargs) otherwise."""
    check()
    if on_torch():
        from hvdp.torch.runtime import init as init_
    else:
        from hvdp.tensorflow.runtime import init as init_
    return init_(**kwargs)


def initialised_horovod():
    """The backend's horovod module for a collective now: on the torch backend horovod.torch, initialised
    first (init()) if it is not yet; on TensorFlow horovod.tensorflow as it is (its callers initialise it)."""
    if on_torch():
        ensure_init()
        from hvdp.torch.runtime import hvd
    else:
        from hvdp.tensorflow.runtime import hvd
    return hvd


def ensure_init() -> World:
    """This process's World, initialising the backend's Horovod first if needed (init())."""
    hvd = horovod()
    return World.from_horovod(hvd) if hvd.is_initialized() else init()


def allreduce_gradients(grads: list, *, compression: str = "none", variables: list | None = None) -> list:
    """The gradients averaged over all ranks, as one process would have them for the union batch: on
    TensorFlow hvdp.tensorflow.allreduce_gradients (tf.IndexedSlices stay sparse, gathered). On torch (fit runs
    eagerly there) one grouped all-reduce through horovod.torch of every variable's gradient, zeros where
    this rank has none, with a flag per variable (has a gradient here): a variable no rank has a gradient
    for stays None (the optimizer skips it, as one process does), one that only some ranks have (a branch
    their data took) is averaged with the others' zeros. Every rank must call it, with gradients of the same
    variables in the same order.

    Args:
        grads: one gradient (or None) per variable.
        compression: "none" (default) or "fp16".
        variables: the Keras variables of `grads` (default None); needed on torch when a gradient is None.

    Raises:
        ConfigError: `compression` is not "none" or "fp16"; on torch a gradient is None and `variables` was
            not given.
    """
    if not on_torch():
        from hvdp.tensorflow.gradients import allreduce_gradients as tf_allreduce
        return tf_allreduce(grads, compression=compression, variables=variables)
    import torch

    from hvdp.tensorflow.gradients import _check_compression
    from hvdp.torch.runtime import hvd

    _check_compression(compression)
    grads = list(grads)
    if hvd.size() == 1:
        return grads
    if variables is None and any(g is None for g in grads):
        raise ConfigError("allreduce_gradients got a None gradient but no variables: pass variables=<the Keras "
                          "variables of the gradients>, so that this rank can take part with zeros of their shapes",
                          rank=hvd.rank())
    values = [v.value for v in variables] if variables is not None else grads
    slots = [torch.zeros_like(values[i]) if g is None else g.contiguous() for i, g in enumerate(grads)]
    flags = torch.tensor([float(g is not None) for g in grads], device=slots[0].device,
                         dtype=slots[0].dtype if slots[0].is_floating_point() else torch.float32)
    wire = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[compression]
    # The same explicit name as on TensorFlow: never derived from Keras's per-process layer counters.
    reduced = hvd.grouped_allreduce(slots + [flags], op=hvd.Average, compression=wire, name="hvdp_gradients")
    used = (reduced[-1] > 0).tolist()  # the same on every rank
    return [g if u else None for g, u in zip(reduced[:-1], used)]


def broadcast(model, optimizer=None, root_rank: int = 0) -> None:
    """Copy the model's weights (a Keras model, or a list of its variables) and the optimizer's state (built
    first, no fake step) from `root_rank` to every rank: hvdp.tensorflow.broadcast on TensorFlow; on torch one
    in-place horovod.torch broadcast per dtype of the same variables, after init() if Horovod is not
    initialised yet. Every rank must call it."""
    if not on_torch():
        from hvdp.tensorflow.collectives import broadcast as tf_broadcast
        tf_broadcast(model, optimizer, root_rank=root_rank)
        return
    import torch

    from hvdp.tensorflow.collectives import _build_optimizer, _weights

    hvd = initialised_horovod()  # as hvdp.tensorflow.broadcast: initialises Horovod first if it is not yet
    _build_optimizer(optimizer, model)
    variables = _weights(model) + (list(optimizer.variables) if optimizer is not None else [])
    if hvd.size() == 1 or not variables:
        return
    by_dtype: dict[str, list] = {}
    for v in variables:
        by_dtype.setdefault(str(v.value.dtype), []).append(v)
    with torch.no_grad():
        for dtype, group in sorted(by_dtype.items()):
            flat = torch.cat([v.value.detach().reshape(-1) for v in group])
            hvd.broadcast_(flat, root_rank=root_rank, name=f"hvdp.broadcast.{dtype}")
            for v, part in zip(group, torch.split(flat, [v.value.numel() for v in group])):
                v.assign(part.reshape(v.value.shape))


def _collectives():
    """The collectives module of the backend's adapter: hvdp.torch.collectives on torch (tensors, values and
    messages as hvdp.torch's), hvdp.tensorflow.collectives otherwise. Each implements barrier, average and
    check_finite once for its framework; hvdp.keras only chooses."""
    if on_torch():
        from hvdp.torch import collectives
    else:
        from hvdp.tensorflow import collectives
    return collectives


def barrier() -> None:
    """Wait until every rank gets here, through the backend's Horovod. Every rank must call it."""
    _collectives().barrier()


def average(value, name: str) -> float:
    """The mean of the scalar `value` over the ranks, a float, through the backend's Horovod (all-reduce
    `name`). Every rank must call it."""
    if isinstance(value, keras.Variable):
        value = value.value  # the backend's tensor (torch.as_tensor does not take a Keras variable)
    return _collectives().average(value, name=name)


def check_finite(loss, step: int) -> None:
    """NonFiniteLossError on every rank if `loss` is NaN or inf on any rank (named), at `step`, through the
    backend's Horovod. Every rank must call it."""
    if isinstance(loss, keras.Variable):
        loss = loss.value
    _collectives().check_finite(loss, step)


def allreduce_mean(values: list[float], name: str) -> list[float]:
    """The mean over ranks of each float in `values` (one float64 all-reduce). Every rank must call it."""
    hvd = horovod()
    if on_torch():
        import torch
        tensor = torch.tensor(values, dtype=torch.float64)
    else:
        import tensorflow as tf
        tensor = tf.constant(values, tf.float64)
    return hvd.allreduce(tensor, op=hvd.Average, name=name).numpy().tolist()


def preempted() -> bool:
    """hvdp.torch.preempted() on the torch backend, hvdp.tensorflow.preempted() otherwise (collective)."""
    if on_torch():
        from hvdp.torch.preemption import preempted as preempted_
    else:
        from hvdp.tensorflow.preemption import preempted as preempted_
    return preempted_()


def exit_for_requeue():
    """End this rank with the requeue exit code, saying why on rank 0 (the backend's exit_for_requeue)."""
    if on_torch():
        from hvdp.torch.preemption import exit_for_requeue as exit_
    else:
        from hvdp.tensorflow.preemption import exit_for_requeue as exit_
    exit_()
