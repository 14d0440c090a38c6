"""hvdp.tensorflow's optimizer: DistributedOptimizer (LR scaling, warmup, all-reduce, k-pass accumulation),
ScaledSchedule and scale_learning_rate."""

from __future__ import annotations

import sys
import warnings

import tensorflow as tf
import keras

from hvdp import _horovod, _keras_backend, _keras_checks, _keras_steps, _keras_stop
from hvdp.core.errors import ConfigError
from hvdp.core.scaling import learning_rate, lr_multiplier
from hvdp.tensorflow.gradients import _check_compression


@keras.saving.register_keras_serializable(package="hvdp")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """base(step) scaled for `size` ranks at each optimizer step: hvdp.core.scaling.learning_rate's rate.

    The rule's multiplier (x size*k, sqrt of it, or 1), reached with `warmup_steps` by a straight line from
    base(step) at step 0. `step` counts optimizer steps (not backward passes). Serialisable (model.save /
    load_model). The base stays apart from the scaling, so a resized job rebuilds it for its own size.

    Args:
        base: the base rate, a float or another LearningRateSchedule.
        lr_scaling: "linear" (default), "sqrt" or "none".
        size: the number of ranks the rate is scaled for (default 1).
        backward_passes_per_step: k, the backward passes per optimizer step (default 1).
        warmup_steps: optimizer steps of the ramp from the base rate (default 0: no warmup).

    Raises:
        ConfigError: an unknown `lr_scaling`; `size` or `backward_passes_per_step` < 1; `warmup_steps` < 0.
    """

    def __init__(self, base, *, lr_scaling: str = "linear", size: int = 1, backward_passes_per_step: int = 1,
                 warmup_steps: int = 0):
        self.base = base
        self.lr_scaling, self.size, self.backward_passes_per_step = lr_scaling, int(size), int(backward_passes_per_step)
        self.warmup_steps = int(warmup_steps)
        # The rate's factor per step as a table: the core's pure function evaluated once per step, looked up in
        # the graph (the last entry holds from the warmup's end on).
        self._factors = [learning_rate(1.0, s, rule=lr_scaling, size=self.size,
                                       backward_passes_per_step=self.backward_passes_per_step,
                                       warmup_steps=self.warmup_steps) for s in range(self.warmup_steps + 1)]

    @property
    def multiplier(self) -> float:
        """The factor past the warmup: hvdp.core.scaling.lr_multiplier of this schedule's rule and world."""
        return self._factors[-1]

    def __call__(self, step):
        if _keras_backend.on_torch():  # Keras's torch backend passes its own tensors: the same lookup in keras.ops
            ops = keras.ops
            step = ops.cast(step, "int64")
            base = self.base(step) if callable(self.base) else self.base
            factor = ops.take(ops.convert_to_tensor(self._factors, "float32"), ops.minimum(step, self.warmup_steps))
            return ops.cast(base, "float32") * factor
        step = tf.cast(step, tf.int64)
        base = self.base(step) if callable(self.base) else self.base
        factor = tf.gather(tf.constant(self._factors, tf.float32), tf.minimum(step, self.warmup_steps))
        return tf.cast(base, tf.float32) * factor

    def get_config(self):
        """Keras serialisation: {"base" (serialised if a schedule), "lr_scaling", "size",
        "backward_passes_per_step", "warmup_steps"}."""
        base = keras.saving.serialize_keras_object(self.base) if callable(self.base) else self.base
        return {"base": base, "lr_scaling": self.lr_scaling, "size": self.size,
                "backward_passes_per_step": self.backward_passes_per_step, "warmup_steps": self.warmup_steps}

    @classmethod
    def from_config(cls, config):
        """Rebuild a ScaledSchedule from get_config()'s `config` (or an older one's multiplier)."""
        config = dict(config)
        base = config.pop("base")
        if isinstance(base, dict):
            base = keras.saving.deserialize_keras_object(base)
        if "multiplier" in config:
            # Written before the rule was stored: m, the multiplier of the averaged gradient, is N*k or its
            # square root, so the sqrt rule at m^2 ranks gives the same rate and warmup exactly.
            m = float(config.pop("multiplier"))
            config.update(lr_scaling="sqrt", size=max(1, round(m * m)), backward_passes_per_step=1)
        return cls(base, **config)


def _rate_owner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    # A LossScaleOptimizer's own rate variable is a 0.0 placeholder: the rate that trains is its inner one's.
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def scale_learning_rate(optimizer: keras.optimizers.Optimizer, *, lr_scaling: str = "linear",
                        size: int | None = None, backward_passes_per_step: int = 1, warmup_steps: int = 0) -> None:
    """Scale `optimizer`'s learning rate in place for `size` ranks by the rule (hvdp.core.scaling.learning_rate),
    ramping from the base rate over `warmup_steps` optimizer steps. A float rate without warmup stays a
    (settable) variable; a LearningRateSchedule, or a float with a warmup, becomes a ScaledSchedule (at every
    world size: a checkpoint then moves between world sizes).

    For a LossScaleOptimizer, the rate of the optimizer it wraps is scaled. DistributedOptimizer already
    does this; call it yourself only with a plain optimizer (e.g. after DistributedGradientTape).

    Args:
        optimizer: a Keras 3 optimizer whose rate is a float or a LearningRateSchedule.
        lr_scaling: "linear" (default: x size*k), "sqrt" or "none".
        size: the number of ranks (default None: this job's, which calls init() if needed).
        backward_passes_per_step: k, the backward passes per optimizer step (default 1).
        warmup_steps: the ramp's length in optimizer steps (default 0: no warmup).

    Raises:
        ConfigError: the optimizer's learning_rate is a plain callable (not a LearningRateSchedule); an
            unknown `lr_scaling`, `size` or `backward_passes_per_step` < 1, `warmup_steps` < 0.
    """
    kw = dict(lr_scaling=lr_scaling, size=_keras_backend.ensure_init().size if size is None else size,
              backward_passes_per_step=backward_passes_per_step, warmup_steps=warmup_steps)
    optimizer = _rate_owner(optimizer)
    base = optimizer._learning_rate
    if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = ScaledSchedule(base, **kw)
    elif callable(base):
        raise ConfigError("the optimizer's learning_rate is a plain callable; give it a float or a "
                          "keras.optimizers.schedules.LearningRateSchedule so hvdp can scale it")
    else:
        rate = float(keras.ops.convert_to_numpy(base))
        schedule = ScaledSchedule(rate, **kw)  # checks the arguments
        optimizer.learning_rate = schedule if warmup_steps else rate * schedule.multiplier


def _rescale_learning_rate(optimizer: keras.optimizers.Optimizer, scaled_by: float, *, lr_scaling: str,
                           size: int, backward_passes_per_step: int, warmup_steps: int) -> None:
    """Make a rate scaled by `scaled_by` (for another world: base x its multiplier) this world's, in place: the
    rate variable is reassigned (hvdp.core.scaling.learning_rate); a ScaledSchedule is rebuilt for `size`."""
    optimizer = _rate_owner(optimizer)
    lr = optimizer._learning_rate
    if isinstance(lr, ScaledSchedule):  # holds the unscaled base apart
        if (lr.lr_scaling, lr.size, lr.backward_passes_per_step, lr.warmup_steps) != (
                lr_scaling, size, backward_passes_per_step, warmup_steps):
            optimizer._learning_rate = ScaledSchedule(lr.base, lr_scaling=lr_scaling, size=size,
                                                      backward_passes_per_step=backward_passes_per_step,
                                                      warmup_steps=warmup_steps)
    elif isinstance(lr, keras.Variable):
        value = float(keras.ops.convert_to_numpy(lr))
        rescaled = learning_rate(value, 0, rule=lr_scaling, size=size,
                                 backward_passes_per_step=backward_passes_per_step, scaled_by=scaled_by)
        if rescaled != value:
            lr.assign(rescaled)


def _refuse_loss_scaling_outside(optimizer) -> None:
    """Make a LossScaleOptimizer that wraps `optimizer` (a custom loop's LossScaleOptimizer(DistributedOptimizer
    (opt)), the order of Keras's mixed-precision guide) raise ConfigError at its apply, before its own
    inf/NaN test, which looks at each rank's own gradients: a rank whose gradients overflow would skip the
    all-reduce the others run, pairing the ranks' all-reduces across steps (loss scales that split, a hang).
    Called from build(), which the outer one calls at its first apply (or its own build): that apply raises
    at once, and the outer one's apply is replaced on this instance by the refusal, so every rank raises at its
    first step, before any all-reduce and outside the outer one's conditional (inside a tf.function TensorFlow
    reports it as a StagingError quoting the ConfigError). model.fit with hvdp.keras.callbacks() swaps the two before the first step and
    never calls the outer one's apply (on Keras's torch backend fit builds it before that)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        outer = frame.f_locals.get("self")
        if isinstance(outer, keras.optimizers.LossScaleOptimizer) and outer.inner_optimizer is optimizer:
            rank = _keras_backend.ensure_init().rank

            def refuse(*args, **kwargs):
                raise ConfigError(
                    "LossScaleOptimizer(DistributedOptimizer(...)): the LossScaleOptimizer checks each rank's own "
                    "gradients for inf/NaN before they are averaged, so a rank whose gradients overflow skips the "
                    "all-reduce the others run (a hang, loss scales that differ). Nest them the other way: hvdp's "
                    "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)) (its scale_loss(loss) "
                    "delegates to the LossScaleOptimizer): the scaled gradients are averaged first and every rank "
                    "takes the same skip", rank=rank)
            object.__setattr__(outer, "apply", refuse)
            while frame is not None:  # built by the outer one's apply: this very step already refuses
                if frame.f_locals.get("self") is outer and frame.f_code.co_name == "apply":
                    refuse()
                frame = frame.f_back
            return
        frame = frame.f_back


@keras.saving.register_keras_serializable(package="hvdp")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """A Keras 3 optimizer that averages gradients across ranks before the wrapped optimizer applies them.

    - scales the wrapped optimizer's learning rate by the rule (hvdp.core.scaling.learning_rate: `linear` x N*k,
      `sqrt`, `none`) and, with `warmup_steps`, ramps it from the base rate over that many optimizer steps
      (a ScaledSchedule at every world size, so that a checkpoint moves between world sizes);
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
    are always averaged: there is no op="sum" or Adasum here. On rank 0 it logs (stderr, one line) what it
    did to the rate and warns (hvdp.core.scaling.LRScalingWarning) when the linear rule meets an adaptive
    optimizer (Adam, AdamW, RMSprop...).

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
        w = _keras_backend.ensure_init()
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self.lr_scaling = lr_scaling
        self.warmup_steps = warmup_steps
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.multiplier = lr_multiplier(lr_scaling, w.size, backward_passes_per_step=backward_passes_per_step)
        if not _scaled:
            _horovod.report_scaling(w.rank, type(optimizer).__name__,
                                    float(keras.ops.convert_to_numpy(optimizer.learning_rate)), rule=lr_scaling,
                                    size=w.size, backward_passes_per_step=backward_passes_per_step,
                                    warmup_steps=warmup_steps)
            scale_learning_rate(optimizer, **self._scaling())

    def _scaling(self) -> dict:
        """hvdp.core.scaling's arguments for this world (see scale_learning_rate)."""
        return dict(lr_scaling=self.lr_scaling, size=_keras_backend.ensure_init().size,
                    backward_passes_per_step=self.backward_passes_per_step, warmup_steps=self.warmup_steps)

    def build(self, var_list):
        """Build the wrapped optimizer's state (and the k-pass accumulators) for the variables `var_list`."""
        if self.built:
            return
        _refuse_loss_scaling_outside(self)
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

    @tf.autograph.experimental.do_not_convert  # plain Python, at the first call (a trace inside a tf.function)
    def _check_fit(self) -> None:
        """At the first apply: refuse a Keras model.fit run without hvdp.keras.callbacks() (_keras_checks)."""
        if not getattr(self, "_hvdp_checked_fit", False):
            self._hvdp_checked_fit = True
            w = _keras_backend.ensure_init()
            _keras_checks.refuse_fit_without_callbacks(self, w.size, w.rank)

    def apply(self, grads, trainable_variables=None):
        """Average `grads` across ranks and apply them with the wrapped optimizer (fit calls it each step).

        With backward_passes_per_step=k, the gradients are summed locally and every k-th call applies
        their average, all-reduced once. Every rank must call it, the same number of times.

        Args:
            grads: one gradient (or None) per variable.
            trainable_variables: the variables, in the same order; needed on the first call, which builds
                the optimizer (default None: the variables it was built with).

        Raises:
            ConfigError: the first call has no `trainable_variables`; the first call runs inside Keras's model.fit
                in a world of 2+ ranks without hvdp.keras.callbacks() (nothing broadcast rank 0's weights).
        """
        grads = _keras_steps.ready(self, list(grads))  # the time since the batch was there: compute (issue 47)
        self._check_fit()
        if not self.built:
            if trainable_variables is None:
                raise ConfigError("DistributedOptimizer.apply needs trainable_variables on its first call")
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        k = self.backward_passes_per_step

        def reduce_then_apply(gradients):  # hvdp.keras's callbacks add a rank's stop_training (hvdp/_keras_stop.py)
            _keras_stop.reduce_then_apply(   # ... and the step's marks (hvdp/_keras_steps.py: issue 47)
                self, gradients, variables,
                lambda averaged: _keras_steps.applied(self, self.inner_optimizer.apply(averaged, variables)),
                lambda g, v: _keras_steps.reduced(
                    self, _keras_backend.allreduce_gradients(g, compression=self.compression, variables=v)))

        if k == 1:
            reduce_then_apply(grads)
            return
        if any(isinstance(g, tf.IndexedSlices) for g in grads) and not getattr(self, "_warned_sparse", False):
            self._warned_sparse = True  # once, when the step is traced (every pass when run eagerly)
            if _keras_backend.ensure_init().rank == 0:
                warnings.warn(
                    "DistributedOptimizer(backward_passes_per_step>1) sums a sparse gradient (an Embedding's "
                    "tf.IndexedSlices) into a dense accumulator: Adam, RMSprop and Adagrad then see each repeated "
                    "row once, not once per occurrence as one process with the k-times larger batch does, so "
                    "they take a slightly different step (SGD the same); with backward_passes_per_step=1 the "
                    "slices are gathered and the step is one process's", stacklevel=2)
        index = [self._get_variable_index(v) for v in variables]
        accs = [self._accumulators[i] for i in index]
        # Which variables had a gradient in a pass since the last step: fixed by the trace inside a tf.function
        # (the same in every pass), a set kept across passes when run eagerly (Keras's torch backend), where a
        # branch taken in one pass only still counts: its accumulated gradient must reach the step.
        eager = self._used_eagerly = _keras_backend.on_torch() or tf.executing_eagerly()
        if eager:
            self._used = getattr(self, "_used", set()) | {i for i, g in zip(index, grads) if g is not None}
        else:
            self._used = {i for i, g in zip(index, grads) if g is not None}
        used = set(self._used)
        summed = [a + keras.ops.cast(g, a.dtype) if g is not None else (a if i in used else None)
                  for i, g, a in zip(index, grads, accs)]
        passes = self._passes.assign_add(1)

        def step():
            reduce_then_apply([None if s is None else s / k for s in summed])
            for a in accs:
                a.assign(keras.ops.zeros_like(a))
            if eager:
                self._used = set()
            return True

        def accumulate():
            for a, s in zip(accs, summed):
                if s is not None:
                    a.assign(s)
            return False

        if _keras_backend.on_torch():  # fit's step runs eagerly there: the counter is read as a number
            step() if int(keras.ops.convert_to_numpy(self._passes)) % k == 0 else accumulate()
        else:  # inside fit's compiled step: a graph conditional
            tf.cond(tf.equal(passes % k, 0), lambda: tf.constant(step()), lambda: tf.constant(accumulate()))

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
        if k == 1 or not self.built or int(keras.ops.convert_to_numpy(self._passes)) % k == 0:
            return False
        used = getattr(self, "_used", set())
        summed = [a / k if i in used else None for i, a in enumerate(self._accumulators)]
        self.inner_optimizer.apply(_keras_backend.allreduce_gradients(summed, compression=self.compression,
                                                                      variables=self._trainable_variables),
                                   self._trainable_variables)
        for a in self._accumulators:
            a.assign(keras.ops.zeros_like(a))
        self._passes.assign(0)
        if getattr(self, "_used_eagerly", False):
            self._used = set()
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
        _rescale_learning_rate(inner, opt._saved_multiplier, **opt._scaling())
        return opt

    def load_own_variables(self, store):
        """Keras serialisation: assign the saved variables from `store`, then rescale the restored rate.

        keras.saving.load_model assigns the saved variables after from_config, the rate variable among them
        (base x the saved world's multiplier), so the rate is rescaled to this world's multiplier again.
        """
        super().load_own_variables(store)
        _rescale_learning_rate(self.inner_optimizer, getattr(self, "_saved_multiplier", self.multiplier),
                               **self._scaling())
