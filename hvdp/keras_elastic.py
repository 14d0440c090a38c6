"""Elastic Keras 3 on the TensorFlow backend: ElasticState and elastic_run, the model.fit side of
hvdp.torch.elastic (re-exported by hvdp.keras).

    train = hvdp_keras.shard((x, y), batch_size=32)
    state = hvdp_keras.ElasticState(model, train, best=0.0)

    @hvdp_keras.elastic_run
    def training(state):
        state.fit(epochs=10, commit_every=20, verbose=2)

    training(state)

fit() runs one model.fit per epoch (per rest of an epoch after a reset) on a dataset sized for what is left
of it in the world there is now: fit's epochs all have one length, and an epoch interrupted mid-way is
shorter. The data position is the one of hvdp.torch's ShardSampler: (epoch, offset into the epoch's order),
advanced with hvdp.core.sharding.ShardPlan.consumed; the learning rate follows the world through
hvdp.core.scaling (via hvdp.tensorflow.optimizer's _rescale_learning_rate), as on PyTorch.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdp import _horovod, _keras_backend, _keras_data, _keras_rank0
from hvdp.core.errors import ConfigError
from hvdp.core.scaling import lr_multiplier
from hvdp.tensorflow.collectives import _build_optimizer
from hvdp.tensorflow.optimizer import DistributedOptimizer, _rescale_learning_rate
from hvdp.tensorflow.runtime import hvd
from hvdp.tensorflow.tracking import watched

from horovod.common.elastic import ObjectState  # noqa: E402,I001  (after runtime's import_horovod: its clear error)


def _rank() -> int | None:
    """This rank for an error message (None before init())."""
    return hvd.rank() if hvd.is_initialized() else None


def _multiplier(scaling: dict) -> float:
    """The multiplier of a rate scaled by DistributedOptimizer._scaling()'s rule for its world."""
    return lr_multiplier(scaling["lr_scaling"], scaling["size"],
                         backward_passes_per_step=scaling["backward_passes_per_step"])


class ElasticState(_horovod.CopiedExtras, ObjectState):
    """What an elastic Keras job keeps across a lost or added worker: model weights, optimizer variables
    (the rate among them), the data position (epoch, offset into its order) and extras.

        state = hvdp_keras.ElasticState(model, train, best=0.0)

        @hvdp_keras.elastic_run
        def training(state):
            state.fit(epochs=10, commit_every=20)   # model.fit's arguments but x, epochs, initial_epoch

    `model` is compiled with hvdp.keras.DistributedOptimizer and `data` comes from hvdp.keras.shard. A commit
    (every `commit_every` batches and at each epoch's end) copies the weights and optimizer variables to host
    memory with the samples of the epoch trained on so far; a failure rolls every survivor back to it, the
    rest of the epoch is split among the ranks there are now (no sample skipped or seen twice), the rate is
    rescaled to the new world size by the DistributedOptimizer's rule, and sync() broadcasts everything from
    rank 0 (a worker that joins gets it all). `state.position` is where training is: (epoch, samples of that
    epoch's order trained on), as hvdp.torch's ShardSampler.position(); it is mid-epoch (offset > 0) only
    after a reset interrupted an epoch.

    Args:
        model: the compiled Keras model.
        data: the dataset hvdp.keras.shard returned.
        extra: further values to keep and sync, read and set as attributes (state.best); not `epoch`.

    Raises:
        ConfigError: Keras runs on its torch backend (elastic Keras is TensorFlow's: there use hvdp.torch's
            ElasticState with a PyTorch loop); the model is not compiled with DistributedOptimizer, or with
            backward_passes_per_step > 1; `data` is not from hvdp.keras.shard; `extra` has `epoch`.
    """

    def __init__(self, model: keras.Model, data: tf.data.Dataset, **extra: Any):
        if _keras_backend.on_torch():
            raise ConfigError("elastic Keras runs on the TensorFlow backend only (KERAS_BACKEND=tensorflow); on "
                              "KERAS_BACKEND=torch train elastically with hvdp.torch.ElasticState and elastic_run "
                              "in a PyTorch loop")
        from hvdp.keras import _loss_scaling_inside

        # Under mixed_float16 compile wraps the optimizer in a LossScaleOptimizer: put it inside, as fit's callbacks do.
        optimizer = _loss_scaling_inside(model) if getattr(model, "optimizer", None) is not None else None
        if not isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(f"ElasticState needs a model compiled with hvdp.keras.DistributedOptimizer, got "
                              f"{type(optimizer).__name__}", rank=_rank())
        if optimizer.backward_passes_per_step != 1:
            raise ConfigError(f"ElasticState takes backward_passes_per_step=1, got "
                              f"{optimizer.backward_passes_per_step}: passes accumulated at a commit would be "
                              f"lost or applied twice by a reset", rank=_rank())
        if getattr(data, "hvdp_batches", None) is None:
            raise ConfigError("ElasticState needs the dataset hvdp.keras.shard() returned (not transformed after "
                              "it: .map() returns a new dataset)", rank=_rank())
        if "epoch" in extra:
            raise ConfigError("`epoch` is kept by ElasticState itself (state.epoch, from the data position); "
                              "leave it out of the extras", rank=_rank())
        self.model, self.data = model, data
        self._continued: dict = {}  # fit's callbacks by identity, kept across fit's epochs (_Continued)
        self._callbacks: list[_Continued] = []  # those of the running (or last) fit call, in its order
        self._resumed: list | None = None  # their committed state, for the next fit call after a reset
        self._interrupted = False  # a fit call raised; a reset (reset()) continues its callbacks, else they end
        self.position = (0, 0)  # (epoch, samples of its order trained on): where training is
        _build_optimizer(optimizer, model)  # its variables exist before the first snapshot
        self._snapshot = self._take()
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0, name="hvdp.elastic"),
                         get_rank=hvd.rank, **extra)

    @property
    def epoch(self) -> int:
        """The epoch training is in (or starts next)."""
        return self.position[0]

    def _take(self) -> dict:
        optimizer = self.model.optimizer
        return {"weights": [np.array(v.numpy()) for v in self.model.weights],
                "optimizer": [np.array(v.numpy()) for v in optimizer.variables],
                "multiplier": optimizer.multiplier, "position": self.position, "callbacks": self._callback_state()}

    def _callback_state(self) -> list:
        """The state of fit's callbacks (_Continued.state), the one a reset brought back while no fit took it."""
        return self._resumed if self._resumed is not None else [c.state() for c in self._callbacks]

    def save(self) -> None:
        """Snapshot weights, optimizer variables, data position and the state of fit's callbacks in memory
        (state.commit() calls it)."""
        self._snapshot = self._take()
        super().save()

    def restore(self) -> None:
        """Roll weights, optimizer variables and data position back to the last save(); Horovod calls it."""
        snap, optimizer = self._snapshot, self.model.optimizer
        for v, value in zip(self.model.weights, snap["weights"]):
            v.assign(value)
        for v, value in zip(optimizer.variables, snap["optimizer"]):
            v.assign(value)
        optimizer.multiplier = snap["multiplier"]  # the restored rate is scaled for the snapshot's world
        self.position = snap["position"]
        self._resumed = copy.deepcopy(snap["callbacks"])  # fit's next call puts them back into its callbacks
        super().restore()

    def reset(self) -> None:
        """Rescale the learning rate to the world there is now and drop fit's compiled functions (they were
        traced for the old world); Horovod calls it after every reset, before sync() or instead of it."""
        optimizer = self.model.optimizer
        scaling = optimizer._scaling()
        # Horovod skips sync() when hosts were only removed: the rate must follow the new world here.
        _rescale_learning_rate(optimizer.inner_optimizer, optimizer.multiplier, **scaling)
        optimizer.multiplier = _multiplier(scaling)
        self.model.train_function = self.model.test_function = self.model.predict_function = None
        self._interrupted = False  # the fit call that raised continues after the reset, callbacks and all

    def sync(self) -> None:
        """Broadcast weights, optimizer variables (rank 0's rate, already scaled for this world), data position
        and extras from rank 0. elastic_run calls it after every reset; every rank must call it."""
        optimizer = self.model.optimizer
        _keras_backend.broadcast(self.model, optimizer)
        optimizer.multiplier = _multiplier(optimizer._scaling())
        self.position = tuple(hvd.broadcast_object(self.position, root_rank=0, name="hvdp.elastic.position"))
        # rank 0's callbacks' state: what a survivor rolled back to, and all a joining rank has of them
        self._resumed = hvd.broadcast_object(self._callback_state(), root_rank=0, name="hvdp.elastic.callbacks")
        super().sync()
        self._snapshot = self._take()  # what a failure before the next commit rolls back to

    def _rest_of_epoch(self) -> tuple[tf.data.Dataset, int]:
        """The dataset of this rank's batches for the rest of the current epoch in the world there is now,
        and the offset it starts at."""
        position = self.data.hvdp_position
        if (position.plan.rank, position.plan.size) != (hvd.rank(), hvd.size()):
            position.plan = dataclasses.replace(position.plan, rank=hvd.rank(), size=hvd.size())
        epoch, offset = self.position
        position.set(epoch, 0, offset)
        steps = position.plan.steps_for(position.plan.n - offset)
        rest = watched(self.data.hvdp_batches.apply(tf.data.experimental.assert_cardinality(steps)))
        seen = getattr(self.data, "hvdp_seen", None)
        return (rest if seen is None else _keras_data.accept_class_weight(rest, seen, watched)), offset

    def _continue(self, callback) -> _Continued:
        """The _Continued of the user's `callback` (a Keras writer run on rank 0 only), the same one as long as
        the state holds it."""
        held = self._continued.get(id(callback))
        if held is None or held[0] is not callback:
            held = self._continued[id(callback)] = (callback, _Continued(_keras_rank0.wrap([callback])[0]))
        return held[1]

    def _advance(self, epoch: int, offset: int, steps: int) -> None:
        """Record that `steps` batches of `epoch` from `offset` were trained on (the next epoch once all were)."""
        plan = self.data.hvdp_position.plan
        done = plan.consumed(offset, steps)
        self.position = (epoch + 1, 0) if done >= plan.n else (epoch, done)

    def fit(self, epochs: int, *, commit_every: int = 1, callbacks: list | None = None, **fit_kwargs) -> list:
        """Train from where the state is to `epochs` with model.fit, one call per epoch (or rest of one).

        Call it inside an elastic_run function; every rank must call it (model.fit runs collectives). Its
        callbacks come first (hvdp.keras.callbacks' setup and metric averaging, without a broadcast: sync()
        did it), then `callbacks`, then the commit: every `commit_every` batches and at each epoch's end,
        after the other callbacks (what they set on the state is committed with the step).

        Args:
            epochs: the epoch to stop before, as model.fit's.
            commit_every: batches between commits, an integer >= 1 (default 1). A failure loses the batches
                since the last commit; a commit copies the weights and optimizer variables to host memory.
            callbacks: further Keras callbacks (default None).
            fit_kwargs: model.fit's other arguments (verbose, validation_data...), not x, y, epochs,
                initial_epoch, batch_size, steps_per_epoch or callbacks.

        Returns:
            The History of each model.fit call this call made.

        Raises:
            ConfigError: `commit_every` is not an integer >= 1, or fit_kwargs has an argument fit() sets.

        `callbacks` see one fit, not one per epoch (_Continued): their on_train_begin runs at the first epoch of
        this call, their on_train_end after the last, so EarlyStopping's patience, ReduceLROnPlateau's plateau
        and CSVLogger's file span the epochs. Their state is committed with the step (each callback's plain
        attributes: numbers, strings, arrays and lists or dicts of them, such as EarlyStopping's wait and best):
        after a reset the call elastic_run makes continues them from the last commit, as rank 0 had it (a rank
        that joins gets it by broadcast, after its own on_train_begin); pass the same callbacks in the same order.
        A fit that raises anything else ends them as a Keras fit that raises does (no on_train_end): the next
        call begins them anew. A `stop_training` (EarlyStopping,
        TerminateOnNaN, any callback on any rank: the ranks agree, hvdp/_keras_stop.py) ends this call after
        that epoch. Keras's file writers among them run on rank 0 only (hvdp/_keras_rank0.py).
        """
        from hvdp.keras import DistributedCallback, _RankZeroProgbar

        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError(f"commit_every must be an integer >= 1, got {commit_every!r}", rank=_rank())
        taken = sorted({"x", "y", "epochs", "initial_epoch", "batch_size", "steps_per_epoch"} & set(fit_kwargs))
        if taken:
            raise ConfigError(f"ElasticState.fit sets {', '.join(taken)} itself (the data and epochs follow the "
                              f"state's position); leave them out", rank=_rank())
        fit_kwargs.setdefault("shuffle", False)  # the order is shard()'s; Keras warns about shuffle=True on a Dataset
        continued = [self._continue(c) for c in callbacks or []]
        if self._interrupted:  # the last call raised and no reset followed: its callbacks ended, as Keras's would
            for c in self._callbacks:
                c.abandon()
        for c in continued:  # rank 0 may be another process after a reset (with or without sync())
            c.adopt()
        self._resume(continued)
        self._callbacks, self._interrupted = continued, False
        histories = []
        self.model.stop_training = False
        try:
            while self.epoch < epochs and not self.model.stop_training:
                data, offset = self._rest_of_epoch()
                setup = DistributedCallback(data=None)
                setup._broadcast_first = False
                histories.append(self.model.fit(
                    data, initial_epoch=self.epoch, epochs=self.epoch + 1, **fit_kwargs,
                    callbacks=[setup, *continued, _RankZeroProgbar(), _Commit(self, self.epoch, offset, commit_every)]))
        except BaseException:  # a reset (reset() clears it: the next call continues them) or an error (they end)
            self._interrupted = True
            raise
        for c in continued:  # their on_train_end, once, after the last epoch (or the agreed stop)
            c.end()
        if self._snapshot["position"] == self.position:  # committed at the last epoch's end: a reset now begins anew
            self._snapshot = {**self._snapshot, "callbacks": [c.state() for c in continued]}
        return histories

    def _resume(self, continued: list) -> None:
        """Give this fit call's callbacks the state a reset brought back (restore() or sync()), if one did: the
        committed state of the callbacks of the call that was running, by their order in the list."""
        saved, self._resumed = self._resumed, None
        if saved is None:
            return
        if any(s["began"] for s in saved) and [s["type"] for s in saved] != [_Continued.kind(c) for c in continued]:
            raise ConfigError(f"ElasticState.fit after a reset takes the callbacks it had (their state was committed "
                              f"with the step): {[s['type'] for s in saved]}, got "
                              f"{[_Continued.kind(c) for c in continued]}; pass the same callbacks in the same order",
                              rank=_rank())
        for c, s in zip(continued, saved if any(s["began"] for s in saved) else [None] * len(continued)):
            c.resume(s)


_PLAIN = (type(None), bool, int, float, str, np.generic, np.ndarray)


def _plain(value) -> bool:
    """Whether `value` is plain data (numbers, strings, arrays, and lists, tuples or dicts of them): what a
    callback's state is made of, as opposed to its model, files or other objects."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


def _open_file(csv_logger) -> bool:
    """Whether a CSVLogger has its file open in this process (rank 0's), a local one (tell and truncate)."""
    f = getattr(csv_logger, "csv_file", None)
    return f is not None and not f.closed and all(hasattr(f, m) for m in ("tell", "truncate", "seek"))


class _Continued(keras.callbacks.Callback):
    """A user's callback across ElasticState.fit's one model.fit per epoch, as it would see one fit: its
    on_train_begin at the first fit only (until end()), its on_train_end deferred to end(), every other hook
    passed on as it comes. `hvdp_inner` is the callback (hvdp.keras's checks look through to it). Across a
    reset its state (state(), committed with the step) is put back by resume()."""

    def __init__(self, callback):
        super().__init__()
        self.hvdp_inner = callback
        self._began, self._logs, self._restore = False, None, None

    @property
    def user(self):
        """The user's callback (inside RankZero for Keras's file writers)."""
        inner = self.hvdp_inner
        return inner.callback if isinstance(inner, _keras_rank0.RankZero) else inner

    @staticmethod
    def kind(continued: _Continued) -> str:
        return type(continued.user).__name__

    def state(self) -> dict:
        """What a commit keeps of the callback: whether it began, and its plain attributes (copies)."""
        if not self._began:
            return {"type": self.kind(self), "began": False, "attrs": None}
        if isinstance(self.hvdp_inner, _keras_rank0.RankZero) and not self.hvdp_inner.began:
            return {"type": self.kind(self), "began": True, "attrs": None}  # a writer's state is rank 0's
        user = self.user
        attrs = {k: copy.deepcopy(v) for k, v in vars(user).items() if k not in ("params", "_params") and _plain(v)}
        if isinstance(user, keras.callbacks.CSVLogger) and "append_header" in attrs:
            attrs["append_header"] = user.append_header and user.writer is None  # no second header
            if _open_file(user):  # rank 0's: the rows written so far (a reset takes back the ones after)
                user.csv_file.flush()
                attrs["hvdp_csv_size"] = user.csv_file.tell()
        return {"type": self.kind(self), "began": True, "attrs": attrs}

    def resume(self, saved: dict | None) -> None:
        """Continue from `saved` (a state(), the last commit's): its attributes back in the callback now where it
        began in this process, else after its on_train_begin (a joining rank, a new rank 0 for a file writer:
        adopt()); None or a state that had not begun: it begins anew."""
        if saved is None or not saved["began"]:
            self._began, self._restore = False, None
            return
        self._restore = saved["attrs"]
        if self._began:
            self._put_back()

    def adopt(self) -> None:
        """A Keras file writer (RankZero) that began while another process was rank 0, which a reset made this
        one: it begins here at the next on_train_begin, a CSVLogger appending to the file rank 0 wrote (Keras
        then writes no second header). BackupAndRestore is left as it is: its on_train_begin is collective."""
        inner = self.hvdp_inner
        if (self._began and isinstance(inner, _keras_rank0.RankZero) and inner._root() and not inner.began
                and not isinstance(inner.callback, keras.callbacks.BackupAndRestore)):
            self._began = False
            if isinstance(inner.callback, keras.callbacks.CSVLogger):
                inner.callback.append = True

    def _put_back(self) -> None:
        restore, self._restore = dict(self._restore or {}), None
        size = restore.pop("hvdp_csv_size", None)
        user = self.user
        for k, v in restore.items():
            if _plain(getattr(user, k, None)):  # what it holds (an open file, a writer) stays its own
                setattr(user, k, copy.deepcopy(v))
        if size is not None and isinstance(user, keras.callbacks.CSVLogger) and _open_file(user):
            user.csv_file.flush()  # the rows written after the commit are written again: take them back
            user.csv_file.truncate(size)
            user.csv_file.seek(size)

    def set_params(self, params):
        super().set_params(params)
        self.hvdp_inner.set_params(params)

    def set_model(self, model):
        super().set_model(model)
        self.hvdp_inner.set_model(model)

    def on_train_begin(self, logs=None):
        if not self._began:
            self._began = True
            self.hvdp_inner.on_train_begin(logs)
            self._put_back()

    def on_train_end(self, logs=None):
        self._logs = logs

    def abandon(self) -> None:
        """Forget that the callback began (a fit raised out of ElasticState.fit: no on_train_end, as Keras)."""
        self._began, self._restore = False, None

    def end(self) -> None:
        """The callback's on_train_end (the fits this ElasticState.fit made are over); the next call begins anew."""
        if self._began:
            self._began = False
            self.hvdp_inner.on_train_end(self._logs)


def _forward(hook):
    def forward(self, *args, **kwargs):
        return getattr(self.hvdp_inner, hook)(*args, **kwargs)
    forward.__name__ = hook
    return forward


for _hook in _keras_rank0._HOOKS:
    if _hook not in vars(_Continued):
        setattr(_Continued, _hook, _forward(_hook))


class _Commit(keras.callbacks.Callback):
    """Advances the state's position after every batch and commits it every `every` batches and at the
    epoch's end (Horovod's CommitStateCallback and Update*StateCallback in one, for Keras 3). The epoch's last
    batch is committed at the epoch's end only: a commit there would say the epoch is done before its epoch-end
    callbacks ran, and a failure in them would lose their epoch (EarlyStopping's wait, a CSVLogger row)."""

    def __init__(self, state: ElasticState, epoch: int, offset: int, every: int):
        super().__init__()
        self.state, self.epoch, self.offset, self.every, self._committed = state, epoch, offset, every, 0

    def on_train_batch_end(self, batch, logs=None):
        self.state._advance(self.epoch, self.offset, batch + 1)
        if self.state.position[0] > self.epoch:
            return  # the epoch's last batch: its commit is the epoch end's, after the epoch-end callbacks ran
        if batch + 1 - self._committed >= self.every:
            self._committed = batch + 1
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.position = (self.epoch + 1, 0)
        self.state.commit()


# A collective that failed with a peer, as TensorFlow reports it: an eager op by its type ([Op:HorovodAllgather]),
# one inside fit's compiled step by its node ([[{{node hvdp_gradients}}]]: hvdp names its ops hvdp_*, Horovod's
# default names start with the op's type). Only the node and op names are matched: the message also holds the
# Python traceback where the graph was built, which names horovod's files for any error under elastic_run.
_FAILED_COLLECTIVE = re.compile(r"\{\{node (?:[\w/]*/)?(?:hvdp_|Horovod)|Op:Horovod|__wrapped__Horovod")


def _horovod_failure(error: Exception) -> bool:
    """Whether a TensorFlow error raised out of model.fit is a collective that failed with a peer."""
    return isinstance(error, tf.errors.OpError) and _FAILED_COLLECTIVE.search(str(error)) is not None


def elastic_run(train: Callable) -> Callable:
    """Horovod's elastic loop around `train(state, ...)` for Keras: on a lost worker, roll back to the last
    commit, re-form the world with the survivors (and any host that was added), sync from rank 0, and call
    again.

    Use it as a decorator; every rank must call the decorated function, with an ElasticState first.

    Args:
        train: the training function, train(state, ...); it returns when training is done.

    Returns:
        The wrapped function (horovod.common.elastic.run_fn with horovod.tensorflow's reset).

    Raises:
        HorovodInternalError: only to Horovod's loop, which handles it as a lost worker: a collective that
            failed inside model.fit comes out of it as a TensorFlow error naming a Horovod op, turned into one.
    """
    from horovod.common.elastic import run_fn
    from horovod.tensorflow.elastic import _reset

    return run_fn(_horovod.elastic_body(train, _horovod_failure), _reset)


__all__ = ["ElasticState", "elastic_run"]
