"""Keras's own file-writing callbacks (ModelCheckpoint, BackupAndRestore, CSVLogger, TensorBoard) on rank 0 only,
their model files written atomically (issue 50 row 3).

Every rank runs the same fit with the same callbacks: left alone, each of these writes the same file from every
rank at once (a corrupt `.keras`, HDF5's lock refusing `.weights.h5`, a CSV and event files written N times).
RankZero wraps one: on rank 0 it forwards every hook, with `model.save` and `model.save_weights` writing a temp
file next to the target (same suffix, which Keras checks), fsynced, then renamed over it (os.replace), as
hvdp's own checkpoints are (hvdp.core.checkpoint.write_atomic); BackupAndRestore's metadata file the same way.
Elsewhere it does nothing, except BackupAndRestore's restore: rank 0 reads the backup and broadcasts the weights,
the optimizer's state and the epoch to resume from, so the ranks agree even where only rank 0 sees the files.

hvdp.keras.callbacks(keras_callbacks=[...]) wraps them; hvdp.keras's DistributedCallback wraps those it finds
after itself in fit's callbacks (wrap_in_fit), and refuses, before the first step, a TensorBoard given to fit
directly (fit's CallbackList has already called its set_model on every rank, which writes its event file) and
any of them placed before hvdp's callbacks (their on_train_begin already ran on every rank).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras

from hvdp import _keras_backend
from hvdp.core.checkpoint import fsync_path
from hvdp.core.errors import ConfigError

WRITERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore, keras.callbacks.CSVLogger,
           keras.callbacks.TensorBoard)

_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
          "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
          "on_batch_begin", "on_batch_end")


def replace_atomic(path: str | os.PathLike, write) -> None:
    """`write(temp_path)` to a temp file next to `path` whose name ends as `path`'s does (Keras checks the
    suffix), fsync it, rename it over `path`, fsync the directory; on an error the temp file is removed and
    `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".hvdp-tmp-{os.getpid()}-{path.name}")
    try:
        write(str(tmp))
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class _AtomicSaves:
    """Within the block, `model.save(path, ...)` and `model.save_weights(path, ...)` write atomically (the
    instance's own attributes are restored after: a wrapper a user put there keeps working)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        model = self.model
        self._before = {name: vars(model)[name] for name in ("save", "save_weights") if name in vars(model)}
        for name in ("save", "save_weights"):
            original = getattr(model, name)

            def atomic(filepath, *args, _original=original, **kwargs):
                replace_atomic(filepath, lambda tmp: _original(tmp, *args, **kwargs))
            object.__setattr__(model, name, atomic)

    def __exit__(self, *exc):
        for name in ("save", "save_weights"):
            if name in self._before:
                object.__setattr__(self.model, name, self._before[name])
            else:
                object.__delattr__(self.model, name)


def _backup_save(callback) -> None:
    """BackupAndRestore._save_model (Keras 3), each file written atomically: the previous backup copied aside
    (double_checkpoint), the weights, then the position."""
    from keras.src.utils import file_utils

    if callback.double_checkpoint:
        for path, prev in ((callback._weights_path, callback._prev_weights_path),
                           (callback._training_metadata_path, callback._prev_training_metadata_path)):
            if file_utils.exists(path):
                file_utils.copy(path, prev)
    callback.model.save_weights(filepath=callback._weights_path, overwrite=True)
    text = json.dumps({"epoch": callback._current_epoch, "batch": callback._last_batch_seen})
    replace_atomic(callback._training_metadata_path, lambda tmp: Path(tmp).write_text(text))


class RankZero(keras.callbacks.Callback):
    """`callback` (one of WRITERS) run on rank 0 only, its model files written atomically; see the module.

    Args:
        callback: a keras.callbacks.ModelCheckpoint, BackupAndRestore, CSVLogger or TensorBoard.
    """

    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self.began = False  # its on_train_begin ran in this process (on rank 0), no on_train_end since
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            callback._save_model = lambda: _backup_save(callback)

    def _root(self) -> bool:
        return _keras_backend.horovod().rank() == 0

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def set_model(self, model):
        super().set_model(model)
        if self._root():  # TensorBoard writes its graph summary here
            self.callback.set_model(model)

    def _forward(self, hook, *args, **kwargs):
        if self._root():
            with _AtomicSaves(self.model):
                getattr(self.callback, hook)(*args, **kwargs)
            if hook in ("on_train_begin", "on_train_end"):
                self.began = hook == "on_train_begin"

    def on_train_begin(self, logs=None):
        """Rank 0's on_train_begin; a BackupAndRestore's restore then broadcast from rank 0 (collective)."""
        if not isinstance(self.callback, keras.callbacks.BackupAndRestore):
            self._forward("on_train_begin", logs=logs)
            return
        horovod = _keras_backend.horovod()
        restored = None
        if self._root():
            before = self.model._initial_epoch
            self.callback.on_train_begin(logs)
            self.began = True
            restored = self.model._initial_epoch if self.model._initial_epoch != before else None
        restored = horovod.broadcast_object(restored, root_rank=0, name="hvdp.backup_and_restore")
        if restored is not None:
            _keras_backend.broadcast(self.model, self.model.optimizer)
            self.model._initial_epoch = restored


def _make_hook(hook):
    def forward(self, *args, **kwargs):
        self._forward(hook, *args, **kwargs)
    forward.__name__ = hook
    forward.__doc__ = f"The wrapped callback's {hook} on rank 0 (model files written atomically); nothing elsewhere."
    return forward


for _hook in _HOOKS:
    if _hook not in vars(RankZero):
        setattr(RankZero, _hook, _make_hook(_hook))


def wrap(callbacks: list) -> list:
    """`callbacks` with each of WRITERS wrapped in RankZero (the others as they are)."""
    return [RankZero(c) if isinstance(c, WRITERS) else c for c in callbacks]


def wrap_in_fit(fit_callbacks: list, first, rank: int) -> None:
    """Wrap, in place in fit's callbacks list, the WRITERS given to fit directly after `first` (hvdp.keras's
    DistributedCallback, whose on_train_begin calls this). Same list on every rank: the refusals are every rank's.

    Raises:
        ConfigError: one of them comes before `first` (its on_train_begin already ran on every rank), or is a
            TensorBoard (its set_model already wrote an event file on every rank).
    """
    position = next(i for i, c in enumerate(fit_callbacks) if c is first)
    for i, c in enumerate(fit_callbacks):
        if not isinstance(c, WRITERS):
            continue
        name = type(c).__name__
        if i < position:
            raise ConfigError(
                f"keras.callbacks.{name} comes before hvdp.keras.callbacks() in fit's callbacks: every rank would "
                f"write its files (and it would see each rank's own metrics). Put hvdp.keras.callbacks(...) first, "
                f"or pass it as hvdp.keras.callbacks(..., keras_callbacks=[{name}(...)]): it then writes from rank "
                f"0 only, atomically", rank=rank)
        if isinstance(c, keras.callbacks.TensorBoard):
            raise ConfigError(
                "keras.callbacks.TensorBoard given to fit directly: fit has already let it open its event files on "
                "every rank. Pass it as hvdp.keras.callbacks(..., keras_callbacks=[TensorBoard(...)]): it then "
                "writes from rank 0 only", rank=rank)
        fit_callbacks[i] = RankZero(c)
        if c.params is not None:
            fit_callbacks[i].set_params(c.params)
        fit_callbacks[i].set_model(first.model)
