"""TensorFlow adapter (custom training loops): plain functions over the core and horovod.tensorflow.

    import hvdp.tensorflow as hvdp_tf
    world = hvdp_tf.init()
    optimizer = hvdp_tf.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))  # LR x size, all-reduce
    data = hvdp_tf.shard((x, y), batch_size=32)       # this rank's batches; a new order every epoch
    hvdp_tf.broadcast(model, optimizer)                # rank 0's weights (and optimizer state) everywhere

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))   # averaged across ranks
        return loss

    for epoch in range(epochs):
        for x, y in data:
            train_step(x, y)
    metrics = hvdp_tf.evaluate(model, (x_test, y_test))    # every test sample counted exactly once

Horovod's own Keras layer (horovod.tensorflow.keras) does not work on Keras 3 (horovod#4290), so nothing
here uses it: gradients are averaged with horovod.tensorflow.grouped_allreduce inside the optimizer's
apply(), which both custom loops and Keras 3's model.fit call inside their compiled step. hvdp.keras builds
its callbacks on the functions of this module.

Run the same script on every rank. Functions marked "every rank must call it" run a collective: a rank that
skips one, or calls them in another order, leaves the others waiting (hvdp's watchdog then ends the job).
Errors are hvdp.core.errors classes, raised on every rank where the check is collective. Importing this
module imports TensorFlow, Keras and horovod.tensorflow, and raises SetupError when Horovod is missing or was
built without TensorFlow.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import tensorflow as tf
import keras

from hvdp import _horovod
from hvdp.core import checkpoint as ckpt
from hvdp.core import consistency
from hvdp.core import devices as _devices
from hvdp.core.errors import CheckpointError, ConfigError, DivergenceError, HvdpError, NonFiniteLossError
from hvdp.core.records import RecordIndex, RecordReader, index_records
from hvdp.core.scaling import lr_multiplier, rescale_lr, warmup_factor
from hvdp.core.sharding import ShardPlan, eval_bounds, eval_metrics
from hvdp.core.world import World

hvd = _horovod.import_horovod("tensorflow")

_COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
FRAMEWORK = "tensorflow"  # the checkpoint tag: hvdp.tensorflow and hvdp.keras write the same format


def init(*, timeline: str | None = None, device: str | None = None, share_gpus: bool | None = None) -> World:
    """Initialise Horovod (horovodrun, mpirun, or plain python as size 1) and return this process's World.

    Every rank must call it (Horovod's init, the watchdog's address exchange and the CPU count are collective); a second
    call returns the World again. Before Horovod starts, hvdp's runtime defaults (hvdp.core.tuning) are set
    where the environment lacks them, and for 2+ ranks the watchdog starts (unless HVDP_WATCHDOG=0 or
    elastic mode). Unless OMP_NUM_THREADS is set, each rank gets an equal share of the CPUs it may use (its
    affinity and cgroup quota, split among the ranks on its host that share them; hvdp.core.cpus) for
    TensorFlow's thread pools (TensorFlow would otherwise start one thread per core in every rank); if an
    op already ran, TensorFlow's pools are kept as they are.

    When TensorFlow sees GPUs, each rank is given its own, GPU local_rank % (GPUs it sees), as the only GPU
    TensorFlow may use, with memory growth on (TensorFlow would otherwise map every GPU's memory in every
    rank); the ranks check that no two of them got the same GPU. Call init() before TensorFlow uses a GPU.

    Args:
        timeline: write Horovod's timeline (Chrome trace of every collective) to this path; default None:
            no timeline.
        device: "auto" (the rank's GPU when TensorFlow sees one, else the CPU), "cpu" (no GPU visible to
            TensorFlow), "cuda" (the rank's GPU, an error without one) or "cuda:N"; default None:
            HVDP_DEVICE, else "auto".
        share_gpus: allow several ranks on one GPU (default None: HVDP_SHARE_GPUS=1, else False).

    Returns:
        This process's World (rank, size, local_rank, local_size).

    Raises:
        SetupError: launched by mpirun or horovodrun's MPI mode, but Horovod was built without MPI.
        ConfigError: a malformed HVDP_SHM_*, HVDP_WATCHDOG_TIMEOUT, HVDP_DEVICE or HVDP_SHARE_GPUS; Keras
            runs on a backend other than TensorFlow (KERAS_BACKEND); a device that cannot be had, ranks
            sharing a GPU unasked, or TensorFlow already using GPUs before init(): on every rank.
    """
    first = not hvd.is_initialized()
    w = _horovod.init("tensorflow", timeline)[1]
    _check_keras_backend(w.rank)
    if first or device is not None:
        _place(w, _devices.request(device, share_gpus))
    if "OMP_NUM_THREADS" not in os.environ:
        threads = _horovod.threads()
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already started its pools (an op ran before init): keep them
            pass
    return w


def world() -> World:
    """This process's World (rank, size, local_rank, local_size); call init() first (Horovod raises before)."""
    return World.from_horovod(hvd)


def _place(w: World, req) -> None:
    """Make only this rank's GPU visible to TensorFlow (none for the CPU), with memory growth."""
    gpus = tf.config.list_physical_devices("GPU")  # does not start TensorFlow's GPU runtime
    env_gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    index = _horovod.place(hvd, w, req, len(gpus), lambda i: f"{env_gpus}#{i}")
    if not gpus:
        return
    try:
        tf.config.set_visible_devices([] if index is None else [gpus[index]], "GPU")
        if index is not None:
            tf.config.experimental.set_memory_growth(gpus[index], True)
    except RuntimeError as e:  # TensorFlow's GPU runtime already started: every GPU is mapped in this rank
        raise ConfigError(f"TensorFlow already used its GPUs before hvdp.tensorflow.init() ({e}): call init() "
                          f"first, before building a model or running an op", rank=w.rank) from e


def _check_keras_backend(rank: int) -> None:
    # Under another Keras backend, model.fit's gradients are that framework's tensors: DistributedOptimizer's
    # TensorFlow all-reduce of them fails inside fit at np>1 (and does nothing visible at np=1). Every rank
    # reads the same KERAS_BACKEND, so every rank raises here, before any collective.
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ConfigError(
            f"Keras runs on the {backend!r} backend (keras.backend.backend()), and hvdp.keras / "
            f"hvdp.tensorflow average TensorFlow gradients only: set KERAS_BACKEND=tensorflow before Keras is "
            f"imported, or train the PyTorch way with hvdp.torch", rank=rank)


def barrier() -> None:
    """Wait until every rank gets here (horovod.tensorflow has no barrier(): a one-number all-reduce is one).

    Every rank must call it; a no-op in a world of size 1. Call init() first.
    """
    if hvd.size() > 1:
        hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="hvdp.barrier")


def _ensure_init() -> World:
    return world() if hvd.is_initialized() else init()


def _check_compression(compression: str) -> None:
    if compression not in _COMPRESSIONS:
        raise ConfigError(f"compression={compression!r} is not one of {', '.join(_COMPRESSIONS)}")


# ------------------------------------------------------------------------------------------- gradients

def allreduce_gradients(grads: Iterable, *, compression: str = "none") -> list:
    """Average gradients over all ranks with one grouped all-reduce; None entries stay None.

    Works eagerly and inside tf.function. fp16 compression halves the bytes on the wire; the result is
    cast back to each gradient's dtype. Every rank must call it, with gradients of the same shapes and
    dtypes, None at the same places. No collective in a world of size 1 or when every entry is None.

    Args:
        grads: the gradients, tensors, tf.IndexedSlices (densified) or None, in a fixed order.
        compression: "none" (default) or "fp16".

    Returns:
        A list of the averaged gradients, in the same order.

    Raises:
        ConfigError: `compression` is not "none" or "fp16".
    """
    _check_compression(compression)
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if hvd.size() == 1 or not present:
        return grads
    dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices (embeddings) densified
    # An explicit name: the default derives from tensor names, which hold Keras's per-process layer
    # counters (a rank that built one more model than the others would wait forever).
    reduced = hvd.grouped_allreduce(dense, op=hvd.Average, compression=_COMPRESSIONS[compression],
                                    name="hvdp_gradients")
    out = list(grads)
    for i, g in zip(present, reduced):
        out[i] = g
    return out


class DistributedGradientTape:
    """Wraps a tf.GradientTape so that gradient() returns gradients averaged over all ranks.

        with tf.GradientTape() as tape:
            loss = ...
        tape = hvdp_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)     # identical on every rank

    For clipping by the global norm, clip these (already averaged) gradients, then apply them with a
    plain optimizer whose rate hvdp_tf.scale_learning_rate set. LR scaling, warmup and accumulation of
    several backward passes live in DistributedOptimizer: a tape cannot hold back an optimizer step.
    Use one or the other, not both (they would average twice: harmless, but twice the traffic).
    Other tape methods (watch, stop_recording, jacobian...) are the wrapped tape's.

    Args:
        tape: the tf.GradientTape that recorded the loss.
        compression: "none" (default) or "fp16" on the wire.

    Raises:
        ConfigError: `compression` is not "none" or "fp16".
    """

    def __init__(self, tape: tf.GradientTape, *, compression: str = "none"):
        _check_compression(compression)
        self._tape = tape
        self._compression = compression

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """tf.GradientTape.gradient, then the gradients averaged over all ranks (allreduce_gradients).

        Every rank must call it, for sources of the same structure, shapes and dtypes.

        Args:
            target: the tensor to differentiate (the loss).
            sources: a variable, or a nested structure of them; the result has the same structure.
            output_gradients: as for tf.GradientTape.gradient (default None).
            kwargs: further keywords for tf.GradientTape.gradient (unconnected_gradients).
        """
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, allreduce_gradients(flat, compression=self._compression))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):  # watch(), stop_recording(), reset(), jacobian()...
        return getattr(self._tape, name)


# ------------------------------------------------------------------------------------------- optimizer

@keras.saving.register_keras_serializable(package="hvdp")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """base(step) x multiplier x warmup factor, the factors computed by hvdp.core.scaling.warmup_factor.

    `step` counts optimizer steps (not backward passes). Serialisable (model.save / load_model).

    Args:
        base: the base rate, a float or another LearningRateSchedule.
        multiplier: hvdp.core.scaling.lr_multiplier's result.
        warmup_steps: optimizer steps over which the rate ramps from base(step) to base(step) * multiplier
            (default 0: no warmup).
    """

    def __init__(self, base, multiplier: float, warmup_steps: int = 0):
        self.base = base
        self.multiplier = float(multiplier)
        self.warmup_steps = int(warmup_steps)
        # The ramp as a table: the core's pure function evaluated once per step, looked up in the graph.
        self._factors = [warmup_factor(s, self.warmup_steps, self.multiplier) for s in range(self.warmup_steps + 1)]

    def __call__(self, step):
        step = tf.cast(step, tf.int64)
        base = self.base(step) if callable(self.base) else self.base
        factor = tf.gather(tf.constant(self._factors, tf.float32), tf.minimum(step, self.warmup_steps))
        return tf.cast(base, tf.float32) * (self.multiplier * factor)

    def get_config(self):
        """Keras serialisation: {"base" (serialised if a schedule), "multiplier", "warmup_steps"}."""
        base = keras.saving.serialize_keras_object(self.base) if callable(self.base) else self.base
        return {"base": base, "multiplier": self.multiplier, "warmup_steps": self.warmup_steps}

    @classmethod
    def from_config(cls, config):
        """Rebuild a ScaledSchedule from get_config()'s `config`."""
        base = config["base"]
        if isinstance(base, dict):
            base = keras.saving.deserialize_keras_object(base)
        return cls(base, config["multiplier"], config["warmup_steps"])


def _rate_owner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    # A LossScaleOptimizer's own rate variable is a 0.0 placeholder: the rate that trains is its inner one's.
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def scale_learning_rate(optimizer: keras.optimizers.Optimizer, multiplier: float, warmup_steps: int = 0) -> None:
    """Scale `optimizer`'s learning rate in place by `multiplier`, ramping from the base rate over
    `warmup_steps` optimizer steps. A float rate stays a (settable) variable when there is no warmup.

    For a LossScaleOptimizer, the rate of the optimizer it wraps is scaled. A LearningRateSchedule, or a
    float with warmup, becomes a ScaledSchedule. DistributedOptimizer already
    does this; call it yourself only with a plain optimizer (e.g. after DistributedGradientTape).

    Args:
        optimizer: a Keras 3 optimizer whose rate is a float or a LearningRateSchedule.
        multiplier: hvdp.core.scaling.lr_multiplier's result.
        warmup_steps: the ramp's length in optimizer steps (default 0: no warmup).

    Raises:
        ConfigError: the optimizer's learning_rate is a plain callable (not a LearningRateSchedule).
    """
    optimizer = _rate_owner(optimizer)
    base = optimizer._learning_rate
    if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = ScaledSchedule(base, multiplier, warmup_steps)
    elif callable(base):
        raise ConfigError("the optimizer's learning_rate is a plain callable; give it a float or a "
                          "keras.optimizers.schedules.LearningRateSchedule so hvdp can scale it")
    else:
        rate = float(keras.ops.convert_to_numpy(base))
        if warmup_steps and multiplier != 1.0:
            optimizer.learning_rate = ScaledSchedule(rate, multiplier, warmup_steps)
        else:
            optimizer.learning_rate = rate * multiplier


def _rescale_learning_rate(optimizer: keras.optimizers.Optimizer, old_multiplier: float,
                           new_multiplier: float) -> None:
    """Make a rate scaled for another world (base x old_multiplier) base x new_multiplier, in place: the
    rate variable is reassigned; a ScaledSchedule is rebuilt with the new multiplier (its warmup ramp too)."""
    if old_multiplier == new_multiplier:
        return
    optimizer = _rate_owner(optimizer)
    lr = optimizer._learning_rate
    if isinstance(lr, ScaledSchedule):  # holds the unscaled base and the multiplier apart
        optimizer._learning_rate = ScaledSchedule(lr.base, new_multiplier, lr.warmup_steps)
    elif isinstance(lr, keras.Variable):
        lr.assign(rescale_lr(float(keras.ops.convert_to_numpy(lr)), old_multiplier, new_multiplier))


@keras.saving.register_keras_serializable(package="hvdp")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer that averages gradients across ranks before the wrapped optimizer applies them.

    - scales the wrapped optimizer's learning rate by the rule (hvdp.core.scaling: `linear` x N*k, `sqrt`,
      `none`) and, with `warmup_steps`, ramps it from the base rate over that many optimizer steps;
    - all-reduces (averages) the gradients with one grouped Horovod all-reduce inside apply(), which
      model.fit and tf.function custom loops call inside their compiled step; `compression="fp16"` halves
      the bytes on the wire;
    - with `backward_passes_per_step=k`, accumulates k calls' gradients locally and, on every k-th call,
      applies their average (all-reduced once): k passes of batch b equal one pass of batch k*b. The
      wrapped optimizer's `iterations` counts optimizer steps, so Adam's bias correction and LR
      schedules see the same steps as one process with the big batch.

    Subclasses Keras's Optimizer only because model.compile requires one; everything is delegated to the
    wrapped optimizer (the same shape as keras.optimizers.LossScaleOptimizer). Calls init() if Horovod is
    not initialised yet. Serialisable (model.save / load_model) without scaling the rate twice. Gradients
    are always averaged: there is no op="sum" or Adasum here.

    Args:
        optimizer: the Keras 3 optimizer to wrap, with the base learning rate (scaled in place).
        lr_scaling: "linear" (default: x size*k), "sqrt" or "none".
        warmup_steps: an integer >= 0: optimizer steps of the ramp from the base rate (default 0).
        compression: "none" (default) or "fp16".
        backward_passes_per_step: k, an integer >= 1 (default 1).
        name: the optimizer's name (default "distributed_<wrapped name>").

    Raises:
        ConfigError: `optimizer` is not a Keras 3 optimizer or is already a DistributedOptimizer; an unknown
            `lr_scaling` or `compression`; `backward_passes_per_step` or `warmup_steps` out of range; the
            wrapped optimizer sets gradient_accumulation_steps; its learning_rate is a plain callable.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, *, lr_scaling: str = "linear",
                 warmup_steps: int = 0, compression: str = "none", backward_passes_per_step: int = 1,
                 name: str | None = None, _scaled: bool = False):
        if not isinstance(optimizer, keras.optimizers.Optimizer) or isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), got "
                              f"{type(optimizer).__name__}; do not wrap twice")
        _check_compression(compression)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ConfigError("the wrapped optimizer has gradient_accumulation_steps set; use "
                              "backward_passes_per_step of DistributedOptimizer instead (it all-reduces once "
                              "per optimizer step)")
        w = _ensure_init()
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self.lr_scaling = lr_scaling
        self.warmup_steps = warmup_steps
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.multiplier = lr_multiplier(lr_scaling, w.size, backward_passes_per_step=backward_passes_per_step)
        if not _scaled:
            scale_learning_rate(optimizer, self.multiplier, warmup_steps)

    def build(self, var_list):
        """Build the wrapped optimizer's state (and the k-pass accumulators) for the variables `var_list`."""
        if self.built:
            return
        var_list = list(var_list)
        self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self._passes = self.add_variable(shape=(), dtype="int64", name="backward_passes")
            self._accumulators = [self.add_variable_from_reference(v, name="hvdp_accumulator") for v in var_list]
        super().build(var_list)

    @property
    def variables(self):
        """This optimizer's variables (the accumulation counter and accumulators), then the wrapped one's."""
        return self._variables[:] + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        """Average `grads` across ranks and apply them with the wrapped optimizer (fit calls it each step).

        With backward_passes_per_step=k, the gradients are summed locally and every k-th call applies
        their average, all-reduced once. Every rank must call it, the same number of times.

        Args:
            grads: one gradient (or None) per variable.
            trainable_variables: the variables, in the same order; needed on the first call, which builds
                the optimizer (default None: the variables it was built with).

        Raises:
            ConfigError: the first call has no `trainable_variables`.
        """
        grads = list(grads)
        if not self.built:
            if trainable_variables is None:
                raise ConfigError("DistributedOptimizer.apply needs trainable_variables on its first call")
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        k = self.backward_passes_per_step
        if k == 1:
            self.inner_optimizer.apply(allreduce_gradients(grads, compression=self.compression), variables)
            return
        index = [self._get_variable_index(v) for v in variables]
        accs = [self._accumulators[i] for i in index]
        self._no_gradient = {i for i, g in zip(index, grads) if g is None}  # for flush(); fixed when traced
        summed = [None if g is None else a + tf.cast(g, a.dtype) for g, a in zip(grads, accs)]
        passes = self._passes.assign_add(1)

        def step():
            averaged = allreduce_gradients([None if s is None else s / k for s in summed],
                                           compression=self.compression)
            self.inner_optimizer.apply(averaged, variables)
            for a in accs:
                a.assign(tf.zeros_like(a))
            return tf.constant(True)

        def accumulate():
            for a, s in zip(accs, summed):
                if s is not None:
                    a.assign(s)
            return tf.constant(False)

        tf.cond(tf.equal(passes % k, 0), step, accumulate)

    def flush(self) -> bool:
        """Apply the passes accumulated since the last step as one step now: an epoch's short last step.

        With backward_passes_per_step=k, an epoch of j*k + r batches leaves r passes accumulated; without
        a flush they would join the next epoch's first step. The gradients of those r passes, weighted by
        shard(weights=True, backward_passes_per_step=k), are all-reduced and applied here, so that step is
        one process's mean over its samples; the next step's passes are counted from zero. Every rank must
        call it, eagerly, after the epoch (hvdp.keras.callbacks does it at each epoch's end).

        Returns:
            Whether a step was applied (False with k == 1 or nothing accumulated).
        """
        k = self.backward_passes_per_step
        if k == 1 or not self.built or int(self._passes.numpy()) % k == 0:
            return False
        skip = getattr(self, "_no_gradient", set())
        summed = [None if i in skip else a / k for i, a in enumerate(self._accumulators)]
        self.inner_optimizer.apply(allreduce_gradients(summed, compression=self.compression),
                                   self._trainable_variables)
        for a in self._accumulators:
            a.assign(tf.zeros_like(a))
        self._passes.assign(0)
        return True

    @property
    def iterations(self):
        """The wrapped optimizer's step counter: optimizer steps, not backward passes."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        """The wrapped optimizer's (scaled) learning rate; setting it sets the wrapped optimizer's."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "inner_optimizer"):  # the base constructor sets its own (unused) rate first
            self.inner_optimizer.learning_rate = value
        else:
            keras.optimizers.Optimizer.learning_rate.fset(self, value)

    def scale_loss(self, loss):
        """The wrapped optimizer's scale_loss(`loss`) (loss scaling for mixed precision)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        """Delegated to the wrapped optimizer (e.g. EMA weights written into `var_list` at fit's end)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        """Keras serialisation: the wrapped optimizer (holding the scaled rate) and the arguments."""
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "lr_scaling": self.lr_scaling, "warmup_steps": self.warmup_steps,
                "compression": self.compression, "backward_passes_per_step": self.backward_passes_per_step,
                "multiplier": self.multiplier}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuild from get_config()'s `config`, resolving `custom_objects`; the saved rate, scaled for the world it
        was saved in, is rescaled to this world's multiplier."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        saved = config.pop("multiplier", None)  # absent in configs written before hvdp saved it
        # The saved inner optimizer holds the rate scaled for the world it was saved in: rescale it to this one.
        opt = cls(inner, _scaled=True, **config)
        opt._saved_multiplier = opt.multiplier if saved is None else float(saved)
        _rescale_learning_rate(inner, opt._saved_multiplier, opt.multiplier)
        return opt

    def load_own_variables(self, store):
        """Keras serialisation: assign the saved variables from `store`, then rescale the restored rate.

        keras.saving.load_model assigns the saved variables after from_config, the rate variable among them
        (base x the saved world's multiplier), so the rate is rescaled to this world's multiplier again.
        """
        super().load_own_variables(store)
        _rescale_learning_rate(self.inner_optimizer, getattr(self, "_saved_multiplier", self.multiplier),
                               self.multiplier)


# ------------------------------------------------------------------------------------------- variables

def _weights(model_or_variables) -> list:
    """The variables that define a model (parameters and statistics such as BatchNorm's), in a fixed order.

    A Keras model's `weights` (seed-generator states, which drive dropout, are per-rank RNG state and are
    not included); a tf.Module's `variables`; or a list of variables as given."""
    if isinstance(model_or_variables, keras.layers.Layer):
        return list(model_or_variables.weights)
    if isinstance(model_or_variables, tf.Module):
        return list(model_or_variables.variables)
    return list(model_or_variables)


def _rng_variables(model) -> list:
    """Per-rank random state of a Keras model: its seed generators' states (dropout masks, noise layers)."""
    if not isinstance(model, keras.layers.Layer):
        return []
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _local_variables(model, optimizer) -> list:
    """State that legitimately differs across ranks and so is saved for every rank, not just rank 0's: the
    seed generators (dropout) and a DistributedOptimizer's local gradient accumulators (mid-accumulation)."""
    local = _rng_variables(model)
    if isinstance(optimizer, DistributedOptimizer) and optimizer.backward_passes_per_step > 1 and optimizer.built:
        local += list(optimizer._accumulators)
    return local


def _trainable(model_or_variables) -> list:
    if isinstance(model_or_variables, (keras.layers.Layer, tf.Module)):
        return list(model_or_variables.trainable_variables)
    return [v for v in model_or_variables if getattr(v, "trainable", True)]


def _name(v) -> str:
    """A variable's structural name: Keras's short name ('kernel'), not its path ('dense_3/kernel'), whose
    layer counters depend on how many models this process built before."""
    return v.name


def _label(v) -> str:
    """The name to show a user: the full path where there is one."""
    return getattr(v, "path", None) or v.name


def _build_optimizer(optimizer, model_or_variables) -> None:
    """Create a Keras optimizer's (zero) state now, exactly as its first apply() would, so it can be
    broadcast or restored before the first step without taking a fake step."""
    if optimizer is not None and not optimizer.built:
        optimizer.build(_trainable(model_or_variables))


def broadcast(model_or_variables, optimizer: keras.optimizers.Optimizer | None = None, root_rank: int = 0) -> None:
    """Copy the model's variables and the optimizer's state from `root_rank` to every rank.

    Call it once before training (and after load_checkpoint is not needed: that already gives every rank
    the same state). A fresh Keras optimizer is built first, so its state exists (all zeros) and the
    first step on every rank starts from rank 0's everything. One broadcast per dtype. Every rank must
    call it, with models of the same variables. Calls init() if Horovod is not initialised yet.

    Args:
        model_or_variables: a Keras model (its weights: parameters and statistics such as BatchNorm's,
            not the dropout seed states), a tf.Module (its variables), or a list of variables.
        optimizer: also copy this Keras optimizer's state, building it first (default None: model only).
        root_rank: the rank whose values everyone gets (default 0).
    """
    _ensure_init()
    _build_optimizer(optimizer, model_or_variables)
    variables = _weights(model_or_variables) + (list(optimizer.variables) if optimizer is not None else [])
    if hvd.size() == 1 or not variables:
        return
    by_dtype: dict[str, list] = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype).name, []).append(v)
    for dtype, group in sorted(by_dtype.items()):
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        flat = hvd.broadcast(flat, root_rank=root_rank, name=f"hvdp.broadcast.{dtype}")
        sizes = [int(np.prod(v.shape)) for v in group]
        for v, part in zip(group, tf.split(flat, sizes)):
            v.assign(tf.reshape(part, v.shape))


# ------------------------------------------------------------------------------------------------ data

class ShardPosition:
    """Where a shard's next iteration starts: `epoch` and the batch `step` within it.

    Each iteration of the dataset takes the current position and moves to the start of the next epoch,
    so the order advances by itself; set() moves it (resume, or hvdp.keras following fit's epoch).

    Args:
        plan: the hvdp.core.sharding.ShardPlan of this rank (the `plan` attribute).
        passes: the backward passes per optimizer step that shard(weights=True)'s gradient weights assume
            (the `passes` attribute, default 1; hvdp.keras.callbacks sets it from the optimizer).
    """

    def __init__(self, plan: ShardPlan, passes: int = 1):
        self.plan = plan
        self.epoch = 0
        self.step = 0
        self.passes = passes  # backward passes per optimizer step that the gradient weights assume

    def set(self, epoch: int, step: int = 0) -> None:
        """Make the next iteration run `epoch` from batch `step` (default 0: the epoch's start)."""
        self.epoch, self.step = int(epoch), int(step)

    def _begin(self) -> tuple[int, int]:
        epoch, step = self.epoch, self.step
        self.epoch, self.step = epoch + 1, 0
        return epoch, step


def _as_arrays(data) -> tuple[np.ndarray, ...]:
    if isinstance(data, tf.data.Dataset):
        if data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ConfigError("shard() needs a finite dataset of samples (not batches, not repeated): its "
                              "samples are indexed by the epoch order; remove .repeat()")
        # Random access by index is what makes the order exact: read the (unbatched) samples once.
        items = list(data.as_numpy_iterator())
        if not items:
            raise ConfigError("shard() got an empty dataset")
        first = items[0]
        if isinstance(first, tuple):
            return tuple(np.stack([it[j] for it in items]) for j in range(len(first)))
        return (np.stack(items),)
    if isinstance(data, (tuple, list)):
        arrays = tuple(np.asarray(a) for a in data)
    else:
        arrays = (np.asarray(data),)
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ConfigError(f"shard() got arrays of different lengths {[len(a) for a in arrays]}; "
                          f"inputs and labels need one entry per sample")
    return arrays


def _gatherer(arrays):
    """A tf.data function from a batch of sample numbers to the tuple of those rows of `arrays`."""
    columns = tuple(tf.convert_to_tensor(a) for a in arrays)  # captured by reference, not in the graph

    def gather(idx):
        return tuple(tf.gather(c, idx) for c in columns)
    return gather


def _record_reader(index: RecordIndex):
    """A tf.data function from a batch of record numbers to the 1-tuple of their serialized records."""
    local = threading.local()  # a reader (its open files) per tf.data thread

    def read(idx):
        reader = getattr(local, "reader", None)
        if reader is None:
            reader = local.reader = RecordReader(index)
        return np.array(reader.read(idx.numpy()), dtype=object)

    def records(idx):
        out = tf.py_function(read, [idx], tf.string)
        out.set_shape([None])
        return (out,)
    return records


def shard(data, *, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
          map=None, num_parallel_calls: int = tf.data.AUTOTUNE, weights: bool = False,
          backward_passes_per_step: int = 1) -> tf.data.Dataset:
    """A tf.data.Dataset of this rank's batches of `data`; `batch_size` is per rank.

    `data` is an array, a tuple of arrays (x, y), a finite tf.data.Dataset of samples (read into memory
    once), or what indexes a dataset too large for memory: file paths (with their labels), or the records
    of TFRecord files (index_records(files)). The epoch order depends only on (seed, epoch), never on
    TensorFlow's global seed; ranks get disjoint slices of each global batch, so N ranks with batch b see at every step
    exactly what one process with batch N*b sees. `map` (decode, augment) runs on each of this rank's
    samples after the split, in parallel and in order, before batching: the pipeline stays tf.data's own
    (no Python per sample), and the returned dataset keeps its `hvdp_position` (a ShardPosition) that says
    and sets where the next iteration starts; transforming the dataset afterwards (.map returns a new
    one) loses it. Each iteration is the next epoch (no set_epoch to forget). Calls init() if needed.

    Args:
        data: the samples, as above; every rank passes the same.
        batch_size: samples per rank per batch, from 1 to len(data) // size.
        shuffle: a new order every epoch (default True).
        seed: the seed of the epoch order (default 0).
        drop_last: drop the last, partial global batch of each epoch (default False: split it evenly).
        map: a function of one sample (its arrays' elements as arguments: map(path, label)) returning the
            sample to batch, in TensorFlow ops (default None: the samples as they are).
        num_parallel_calls: samples that `map` processes at once (default tf.data.AUTOTUNE).
        weights: add each sample's gradient weight as the batch's last element, a float32 vector (default
            False): 1.0 in every step of whole batches; in an epoch's last, partial step the factor that
            makes the ranks' averaged gradient one process's mean over that step's samples
            (ShardPlan.gradient_weight); 0.0 for a sample that only tops a batch up. Weight the per-sample
            loss with it (`loss_fn(y, p, sample_weight=w)`, a mean over the batch); hvdp.keras.shard
            passes it to fit as the sample weight.
        backward_passes_per_step: the k of DistributedOptimizer the weights assume (default 1): k batches
            make a step, grouped from the epoch's start; call its flush() after the epoch for the short
            last group.

    Returns:
        A tf.data.Dataset of batches: tuples of batched arrays, one per input array, or what `map` returns,
        batched; with `weights`, one more element at the end.

    Raises:
        ConfigError: an infinite (repeated) or empty dataset, arrays of different lengths, batch_size < 1,
            fewer samples than ranks, batch_size larger than each rank's share, `map` not callable, or
            backward_passes_per_step not an integer >= 1.
    """
    return _shard(data, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, map=map,
                  num_parallel_calls=num_parallel_calls, weights=weights, passes=backward_passes_per_step)


def _shard(data, *, batch_size, shuffle, seed, drop_last, map, num_parallel_calls, weights, passes,
           finish=None) -> tf.data.Dataset:
    """shard(); `finish`, a function of a batch's elements, runs on each batch before the prefetch."""
    w = _ensure_init()
    if map is not None and not callable(map):
        raise ConfigError(f"shard(map=...) takes a function of one sample, got {type(map).__name__}")
    if not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"shard(backward_passes_per_step=...) must be an integer >= 1, got {passes!r}")
    if isinstance(data, RecordIndex):
        n, samples = len(data), _record_reader(data)
    else:
        arrays = _as_arrays(data)
        n, samples = len(arrays[0]), _gatherer(arrays)
        del arrays
    plan = ShardPlan(n=n, batch_size=batch_size, rank=w.rank, size=w.size, seed=seed, shuffle=shuffle,
                     drop_last=drop_last)
    position = ShardPosition(plan, passes)

    def epoch_indices():
        # One Python call per epoch: the rest is tf.data's. Every batch but the last of an epoch has
        # batch_size samples, so batching the rank's index stream again gives back its batches.
        epoch, start = position._begin()
        batches = list(plan.batches(epoch, start))
        idx = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        if not weights:
            yield idx
            return
        # Steps counted from the epoch's start (offset 0), so a resumed epoch groups its passes as before.
        yield idx, np.concatenate([np.full(len(b), plan.gradient_weight(start + i, 0, position.passes), np.float32)
                                   for i, b in enumerate(batches)] or [np.zeros(0, np.float32)])

    signature = tf.TensorSpec([None], tf.int64)
    if weights:
        signature = (signature, tf.TensorSpec([None], tf.float32))
    dataset = tf.data.Dataset.from_generator(epoch_indices, output_signature=signature)
    dataset = dataset.unbatch().batch(batch_size)
    dataset = dataset.map((lambda idx, wb: (*samples(idx), wb)) if weights else samples,
                          num_parallel_calls=num_parallel_calls, deterministic=True)
    if map is not None:
        user = map
        if weights:  # the user's function sees the sample only; the weight rides along after it
            def user(*element):
                out = map(*element[:-1])
                return (*out, element[-1]) if isinstance(out, tuple) else (out, element[-1])
        dataset = dataset.unbatch().map(user, num_parallel_calls=num_parallel_calls,
                                        deterministic=True).batch(batch_size)
    if finish is not None:
        dataset = dataset.map(finish, num_parallel_calls=num_parallel_calls, deterministic=True)
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    dataset.hvdp_position = position
    return dataset


# ----------------------------------------------------------------------------------------- collectives

def average(value, name: str = "hvdp.average") -> float:
    """The mean of a scalar over all ranks (for metrics and logging). Every rank must call it.

    Args:
        value: a number or a one-element tensor (computed in float64).
        name: the all-reduce's name in Horovod (default "hvdp.average"); every rank must pass the same.

    Returns:
        The mean as a float, the same on every rank.
    """
    t = tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float64), [])
    return float(hvd.allreduce(t, op=hvd.Average, name=name))


def check_finite(loss, step: int) -> None:
    """Raise NonFiniteLossError on every rank if the loss is NaN or inf on any rank (which is named).

    Every rank must call it, at the same steps; eagerly, outside tf.function (it reads the loss's value).

    Args:
        loss: this rank's loss, a scalar tensor or a float.
        step: the step number, shown in the message.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite on at least one rank (raised on every rank).
    """
    value = float(loss)
    flags = hvd.allgather(tf.constant([0.0 if np.isfinite(value) else 1.0], tf.float64), name="hvdp.finite")
    ranks = [int(r) for r in np.flatnonzero(flags.numpy())]
    if ranks:
        raise NonFiniteLossError(
            f"loss is not finite at step {step} on rank(s) {ranks} (loss on this rank: {value}); lower the "
            f"learning rate, enable warmup, or check the data", rank=hvd.rank())


def evaluate(model, data, *, batch_size: int = 256, from_logits: bool = True) -> dict[str, float]:
    """Sparse-categorical loss and accuracy of a classifier over `data` = (x, y), counting every sample
    exactly once on any world size: each rank scores a contiguous, unpadded slice, the sums are all-reduced.
    Returns {"loss", "accuracy", "samples"}. Every rank must call it.

    Args:
        model: a classifier: model(x, training=False) returns (N, classes) logits or probabilities.
        data: (x, y) arrays with integer labels y, the same on every rank.
        batch_size: samples per forward pass on each rank (default 256).
        from_logits: the model outputs logits (default True) or probabilities (False).

    Returns:
        {"loss": mean loss, "accuracy": fraction correct, "samples": len(x)}, the same on every rank.

    Raises:
        ConfigError: `data` is empty (on every rank).
    """
    w = _ensure_init()
    x, y = (np.asarray(a) for a in data)
    start, stop = eval_bounds(len(x), w.rank, w.size)
    sums = np.zeros(3)  # loss sum, correct, count
    for lo in range(start, stop, batch_size):
        xb, yb = x[lo:min(lo + batch_size, stop)], y[lo:min(lo + batch_size, stop)]
        out = model(xb, training=False)
        loss = keras.losses.sparse_categorical_crossentropy(yb, out, from_logits=from_logits)
        pred = np.argmax(keras.ops.convert_to_numpy(out), axis=-1)
        sums += [float(np.sum(keras.ops.convert_to_numpy(loss), dtype=np.float64)), float(np.sum(pred == yb)), len(yb)]
    total = hvd.allreduce(tf.constant(sums, tf.float64), op=hvd.Sum, name="hvdp.evaluate").numpy().tolist()
    return eval_metrics(*total, rank=w.rank)


def log(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (on every process before init()), flushed at once.

    Args:
        args: what to print, as for print().
        kwargs: print()'s keywords (sep, end, file), except flush, which is always True.
    """
    if not hvd.is_initialized() or hvd.rank() == 0:
        print(*args, **kwargs, flush=True)


def check_consistency(model_or_variables) -> None:
    """Raise DivergenceError on every rank if any model variable differs across ranks, naming the first one
    and the ranks that differ from rank 0. Compares exact bytes, so it catches the smallest drift.

    Every rank must call it. One allgather of a sha256 digest per variable, no variable data.

    Args:
        model_or_variables: a Keras model (its weights), a tf.Module (its variables) or a list of variables.

    Raises:
        DivergenceError: a variable's shape or bytes differ from rank 0's on some rank (raised on every rank).
    """
    variables = _weights(model_or_variables)
    digests = [consistency.digest(f"{i}:{_name(v)}", v.shape,
                                  np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
               for i, v in enumerate(variables)]
    problem = consistency.divergence(
        hvd.allgather_object(digests, name="hvdp.consistency"), labels=[_label(v) for v in variables],
        fix="Broadcast the initial state (hvdp.tensorflow.broadcast, or hvdp.keras.callbacks) and avoid "
            "rank-dependent code paths")
    if problem:
        raise DivergenceError(problem, rank=hvd.rank())


# ----------------------------------------------------------------------------------------- checkpoints

def _fingerprint(model_or_variables) -> str:
    return ckpt.fingerprint((f"{i}:{_name(v)}", tuple(int(s) for s in v.shape))
                            for i, v in enumerate(_weights(model_or_variables)))


def _numpy(variables) -> list[np.ndarray]:
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def save_checkpoint(directory: str | Path, model, optimizer: keras.optimizers.Optimizer | None, *, epoch: int,
                    step: int, global_step: int, keep: int = 3, **extra: Any) -> Path | None:
    """Write a checkpoint on rank 0 (atomically) and keep the newest `keep`; every rank must call it.

    The file is a NumPy .npz (read back with allow_pickle=False: no code runs on load) holding the model's
    variables, the optimizer's (its step counter included), every rank's own state (seed generators, which
    drive dropout, and pending accumulated gradients) and a JSON header: hvdp's metadata, the data position
    `epoch`/`step` (batches done in that epoch) and `extra` (JSON values). `global_step` names the file.
    Ends with a barrier: the other ranks wait for the write.

    Args:
        directory: where to write "ckpt-<global_step:08d>.npz"; created if missing.
        model: a Keras model, tf.Module or list of variables.
        optimizer: the Keras optimizer (built first if it is not yet), or None for the model only.
        epoch: the epoch the data position is in.
        step: batches already done in that epoch (0 at an epoch end).
        global_step: the global optimizer step; names the file.
        keep: how many of the newest checkpoints to keep, this one included (default 3).
        extra: JSON values (numbers, strings, lists, dicts) returned by load_checkpoint.

    Returns:
        The path on rank 0, None elsewhere.

    Raises:
        ConfigError: `extra` holds a value that is not JSON, or `keep` is not an integer >= 1 (before any
            collective, on every rank).
        CheckpointError: rank 0 could not write the file (read-only directory, disk full: the path and the
            OS error), on every rank; the older checkpoints are kept.
    """
    ckpt.check_keep(keep)
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ConfigError(f"save_checkpoint extra values must be JSON (numbers, strings, lists, dicts): {e}")
    _build_optimizer(optimizer, model)
    local = hvd.allgather_object(_numpy(_local_variables(model, optimizer)), name="hvdp.local_state")
    if hvd.rank() != 0:
        return _horovod.save_on_root(hvd, directory, "", None, keep)
    weights = _weights(model)
    opt_vars = list(optimizer.variables) if optimizer is not None else []
    header = {"hvdp": ckpt.make_meta(framework=FRAMEWORK, step=global_step, epoch=epoch, world_size=hvd.size(),
                                     model_fingerprint=_fingerprint(model)),
              "position": {"epoch": int(epoch), "step": int(step),
                           "lr_multiplier": getattr(optimizer, "multiplier", None)},
              "model": [_label(v) for v in weights], "optimizer": [_label(v) for v in opt_vars],
              "extra": extra}
    arrays = {"header": np.array(json.dumps(header))}
    arrays.update({f"model/{i:05d}": a for i, a in enumerate(_numpy(weights))})
    arrays.update({f"optimizer/{i:05d}": a for i, a in enumerate(_numpy(opt_vars))})
    for r, states in enumerate(local):
        arrays.update({f"local/{r}/{i:05d}": a for i, a in enumerate(states)})
    return _horovod.save_on_root(hvd, directory, ckpt.checkpoint_name(global_step, "npz"),
                                 lambda f: np.savez(f, **arrays), keep)


def _read(path: Path, model, optimizer, resharding_data: bool) -> dict:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        header = json.loads(str(arrays.pop("header")))
    except OSError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}. The file is corrupt, "
                              f"truncated or not an hvdp TensorFlow checkpoint; delete it to resume from an older one")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not an hvdp checkpoint (no '{ckpt.FORMAT}' header)")
    meta = ckpt.check_meta(header.get("hvdp"), path, framework=FRAMEWORK, model_fingerprint=_fingerprint(model))
    if resharding_data and meta["world_size"] != hvd.size() and header["position"]["step"]:
        raise CheckpointError(
            f"the checkpoint was taken mid-epoch with {meta['world_size']} ranks and this job has {hvd.size()}: "
            f"its data position cannot be resharded exactly; resume with {meta['world_size']} ranks, or from an "
            f"end-of-epoch checkpoint")
    opt_vars = list(optimizer.variables) if optimizer is not None else []
    saved = [arrays.get(f"optimizer/{i:05d}") for i in range(len(header.get("optimizer", [])))]
    if optimizer is not None and ([tuple(a.shape) for a in saved] != [tuple(v.shape) for v in opt_vars]):
        raise CheckpointError(
            f"{path} holds the state of another optimizer ({len(saved)} variables: {header.get('optimizer')[:4]}...; "
            f"this one has {len(opt_vars)}); resume with the optimizer it was saved with, or another checkpoint dir")
    weights = [arrays.get(f"model/{i:05d}") for i in range(len(header["model"]))]
    if any(a is None for a in weights + saved):
        raise CheckpointError(f"{path} is incomplete: arrays listed in its header are missing")
    local: dict = {}
    for key, a in arrays.items():
        if key.startswith("local/"):
            _, r, i = key.split("/")
            local.setdefault(int(r), {})[int(i)] = a
    return {"header": header, "model": weights, "optimizer": saved,
            "local": {r: [d[i] for i in sorted(d)] for r, d in local.items()}}


def load_checkpoint(directory: str | Path | None, model, optimizer: keras.optimizers.Optimizer | None,
                    dataset: tf.data.Dataset | None = None) -> dict | None:
    """Restore the newest checkpoint in `directory` on every rank; None (and nothing changed) if there is none.

    Rank 0 reads the file (np.load with allow_pickle=False) and broadcasts it; a corrupt, truncated or
    foreign file raises CheckpointError naming it, on every rank, and is left as it is. With `dataset` (from
    shard()), its next iteration resumes at the saved epoch and step. Every rank must call it. Each rank's
    own dropout RNG and pending accumulated gradients are restored when the world size is the saved one.

    Args:
        directory: the checkpoint directory; None, a missing directory or one without checkpoints: nothing
            to resume, returns None.
        model: the Keras model, tf.Module or variables to restore (the same names and shapes).
        optimizer: the Keras optimizer to restore (the same kind as saved), or None.
        dataset: the dataset shard() returned, to resume its order (default None: left as it is).

    Returns:
        {"epoch", "step", "global_step", **extra} as saved, or None when there is no checkpoint.

    Raises:
        CheckpointError: the newest file is corrupt, truncated, incomplete, not hvdp's, of another framework,
            model or optimizer; or, with `dataset`, taken mid-epoch with another number of ranks. On every rank.
        ConfigError: `dataset` was not made by shard().
    """
    _ensure_init()
    _build_optimizer(optimizer, model)
    if dataset is not None:
        _position(dataset)  # before any collective: a dataset not made by shard() is refused on every rank
    payload = _horovod.read_checkpoint_on_root(
        hvd, directory, lambda path: _read(path, model, optimizer, dataset is not None), _ARRAYS)
    if payload is None:
        return None
    header, position = payload["header"], payload["header"]["position"]
    same_world = header["hvdp"]["world_size"] == hvd.size()
    for v, a in zip(_weights(model), payload["model"]):
        v.assign(a)
    if optimizer is not None:
        for v, a in zip(optimizer.variables, payload["optimizer"]):
            v.assign(a)
        if isinstance(optimizer, DistributedOptimizer):
            # The rate variable just restored is base x the saved world's multiplier (older files lack it:
            # recompute it from the saved world size with this optimizer's rule); make it base x this world's.
            saved = position.get("lr_multiplier")
            if saved is None:
                saved = lr_multiplier(optimizer.lr_scaling, header["hvdp"]["world_size"],
                                      backward_passes_per_step=optimizer.backward_passes_per_step)
            _rescale_learning_rate(optimizer.inner_optimizer, saved, optimizer.multiplier)
    mine = payload["local"].get(hvd.rank())
    local_vars = _local_variables(model, optimizer)
    if same_world and mine is not None and [a.shape for a in mine] == [tuple(v.shape) for v in local_vars]:
        for v, a in zip(local_vars, mine):  # this rank's own dropout RNG and pending gradient sums
            v.assign(a)
    if dataset is not None:
        _position(dataset).set(position["epoch"], position["step"])
    return {"epoch": position["epoch"], "step": position["step"], "global_step": header["hvdp"]["step"],
            **header["extra"]}


class _NumpyArrays(_horovod.ArrayOps):
    """NumPy arrays for _horovod.broadcast_tree: their bytes, viewed as uint8, go through Horovod's broadcast."""

    def is_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def describe(self, x):
        return tuple(x.shape), x.dtype, x.nbytes

    def empty(self, ref):
        return np.empty(ref.shape, dtype=ref.dtype)

    def fits(self, x, ref) -> bool:
        return isinstance(x, np.ndarray) and x.shape == ref.shape and x.dtype == ref.dtype and x.flags.c_contiguous

    def as_bytes(self, x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    def broadcast(self, hvd_, buffer, name: str) -> None:
        buffer[:] = hvd_.broadcast(tf.constant(buffer), root_rank=0, name=name).numpy()


_ARRAYS = _NumpyArrays()


def _position(dataset) -> ShardPosition:
    position = getattr(dataset, "hvdp_position", None)
    if position is None:
        raise ConfigError("the dataset was not made by hvdp's shard() (or was transformed after it: .map() "
                          "returns a new dataset); pass the dataset shard() returned")
    return position


__all__ = ["init", "world", "barrier", "allreduce_gradients", "DistributedGradientTape", "DistributedOptimizer",
           "ScaledSchedule", "scale_learning_rate", "broadcast", "shard", "index_records", "ShardPosition",
           "average", "check_finite", "evaluate", "log", "check_consistency", "save_checkpoint", "load_checkpoint",
           "HvdpError"]
