"""Checkpoints: save_checkpoint() on rank 0, atomically, and load_checkpoint() read on rank 0 and streamed
to every rank, with the data position, RNG states and the learning rate of the world it resumes in."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hvdp import _horovod
from hvdp.core import checkpoint as ckpt
from hvdp.core.errors import CheckpointError
from hvdp.core.scaling import lr_multiplier
from hvdp.torch.optimizer import _rescale_groups, _rescale_scheduler_states
from hvdp.torch.runtime import _plain, hvd
from hvdp.torch.sharded import ShardedOptimizer


def _fingerprint(model: torch.nn.Module) -> str:
    return ckpt.fingerprint((n, tuple(t.shape)) for n, t in model.state_dict().items())


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout on a GPU draws from its generator
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    epoch: int, step: int, global_step: int, keep: int = 3, **extra: Any) -> Path | None:
    """Write a checkpoint on rank 0 (atomically) and keep the newest `keep`; every rank must call it.

    `epoch` and `step` (batches done in that epoch) say where to resume the data order; `global_step`
    names the file. Also stored: the optimizer's step count and every rank's RNG states (torch, numpy,
    random), so a resumed run continues exactly. Ends with a barrier: the other ranks wait for the write.

    Args:
        directory: where to write "ckpt-<global_step:08d>.pt"; created if missing.
        model: the module whose state_dict is saved.
        optimizer: the optimizer (prepare()'s, for its step count) whose state_dict is saved.
        epoch: the epoch the data position is in.
        step: batches already done in that epoch (0 at an epoch end).
        global_step: the global optimizer step; names the file.
        keep: how many of the newest checkpoints to keep, this one included (default 3).
        extra: plain values (numbers, strings, lists, dicts, tensors) returned by load_checkpoint.

    Returns:
        The path on rank 0, None elsewhere.

    Raises:
        ConfigError: `keep` is not an integer >= 1 (on every rank, before any collective).
        CheckpointError: rank 0 could not write the file (read-only directory, disk full: the path and the
            OS error), on every rank; the older checkpoints are kept.
    """
    model = _plain(model)
    ckpt.check_keep(keep)
    # every rank's RNG, so a resumed run continues exactly (an error on one rank is raised on all)
    rng = _horovod.gather_or_raise(hvd, _rng_state, name="hvdp.rng", operation="save_checkpoint")
    # a sharded optimizer's state, gathered on rank 0 in the unsharded layout (a collective)
    gathered = optimizer.gathered_state_dict(to=0) if isinstance(optimizer, ShardedOptimizer) else None
    if hvd.rank() != 0:
        return _horovod.save_on_root(hvd, directory, "", None, keep)
    schedule = getattr(optimizer, "hvdp_schedule", None)

    def write(f):  # inside save_on_root's error handling: whatever fails on rank 0 is raised on every rank
        torch.save({
            "hvdp": ckpt.make_meta(framework="torch", step=global_step, epoch=epoch, world_size=hvd.size(),
                                   model_fingerprint=_fingerprint(model)),
            "model": model.state_dict(),
            "optimizer": gathered if gathered is not None else optimizer.state_dict(),
            "position": {"epoch": int(epoch), "step": int(step),
                         "optimizer_steps": schedule.step if schedule else 0,
                         "lr_multiplier": schedule.multiplier if schedule else 1.0},
            "rng": rng,
            "extra": extra,
        }, f)

    return _horovod.save_on_root(hvd, directory, ckpt.checkpoint_name(global_step, "pt"), write, keep)


def load_checkpoint(directory: str | Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loader: torch.utils.data.DataLoader | None = None) -> dict | None:
    """Restore the newest checkpoint in `directory` on every rank; None (and nothing changed) if there is none.

    Rank 0 reads the file with torch.load(weights_only=True) and broadcasts it; a corrupt, truncated or
    foreign file raises CheckpointError naming it, on every rank. With `loader`, its data order resumes at
    the saved epoch and step. Every rank must call it. The RNG states are restored when the world size is
    the one that saved the checkpoint.

    The learning rates resume at this world's scale (hvdp.core.scaling.learning_rate): the param groups'
    (with the initial_lr, max_lr and min_lr torch's schedulers keep there), and those of every LR scheduler
    state_dict() saved among the extras (base_lrs, the last rates, CyclicLR's max_lrs), so that
    `scheduler.load_state_dict(resumed["scheduler"])` continues the schedule at this world's rate.

    Args:
        directory: the checkpoint directory; None, a missing directory or one without checkpoints: nothing
            to resume, returns None.
        model: the module to load the saved state_dict into (the same parameter names and shapes).
        optimizer: the optimizer to load the saved state into (prepare()'s: its step count is restored too).
        loader: the DataLoader shard() returned, to resume its data order (default None: left as it is).

    Returns:
        {"epoch", "step", "global_step", **extra} as saved (LR schedulers' rates rescaled), or None when there
        is no checkpoint.

    Raises:
        CheckpointError: the newest file is corrupt, truncated, not hvdp's, from another framework or model;
            or, with `loader`, it was taken mid-epoch with another number of ranks. On every rank.
    """
    model = _plain(model)
    payload = _horovod.read_checkpoint_on_root(hvd, directory, lambda path: _read(path, model, loader is not None),
                                               _ARRAYS, into=_into(model, optimizer))
    if payload is None:
        return None
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    position = payload["position"]
    extra = payload["extra"]
    schedule = getattr(optimizer, "hvdp_schedule", None)
    if schedule is not None:
        schedule.step = position["optimizer_steps"]
        # The restored rates are base x the multiplier of the world that saved them (older files lack it:
        # recompute it from the saved world size with this job's rule): make them base x this world's, in the
        # param groups and in any LR scheduler's state saved among the extras (which the caller loads after this).
        saved = position.get("lr_multiplier")
        if saved is None:
            saved = lr_multiplier(schedule.rule, payload["hvdp"]["world_size"],
                                  backward_passes_per_step=schedule.passes, op=schedule.op)
        _rescale_groups(optimizer, saved, hvd.size())
        if saved != schedule.multiplier:
            extra = _rescale_scheduler_states(extra, saved, schedule)
    if payload["hvdp"]["world_size"] == hvd.size():
        _set_rng_state(payload["rng"][hvd.rank()])
    if loader is not None:
        target = loader if hasattr(loader, "set_position") else loader.batch_sampler
        target.set_position(position["epoch"], position["step"])
    return {"epoch": position["epoch"], "step": position["step"], "global_step": payload["hvdp"]["step"],
            **extra}


def _read(path: Path, model: torch.nn.Module, resharding_data: bool) -> dict:
    # Memory-mapped: the tensors are paged in from the file as they are streamed, not read into memory.
    try:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            payload = torch.load(path, map_location="cpu", weights_only=True)  # an old, non-zip file
    except OSError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}. The file is corrupt, "
                              f"truncated or not a PyTorch checkpoint; delete it to resume from an older one")
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not an hvdp checkpoint")
    meta = ckpt.check_meta(payload.get("hvdp"), path, framework="torch", model_fingerprint=_fingerprint(model))
    missing = [k for k in ("model", "optimizer", "position", "rng", "extra") if k not in payload]
    if missing:
        raise CheckpointError(f"{path} has an hvdp header but no {', '.join(repr(k) for k in missing)} entry: it was "
                              f"not written by hvdp.torch.save_checkpoint (or was edited); delete it to resume from "
                              f"an older one")
    if resharding_data and meta["world_size"] != hvd.size() and payload["position"]["step"]:
        raise CheckpointError(
            f"the checkpoint was taken mid-epoch with {meta['world_size']} ranks and this job has {hvd.size()}: "
            f"its data position cannot be resharded exactly; resume with {meta['world_size']} ranks, or from an "
            f"end-of-epoch checkpoint")
    return payload


class _TorchArrays(_horovod.ArrayOps):
    """Tensors for _horovod.broadcast_tree: their bytes, viewed as uint8 in host memory, go through Horovod's
    broadcast; the receiving side's load_state_dict puts them on the model's device."""

    def is_array(self, x) -> bool:
        return isinstance(x, torch.Tensor)

    def describe(self, x):
        return tuple(x.shape), x.dtype, x.numel() * x.element_size()

    def empty(self, ref):
        return torch.empty(ref.shape, dtype=ref.dtype)

    def fits(self, x, ref) -> bool:
        return (isinstance(x, torch.Tensor) and tuple(x.shape) == ref.shape and x.dtype == ref.dtype
                and x.device.type == "cpu" and x.is_contiguous())

    def as_bytes(self, x):  # a GPU tensor is sent from a host copy (and arrives in host memory elsewhere)
        return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()

    def broadcast(self, hvd_, buffer, name: str) -> None:
        hvd_.broadcast_(torch.from_numpy(buffer), root_rank=0, name=name)


_ARRAYS = _TorchArrays()


def _into(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable:
    """broadcast_tree's destinations for a checkpoint or an optimizer sync: the model's own tensors and the
    optimizer's existing state, so that those arrive in place instead of as a second copy."""
    params = model.state_dict() if model is not None else {}
    # a sharded optimizer's state arrives whole, in the unsharded layout, and load_state_dict keeps a slice
    state = {} if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()["state"]

    def into(path, ref):
        if len(path) == 2 and path[0] == "model":
            return params.get(path[1])
        if len(path) == 4 and path[:2] == ("optimizer", "state"):
            return state.get(path[2], {}).get(path[3])
        return None
    return into
