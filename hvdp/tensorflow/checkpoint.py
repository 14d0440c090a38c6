"""hvdp.tensorflow's checkpoints (also hvdp.keras's): save_checkpoint and load_checkpoint, NumPy .npz files
written atomically on rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
import keras

from hvdp import _horovod, _keras_backend
from hvdp.core import checkpoint as ckpt
from hvdp.core.errors import CheckpointError, ConfigError
from hvdp.core.scaling import lr_multiplier
from hvdp.tensorflow.collectives import _build_optimizer, _label, _local_variables, _name, _weights
from hvdp.tensorflow.data import _position
from hvdp.tensorflow.optimizer import DistributedOptimizer, _rescale_learning_rate
from hvdp.tensorflow.runtime import _ensure_init, hvd

FRAMEWORK = "tensorflow"  # the checkpoint tag: hvdp.tensorflow and hvdp.keras write the same format


def _fingerprint(model_or_variables) -> str:
    return ckpt.fingerprint((f"{i}:{_name(v)}", tuple(int(s) for s in v.shape))
                            for i, v in enumerate(_weights(model_or_variables)))


def _local_state(model, optimizer) -> list[np.ndarray]:
    """This rank's own state as arrays: its local variables' (seed generators, pending gradient sums) and, on
    Keras's torch backend, torch's CPU random state, which Dropout layers without a seed draw from there."""
    arrays = _numpy(_local_variables(model, optimizer))
    if _keras_backend.on_torch():
        import torch
        arrays.append(torch.get_rng_state().numpy())
    return arrays


def _numpy(variables) -> list[np.ndarray]:
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def save_checkpoint(directory: str | Path, model, optimizer: keras.optimizers.Optimizer | None, *, epoch: int,
                    step: int, global_step: int, keep: int = 3, **extra: Any) -> Path | None:
    """Write a checkpoint on rank 0 (atomically) and keep the newest `keep`; every rank must call it.

    The file is a NumPy .npz (read back with allow_pickle=False: no code runs on load) holding the model's
    variables, the optimizer's (its step counter included), every rank's own state (seed generators, which
    drive dropout, and pending accumulated gradients; on Keras's torch backend also torch's CPU random state,
    which unseeded Dropout draws from there) and a JSON header: hvdp's metadata, the data position
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
    hvd = _keras_backend.initialised_horovod()  # horovod.torch on Keras's torch backend: the file is the same
    # every rank's own state (an error on one rank is raised on all)
    local = _horovod.gather_or_raise(hvd, lambda: _local_state(model, optimizer),
                                     name="hvdp.local_state", operation="save_checkpoint")
    if hvd.rank() != 0:
        return _horovod.save_on_root(hvd, directory, "", None, keep)

    def write(f):  # inside save_on_root's error handling: whatever fails on rank 0 is raised on every rank
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
        np.savez(f, **arrays)

    return _horovod.save_on_root(hvd, directory, ckpt.checkpoint_name(global_step, "npz"), write, keep)


def _read(path: Path, model, optimizer, resharding_data: bool, size: int) -> dict:
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
    if resharding_data and meta["world_size"] != size and header["position"]["step"]:
        raise CheckpointError(
            f"the checkpoint was taken mid-epoch with {meta['world_size']} ranks and this job has {size}: "
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
    if not _keras_backend.on_torch():
        _ensure_init()
    hvd = _keras_backend.initialised_horovod()  # horovod.torch on Keras's torch backend: the file is the same
    _build_optimizer(optimizer, model)
    if dataset is not None:
        _position(dataset)  # before any collective: a dataset not made by shard() is refused on every rank
    payload = _horovod.read_checkpoint_on_root(
        hvd, directory, lambda path: _read(path, model, optimizer, dataset is not None, hvd.size()), _ARRAYS)
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
            _rescale_learning_rate(optimizer.inner_optimizer, saved, **optimizer._scaling())
    mine = payload["local"].get(hvd.rank())
    local_vars = _local_variables(model, optimizer)
    if _keras_backend.on_torch() and same_world and mine is not None and len(mine) == len(local_vars) + 1:
        import torch
        torch.set_rng_state(torch.from_numpy(mine[-1].copy()))  # saved last by _local_state
        mine = mine[:-1]
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
        if _keras_backend.on_torch():  # horovod.torch: in place, into the array's own memory
            import torch
            hvd_.broadcast_(torch.from_numpy(buffer), root_rank=0, name=name)
            return
        buffer[:] = hvd_.broadcast(tf.constant(buffer), root_rank=0, name=name).numpy()


_ARRAYS = _NumpyArrays()
