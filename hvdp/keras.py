"""Keras 3 adapter for model.fit, built on hvdp.tensorflow (horovod.tensorflow.keras is not used: it does
not work on Keras 3, horovod#4290, and Keras 3's trainer never calls the hooks where it averaged gradients).

    import hvdp.keras as hvdp_keras
    world = hvdp_keras.init()
    model.compile(optimizer=hvdp_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                            warmup_steps=20),
                  loss=..., metrics=["accuracy"])
    train = hvdp_keras.shard((x, y), batch_size=32)          # this rank's batches, new order every epoch
    model.fit(train, epochs=10, callbacks=hvdp_keras.callbacks(data=train, checkpoint_dir="ckpt"))

The optimizer averages gradients inside the compiled train step (model.fit calls its apply()); the
callbacks broadcast rank 0's initial state before the first step, make the data order follow fit's epoch,
average the epoch metrics over ranks, write/resume checkpoints (rank 0, atomic) and keep the progress bar
on rank 0. Every rank runs the same script and the same model.fit. DistributedOptimizer, ScaledSchedule,
evaluate, check_consistency, save_checkpoint, load_checkpoint and log are hvdp.tensorflow's (documented there
too); average, barrier, broadcast and check_finite are this module's, through the Horovod of Keras's backend:
a Keras script needs no other module. Errors are hvdp.core.errors classes.

Backends: TensorFlow, and PyTorch (KERAS_BACKEND=torch): there init() initialises horovod.torch (through
hvdp.torch.init) and never horovod.tensorflow, the optimizer averages the torch gradients fit hands it with
horovod.torch, and the broadcast, metrics, evaluate, log, checkpoints, SyncBatchNormalization and the
functions called by hand (average, barrier, broadcast, check_finite, check_consistency) go through it too
(hvdp/_keras_backend.py chooses); backward_passes_per_step > 1 accumulates eagerly there. Any other
backend is a ConfigError at init(). docs/tensorflow-keras.md#keras-on-the-pytorch-backend says what was tested.

Elastic fit (TensorFlow backend): ElasticState and elastic_run, from hvdp/keras_elastic.py (docs/elastic.md).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from hvdp import _keras_backend, _keras_checks, _keras_data, _keras_rank0, _keras_steps, _keras_stop, _preemption
from hvdp.core import checkpoint as ckpt
from hvdp.core.errors import ConfigError, HvdpError
from hvdp.core.world import World
from hvdp.tensorflow import (  # noqa: F401  (the shared implementation, re-exported)
    DistributedOptimizer,
    ScaledSchedule,
    check_consistency,
    evaluate,
    hvd,
    index_records,
    load_checkpoint,
    log,
    save_checkpoint,
)
from hvdp.tensorflow.data import _position, _shard
from hvdp.tensorflow.evaluation import _summed_metric_results
from hvdp.tensorflow.tracking import watched


def init(*, timeline: str | None = None, device: str | None = None, share_gpus: bool | None = None,
         preemption: bool | None = None) -> World:
    """Initialise Horovod and return this process's World: hvdp.tensorflow.init on Keras's TensorFlow backend
    (which also gives each rank its own GPU when TensorFlow sees GPUs), hvdp.torch.init on its torch backend
    (horovod.torch; the rank's GPU becomes torch's current device, where Keras puts its tensors).

    Every rank must call it, before TensorFlow uses a GPU. Safe to call twice.

    Args:
        timeline: write Horovod's timeline (Chrome trace of every collective) to this path (default None).
        device: "auto", "cpu", "cuda" or "cuda:N" (default None: HVDP_DEVICE, else "auto").
        share_gpus: allow several ranks on one GPU (default None: HVDP_SHARE_GPUS=1, else False).
        preemption: True: on SIGTERM or SIGUSR1 the callbacks (with a checkpoint_dir) stop every rank after the
            same step, write a checkpoint and exit with 75 for a requeue (see callbacks()); default None:
            HVDP_PREEMPTION=1, else False.

    Raises:
        SetupError: launched by an MPI launcher, but Horovod was built without MPI.
        ConfigError: Keras runs on a backend other than TensorFlow or PyTorch (JAX, NumPy); a malformed HVDP_*
            environment variable, a device that cannot be had, or ranks sharing a GPU unasked (see
            hvdp.tensorflow.init); preemption outside the main thread or in elastic mode.
    """
    return _keras_backend.init(timeline=timeline, device=device, share_gpus=share_gpus, preemption=preemption)


def world() -> World:
    """This process's World (rank, size, local_rank, local_size); call init() first (Horovod raises before)."""
    return World.from_horovod(_keras_backend.horovod())


def barrier() -> None:
    """Wait until every rank gets here, through the Horovod of Keras's backend (horovod.torch's barrier on
    torch, a one-number horovod.tensorflow all-reduce on TensorFlow).

    Every rank must call it; a no-op in a world of size 1. Call init() first.
    """
    _keras_backend.barrier()


def average(value, name: str = "hvdp.average") -> float:
    """The mean of a scalar over all ranks (for metrics and logging), through the Horovod of Keras's backend.
    Every rank must call it. Call init() first.

    Args:
        value: a number, a one-element tensor of Keras's backend (a torch tensor on torch, detached) or a
            Keras variable; computed in float64.
        name: the all-reduce's name in Horovod (default "hvdp.average"); every rank must pass the same.

    Returns:
        The mean as a float, the same on every rank.
    """
    return _keras_backend.average(value, name)


def broadcast(model_or_variables, optimizer: keras.optimizers.Optimizer | None = None, root_rank: int = 0) -> None:
    """Copy the model's variables and the optimizer's state from `root_rank` to every rank, through the
    Horovod of Keras's backend (callbacks() already does it before the first step; call it for a model
    trained without them).

    A fresh Keras optimizer is built first, so its state exists (all zeros) and no fake step is taken. One
    broadcast per dtype. Every rank must call it, with models of the same variables. Calls init() if
    Horovod is not initialised yet.

    Args:
        model_or_variables: a Keras model (its weights: parameters and statistics such as BatchNorm's, not
            the dropout seed states) or a list of Keras variables (a tf.Module's variables on TensorFlow).
        optimizer: also copy this Keras optimizer's state, building it first (default None: model only).
        root_rank: the rank whose values everyone gets (default 0).
    """
    _keras_backend.broadcast(model_or_variables, optimizer, root_rank=root_rank)


def check_finite(loss, step: int) -> None:
    """Raise NonFiniteLossError on every rank if the loss is NaN or inf on any rank (which is named), through
    the Horovod of Keras's backend (one one-element allgather).

    Every rank must call it, at the same steps, eagerly (in a callback, or on a value fit returned: it reads
    the loss's value). Call init() first.

    Args:
        loss: this rank's loss: a float, a scalar tensor of Keras's backend or a Keras variable.
        step: the step number, shown in the message.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite on at least one rank (raised on every rank).
    """
    _keras_backend.check_finite(loss, step)


def shard(data, *, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False, map=None,
          num_parallel_calls: int = tf.data.AUTOTUNE, sample_weights: bool = True) -> tf.data.Dataset:
    """A dataset of this rank's batches for model.fit; `batch_size` is per rank (do not pass one to fit).

    The epoch order depends only on (seed, epoch), not on TensorFlow's global seed, so one process with
    batch N*b sees at every step the union of what N ranks see with batch b. Pass the dataset to
    callbacks(data=...) too: the order then follows fit's epoch number, so a resumed fit continues exactly.
    The dataset declares its number of batches (the steps per epoch), which fit's progress bar needs.
    Every rank must call it, with the same data and settings: they are compared across the ranks, and a
    mismatch (seed=rank, one file more) is a ConfigError on every rank (see hvdp.tensorflow.shard).

    Its batches are (x, y, sample_weight): the weights (hvdp.tensorflow.shard's `weights`) are 1.0 except in
    an epoch's last, partial step, where they make that step one process's step on the same samples
    (callbacks(data=...) matches them to the optimizer's backward_passes_per_step). Data with its own
    sample weights, (x, y, sw), gets sw times them; data of one array (x) gets none. They are shaped
    (b, 1, ..., 1) to each target's rank, so per-timestep and per-pixel losses are weighted along the batch
    axis, and fit(class_weight=...) multiplies Keras's class weights into them (hvdp/_keras_data.py).

    Args:
        data: an array, a tuple of arrays (x, y), a finite tf.data.Dataset of samples, file paths with
            their labels, or index_records(files); the same on every rank (see hvdp.tensorflow.shard).
        batch_size: samples per rank per batch, from 1 to len(data) // size.
        shuffle: a new order every epoch (default True).
        seed: the seed of the epoch order (default 0).
        drop_last: drop the last, partial global batch of each epoch (default False: split it evenly).
        map: a function of one sample run after the split, in parallel and in order (decode, augment).
        num_parallel_calls: samples that `map` processes at once (default tf.data.AUTOTUNE).
        sample_weights: add the weights (default True); False yields (x, y) as they are, for a custom
            train_step that unpacks two elements (the last, partial step is then not weighted exactly).

    Raises:
        ConfigError: see hvdp.tensorflow.shard (ranks with other data or settings, empty or infinite data, a
            batch size that does not fit).
    """
    seen: dict = {}  # whether the data carried its own sample weights (_keras_data.finisher)
    dataset = _shard(data, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, map=map,
                     num_parallel_calls=num_parallel_calls, weights=sample_weights, passes=1,
                     finish=_keras_data.finisher(seen) if sample_weights else None,
                     horovod=_keras_backend.initialised_horovod() if _keras_backend.on_torch() else None)
    position, batches = dataset.hvdp_position, dataset
    # Keras needs the number of batches to show progress and to end each epoch.
    dataset = watched(batches.apply(tf.data.experimental.assert_cardinality(position.plan.steps_per_epoch)))
    if sample_weights:  # fit(class_weight=...) folds the class weights into hvdp's
        dataset = _keras_data.accept_class_weight(dataset, seen, watched)
    dataset.hvdp_position = position
    dataset.hvdp_seen = seen
    dataset.hvdp_batches = batches  # unsized: ElasticState sizes it for the rest of an epoch in a changed world
    return dataset


def _hvd():
    """The horovod module of Keras's backend: horovod.torch on torch, horovod.tensorflow otherwise."""
    return _keras_backend.horovod()


class _RankZeroProgbar(keras.callbacks.ProgbarLogger):
    """fit's progress bar, silent on every rank but 0 (fit adds its own only when the list has none)."""

    def set_params(self, params):
        super().set_params(params)
        if _hvd().rank() != 0:
            self.verbose = 0


def _loss_scaling_inside(model):
    """The optimizer fit must use: under mixed_float16, compile wraps DistributedOptimizer(opt) in a
    LossScaleOptimizer, which checks every rank's own scaled gradients for inf/NaN before they are averaged:
    ranks then disagree on skipping a step (and one waits in an all-reduce the other never starts). Turn
    LossScaleOptimizer(DistributedOptimizer(opt)) into DistributedOptimizer(LossScaleOptimizer(opt)): the
    scaled gradients are averaged first, so every rank sees the same values and takes the same skip
    decision, and they are unscaled after. A DistributedOptimizer already holding a LossScaleOptimizer only
    loses compile's extra wrapper (it would scale the loss twice).

    On Keras's torch backend fit builds the optimizers (no step) before the callbacks run: the new
    LossScaleOptimizer is then built here, so that the broadcast and checkpoints hold its variables as on
    TensorFlow."""
    outer = model.optimizer
    if not (isinstance(outer, keras.optimizers.LossScaleOptimizer)
            and isinstance(outer.inner_optimizer, DistributedOptimizer)):
        return outer
    dist = outer.inner_optimizer
    if _stepped(outer):
        raise ConfigError("the model's LossScaleOptimizer(DistributedOptimizer) was already used for a step; "
                          "give hvdp.keras.callbacks() to the first fit after compile", rank=_hvd().rank())
    if not isinstance(dist.inner_optimizer, keras.optimizers.LossScaleOptimizer):
        dist.inner_optimizer = keras.optimizers.LossScaleOptimizer(
            dist.inner_optimizer, initial_scale=outer.initial_scale,
            dynamic_growth_steps=outer.dynamic_growth_steps)
    if dist.built and not dist.inner_optimizer.built:
        with keras.name_scope(dist.inner_optimizer.name, caller=dist.inner_optimizer):
            dist.inner_optimizer.build(dist._trainable_variables)
    model.optimizer = dist
    model.make_train_function(force=True)  # fit looks the step up every step: it now uses `dist`
    return dist


def _stepped(loss_scale) -> bool:
    """Whether the LossScaleOptimizer `loss_scale` took or skipped a step (built alone is not: on the torch
    backend fit builds it before the first step)."""
    if not loss_scale.built:
        return False
    return (int(loss_scale.iterations) > 0 or int(keras.ops.convert_to_numpy(loss_scale.step_counter)) > 0
            or float(keras.ops.convert_to_numpy(loss_scale.dynamic_scale)) != float(loss_scale.initial_scale))


class DistributedCallback(keras.callbacks.Callback):
    """What model.fit needs for data parallelism; see callbacks(), which builds it (use that).

    Args:
        data: the dataset shard() returned, or None.
        checkpoint_dir: write a checkpoint at every epoch end and resume from the newest (default None: off).
        keep: how many checkpoints to keep, an integer >= 1 (default 3).
        average_metrics: average the epoch's numeric logs over ranks (default True).

    Raises:
        ConfigError: `data` was not made by shard(), or `keep` is not an integer >= 1.
    """

    _broadcast_first = True  # False under ElasticState.fit: its sync() already made the ranks agree

    def __init__(self, *, data=None, checkpoint_dir: str | Path | None = None, keep: int = 3,
                 average_metrics: bool = True):
        super().__init__()
        if data is not None:
            _position(data)  # fail now, not after the first epoch, if it is not a shard
        ckpt.check_keep(keep)
        self.data = data
        self.checkpoint_dir = checkpoint_dir
        self.keep = keep
        self.average_metrics = average_metrics
        self.resumed: dict | None = None
        self._epoch = 0  # the epoch running
        self._train_results: dict | None = None  # the epoch's training metrics, summed before validation
        self._val_results: dict | None = None  # the epoch's validation metrics, summed at its end
        self._fitting = False
        self._signal_route = None  # the StopFlag's ask, run by hvdp's thread on a stop signal (_preemption)

    def on_train_begin(self, logs=None):
        """Check the setup, turn XLA off, then resume the newest checkpoint or broadcast rank 0's state.

        Runs on every rank at fit's start (collective); `logs` is unused.

        Raises:
            ConfigError: in a multi-rank job the model was not compiled with DistributedOptimizer, or the
                model is not built yet (no weights to broadcast).
            CheckpointError: the newest checkpoint cannot be resumed (see load_checkpoint).
        """
        model = self.model
        hvd = _hvd()
        optimizer = model.optimizer = _loss_scaling_inside(model)
        if hvd.size() > 1 and not isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(
                f"the model was compiled with {type(optimizer).__name__}, which does not average gradients "
                f"across the {hvd.size()} ranks: compile with hvdp.keras.DistributedOptimizer(optimizer)",
                rank=hvd.rank())
        if not model.built or not model.weights:
            raise ConfigError("the model has no weights yet, so rank 0's cannot be broadcast before the first "
                              "step: build it first (start it with keras.Input(shape) or call model.build(shape))",
                              rank=hvd.rank())
        if hvd.size() > 1:
            _keras_checks.refuse_inexact_losses(model, hvd.rank())
        if self.data is not None:  # fit's epochs are the shard's, or its position would not be fit's
            _keras_checks.refuse_other_steps((self.params or {}).get("steps"),
                                             self.data.hvdp_position.plan.steps_per_epoch, hvd)
        if model.jit_compile:
            # Horovod's collectives are not XLA ops: rebuild the step without XLA (fit looks it up every step).
            model.jit_compile = False
            model.make_train_function(force=True)
        if self.data is not None:  # the gradient weights group the optimizer's passes into steps
            self.data.hvdp_position.passes = getattr(optimizer, "backward_passes_per_step", 1)
        # fit calls on_train_begin from its CallbackList (the caller's frame), whose list is changed in place;
        # run any other way (a hand-made loop of callbacks) there is no list to see
        fit_list = sys._getframe(1).f_locals.get("self")
        fit_list = fit_list.callbacks if isinstance(fit_list, keras.callbacks.CallbackList) else None
        if fit_list is not None:  # Keras's own writers given to fit directly: rank 0 only, or refused
            _keras_rank0.wrap_in_fit(fit_list, self, hvd.rank())
            _keras_checks.scale_lr_schedulers(fit_list, optimizer, hvd.rank())  # absolute rates keep the x N
        _keras_checks.mark_fitting(optimizer)
        self._agree_on_stop(optimizer, fit_list)
        self._fitting, self._train_results = True, None
        self.resumed = (load_checkpoint(self.checkpoint_dir, model, optimizer, self.data)
                        if self.checkpoint_dir else None)
        if self.resumed is not None:
            model._initial_epoch = self.resumed["epoch"]  # as keras.callbacks.BackupAndRestore does
            log(f"resumed from epoch {self.resumed['epoch']} step {self.resumed['step']} (optimizer step "
                f"{self.resumed['global_step']}) of {self.checkpoint_dir}")
            if self.resumed["step"]:
                self._finish_epoch(self.resumed["epoch"], self.resumed["step"])
        elif self._broadcast_first:
            _keras_backend.broadcast(model, optimizer)  # builds the optimizer's state first: no fake step

    def _agree_on_stop(self, optimizer, fit_list: list | None) -> None:
        """Make a `stop_training` set on one rank every rank's (hvdp/_keras_stop.py): the optimizer's gradient
        all-reduce carries a StopFlag, and an AgreeOnStop goes last in fit's callbacks `fit_list`, after the
        user's. Without fit's list (a hand-made loop of callbacks) there is no agreement: a rank's stop is its own."""
        if _hvd().size() == 1 or not isinstance(optimizer, DistributedOptimizer) or fit_list is None:
            return
        flag = getattr(optimizer, "_hvdp_stop", None)
        if flag is None:
            optimizer._hvdp_stop = flag = _keras_stop.StopFlag()
            self.model.make_train_function(force=True)  # a step traced before would not carry the flag
        flag.reset()
        if not any(isinstance(c, _keras_stop.AgreeOnStop) for c in fit_list):
            fit_list.append(_keras_stop.AgreeOnStop(flag))
            fit_list[-1].set_model(self.model)
        if self.checkpoint_dir and _preemption.enabled():  # a stop signal rides the next step's all-reduce
            _preemption.arm()
            # the same route on every rank: where no wakeup thread can be set, _stop_if_preempted asks instead
            _preemption.on_signal_now(flag.ask_for_signal)
            self._signal_route = flag.ask_for_signal

    def on_train_end(self, logs=None):
        """Forget the resumed epoch, so that a later fit() starts from its own initial_epoch, and a stop the
        ranks agreed on (the next fit starts without one); `logs` unused."""
        self._fitting = False
        if self._signal_route is not None:
            _preemption.forget_signal_now(self._signal_route)
            self._signal_route = None
        if self.resumed is not None:
            self.model._initial_epoch = None
        flag = getattr(self.model.optimizer, "_hvdp_stop", None)
        if flag is not None and flag.agreed():
            _discard_accumulated(self.model.optimizer)
        if flag is not None:
            flag.reset()

    def _finish_epoch(self, epoch: int, first: int) -> None:
        """Train the rest of `epoch` from batch `first` (a checkpoint taken mid-epoch, on preemption) with
        fit's own compiled step, then end the epoch as fit would (flush, checkpoint): fit runs every epoch
        with the dataset's full number of batches, so it continues from the next one. The other callbacks
        see no on_epoch_end for this epoch."""
        model = self.model
        self._epoch = epoch
        remaining = self.data.hvdp_position.plan.steps_per_epoch - first
        self.data.hvdp_position.set(epoch, first)
        iterator = iter(self.data.take(remaining))  # never reaches the end its declared length asserts
        model.reset_metrics()
        for batch in range(0, remaining, model.steps_per_execution):
            model.train_function(iterator)
            self._stop_if_preempted(min(first + batch + model.steps_per_execution, first + remaining))
        self.on_epoch_end(epoch)
        model._initial_epoch = epoch + 1

    def on_epoch_begin(self, epoch, logs=None):
        """Set the data order to fit's `epoch` (when `data` was given); `logs` is unused."""
        self._epoch = epoch
        self._train_results = self._val_results = None
        if self.data is not None:
            self.data.hvdp_position.set(epoch)

    def on_train_batch_end(self, batch, logs=None):
        """With preemption on (init(preemption=True)) and a checkpoint_dir: once any rank got a stop signal,
        every rank writes the checkpoint of this step (batch `batch` of the epoch) and exits with 75
        (hvdp.tensorflow.preemption); `logs` is unused. Collective: fit runs it on every rank."""
        self._stop_if_preempted(batch + 1)

    def _stop_if_preempted(self, step: int) -> None:
        """After the step that ends at batch `step` of the epoch: with a stop signal on some rank, write the
        checkpoint and exit 75 on every rank. With the signal carried by the gradient all-reduce (a StopFlag:
        within 2 steps of the signal, whatever steps_per_execution), once the ranks agreed to stop; else every
        hvdp.tensorflow.preemption.CHECK_EVERY calls."""
        if not (self.checkpoint_dir and _preemption.enabled()):
            return
        flag = getattr(self.model.optimizer, "_hvdp_stop", None)
        if self._signal_route is not None and flag is not None:
            if not flag.agreed():
                if _preemption.received():  # (without hvdp's thread: the next step carries it)
                    flag.ask_for_signal()
                return
            signalled = 1.0 if _preemption.received() else 0.0
            if _keras_backend.allreduce_mean([signalled], "hvdp.preempted")[0] == 0:
                return  # a callback's stop_training, not a signal: fit stops as it asked
            step -= flag.skipped()  # the steps that read their batches and applied nothing are redone
        elif not _keras_backend.preempted():
            return
        save_checkpoint(self.checkpoint_dir, self.model, self.model.optimizer, epoch=self._epoch, step=step,
                        global_step=int(self.model.optimizer.iterations), keep=self.keep)
        _keras_backend.exit_for_requeue()

    def _summed(self) -> dict[str, float]:
        """The model's compiled metrics from their state summed over the ranks. The loss is left to the
        averaging: fit's loss tracker weighs each step by this rank's batch size, which in an epoch's uneven last
        step hvdp's sample weights already account for (summing it there is no closer to one process)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        return _summed_metric_results([m for m in self.model.metrics if m is not tracker], _hvd())

    def on_test_begin(self, logs=None):
        """Within fit, before validation resets the metrics: the epoch's training metrics from their state
        summed over the ranks (collective: every rank validates at the same epochs); `logs` unused."""
        if self.average_metrics and _hvd().size() > 1 and self._fitting and self._train_results is None:
            self._train_results = self._summed()

    def on_test_end(self, logs=None):
        """Within fit: the validation's metrics from their state summed over the ranks, for on_epoch_end's val_*
        logs (fit's CallbackList hands the callbacks a copy of evaluate's logs: they are set there); collective,
        `logs` unused."""
        if self.average_metrics and _hvd().size() > 1 and self._fitting:
            self._val_results = self._summed()

    def on_epoch_end(self, epoch, logs=None):
        """Take the epoch's short last step (flush), set the epoch's metrics in `logs` to one process's (every
        keras.metrics.Metric from its state summed over the ranks, as Keras under tf.distribute computes it:
        exact for ratio metrics such as Precision, Recall, AUC; the validation ones were at on_test_end; any
        other number a callback put in the logs is averaged over the ranks), and write the checkpoint of
        `epoch` + 1.

        Collective (fit runs it on every rank): the ranks must log the same metric names.
        """
        stopped = getattr(self.model.optimizer, "_hvdp_stop", None)
        if (self.data is not None and isinstance(self.model.optimizer, DistributedOptimizer)
                and not (stopped is not None and stopped.agreed())):  # passes after an agreed stop are dropped
            self.model.optimizer.flush()  # with backward_passes_per_step=k: the last j < k passes are a step
        if self.average_metrics and logs and _hvd().size() > 1:
            summed = self._train_results if self._train_results is not None else self._summed()
            self._train_results = None
            exact = {k: v for k, v in summed.items() if k in logs}
            exact.update({f"val_{k}": v for k, v in (self._val_results or {}).items() if f"val_{k}" in logs})
            self._val_results = None
            keys = sorted(k for k, v in logs.items()
                          if k not in exact and isinstance(v, (int, float, np.floating, np.integer)))
            logs.update(exact)
            logs.update(zip(keys, _keras_backend.allreduce_mean([float(logs[k]) for k in keys], "hvdp.metrics")))
        if self.checkpoint_dir:
            save_checkpoint(self.checkpoint_dir, self.model, self.model.optimizer, epoch=epoch + 1, step=0,
                            global_step=int(self.model.optimizer.iterations), keep=self.keep)


def _discard_accumulated(optimizer) -> None:
    """Drop a DistributedOptimizer's passes accumulated since its last step (the ranks stopped before it)."""
    if optimizer.backward_passes_per_step > 1 and optimizer.built:
        for a in optimizer._accumulators:
            a.assign(keras.ops.zeros_like(a))
        optimizer._passes.assign(0)
        optimizer._used = set()


def callbacks(*, data=None, checkpoint_dir: str | Path | None = None, keep: int = 3,
              average_metrics: bool = True, keras_callbacks: list | None = None) -> list[keras.callbacks.Callback]:
    """The callbacks to pass to model.fit, first in the list (later callbacks then see averaged metrics):

    - before the first step, broadcasts the model's weights and the optimizer's state from rank 0 (or
      restores the newest checkpoint of `checkpoint_dir` on every rank and makes fit continue from its epoch);
    - with `data` (the dataset shard() returned), sets each epoch's data order from fit's epoch number;
    - averages the epoch's metrics (loss, accuracy, val_*) over ranks in the logs;
    - with `checkpoint_dir`, writes a checkpoint at every epoch end (rank 0, atomic, keeps `keep`), and with
      preemption on (init(preemption=True)), on a SIGTERM or SIGUSR1 to any rank one mid-epoch checkpoint
      after the step the ranks agree on (within 2 steps of the signal), then every
      rank exits with 75 for a requeue; the rerun trains the rest of that epoch before fit's first epoch
      (the later callbacks see no on_epoch_end for it), then fit continues;
    - shows fit's progress bar (verbose=1 or 2) on rank 0 only;
    - runs Keras's own file writers (ModelCheckpoint, BackupAndRestore, CSVLogger, TensorBoard) on rank 0
      only, their model files written atomically (a temp file renamed into place), BackupAndRestore's restore
      broadcast from rank 0: those in `keras_callbacks`, and ModelCheckpoint, BackupAndRestore and CSVLogger
      given to fit after these callbacks (hvdp/_keras_rank0.py); one given to fit before them, or a TensorBoard
      given to fit directly, is a ConfigError at fit's start on every rank (they have already run there);
    - makes a `model.stop_training = True` set by any callback on one rank every rank's, at the same step
      (hvdp/_keras_stop.py: carried by the next step's gradient all-reduce, or settled at the epoch's end);
    - times each step's input, compute, gradient wait and update on every rank, for the straggler report
      (hvdp/_keras_steps.py; HVDP_STEP_ACCOUNTING=0 turns it off); with a TensorBoard in `keras_callbacks`,
      rank 0 writes each epoch's figures into its log_dir's train run (step_ms/<part>/rank<r>).

    Learning-rate scaling and warmup live in DistributedOptimizer (a LearningRateSchedule), not here.
    Every rank must call it and pass the callbacks to the same model.fit; model.fit runs collectives in them.
    A model compiled with jit_compile gets its train step rebuilt without XLA (Horovod's ops are not XLA ops).

    Args:
        data: the dataset hvdp.keras.shard returned (default None: the order is not tied to fit's epoch).
        checkpoint_dir: write a checkpoint at every epoch end and resume from the newest (default None: off);
            needs `data`.
        keep: how many checkpoints to keep, an integer >= 1 (default 3).
        average_metrics: average the epoch's numeric logs over ranks (default True).
        keras_callbacks: Keras callbacks to run after hvdp's, ModelCheckpoint, BackupAndRestore, CSVLogger and
            TensorBoard among them on rank 0 only (default None).

    Returns:
        [DistributedCallback, the keras_callbacks (the writers wrapped), fit's progress bar silenced on ranks
        other than 0, the step timing].

    Raises:
        ConfigError: `checkpoint_dir` without `data`; `data` not from shard(); `keep` < 1.
    """
    if checkpoint_dir is not None and data is None:
        raise ConfigError("callbacks(checkpoint_dir=...) needs data=<the dataset hvdp.keras.shard returned>: a "
                          "resumed fit must continue that dataset's epoch order, not restart it")
    return [DistributedCallback(data=data, checkpoint_dir=checkpoint_dir, keep=keep, average_metrics=average_metrics),
            *_keras_rank0.wrap(list(keras_callbacks or [])), _RankZeroProgbar(),
            _keras_steps.StepTimes([c for c in keras_callbacks or [] if isinstance(c, keras.callbacks.TensorBoard)])]


# SyncBatchNormalization calls traced so far in each graph (a tf.function's trace): their all-reduces' names.
_SYNC_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sync_sum(stats):
    """The sum of `stats` over the ranks, differentiable (the gradient is the sum of the gradients).

    Named explicitly, forward and backward: Horovod's default names derive from tensor names, which hold
    Keras's per-process layer counters ("sync_batch_normalization_3"), so a rank that built one more layer or
    model first would submit other names and the job would stall. Inside a tf.function the n-th call traced
    is named n (the same layer on every rank: every rank traces the same model); eagerly each all-reduce
    completes before the next starts, so one name serves them all.
    """
    if tf.executing_eagerly():
        name = "hvdp_sync_batch_norm"
    else:
        graph = tf.compat.v1.get_default_graph()
        index = _SYNC_CALLS.get(graph, 0)
        _SYNC_CALLS[graph] = index + 1
        name = f"hvdp_sync_batch_norm_{index}"

    @tf.custom_gradient
    def total(x):
        def grad(upstream):
            return hvd.allreduce(upstream, op=hvd.Sum, name=f"{name}_grad", ignore_name_scope=True)
        return hvd.allreduce(x, op=hvd.Sum, name=name, ignore_name_scope=True), grad
    return total(stats)


@keras.saving.register_keras_serializable(package="hvdp")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training statistics are those of the global batch (all ranks together).

    Two all-reduces per call: (sum, count) for the global mean, then the sums of the deviations from it and of
    their squares, from which the mean and the variance follow exactly (differentiable; the variance is not
    E[x^2] - E[x]^2, which loses every digit in float32 when the inputs' mean is large against their spread);
    in inference it is plain BatchNormalization. (Horovod's SyncBatchNormalization does not work on Keras 3: it
    passes `fused`.) Takes keras.layers.BatchNormalization's arguments. In training with 2+ ranks every rank
    must call the layer the same number of times, in the same order (two all-reduces each). Serialisable. On
    Keras's torch backend the sums go through horovod.torch's all-reduce (differentiable the same way).
    """

    def _moments(self, inputs, mask):
        if _keras_backend.on_torch():
            return self._torch_moments(inputs, mask, _hvd())
        if not hvd.is_initialized() or hvd.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float32)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float32), tf.shape(x))
        axes = self._reduction_axes

        def summed(*parts):  # each part's sum over the ranks (one all-reduce), in the parts' shape
            shape = tf.shape(parts[0])
            total = _sync_sum(tf.concat([tf.reshape(p, [-1]) for p in parts], axis=0))
            return [tf.reshape(p, shape) for p in tf.split(total, len(parts))]

        # First pass: the global mean, a shift only (no gradient flows through it).
        s1, n = (tf.stop_gradient(t) for t in summed(tf.reduce_sum(weights * x, axes), tf.reduce_sum(weights, axes)))
        shift = s1 / n
        # Second pass: the deviations from the shift; mean and variance from them exactly (their gradients too).
        d = weights * (x - shift)
        d1, d2 = summed(tf.reduce_sum(d, axes), tf.reduce_sum(d * (x - shift), axes))
        mean = shift + d1 / n
        variance = tf.maximum(d2 / n - tf.square(d1 / n), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    def _torch_moments(self, inputs, mask, horovod):
        """_moments on Keras's torch backend: the same two passes, all-reduced by horovod.torch, whose
        all-reduce is differentiable (its gradient is the sum of the gradients, as _sync_sum's). Runs eagerly,
        so each all-reduce completes before the next starts and one name serves them all."""
        if not horovod.is_initialized() or horovod.size() == 1:
            return super()._moments(inputs, mask)
        x = inputs.float()
        weights = x.new_ones(()).expand_as(x) if mask is None else mask.unsqueeze(-1).to(x.dtype).expand_as(x)
        axes = list(self._reduction_axes)

        def summed(*parts):
            total = horovod.allreduce(keras.ops.concatenate([p.reshape(-1) for p in parts]), op=horovod.Sum,
                                      name="hvdp_sync_batch_norm")
            return [p.reshape(parts[0].shape) for p in total.chunk(len(parts))]

        s1, n = summed((weights * x).sum(axes).detach(), weights.sum(axes).detach())  # no gradient through it
        shift = s1 / n
        d = weights * (x - shift)
        d1, d2 = summed(d.sum(axes), (d * (x - shift)).sum(axes))
        mean = shift + d1 / n
        variance = (d2 / n - (d1 / n) ** 2).clamp_min(0.0)
        return mean.to(inputs.dtype), variance.to(inputs.dtype)


from hvdp.keras_elastic import ElasticState, elastic_run  # noqa: E402  (it builds on this module's callbacks)

__all__ = ["init", "world", "DistributedOptimizer", "ScaledSchedule", "shard", "index_records", "callbacks",
           "DistributedCallback", "SyncBatchNormalization", "average", "barrier", "broadcast", "check_finite",
           "evaluate", "check_consistency", "save_checkpoint", "load_checkpoint", "log", "HvdpError",
           "ElasticState", "elastic_run"]
