"""Checkpoints: save_checkpoint() on rank 0, atomically, and load_checkpoint() read on rank 0 and streamed
to every rank, with the data position, RNG states and the learning rate of the world it resumes in."""

from __future__ import annotations

import os
import random
import struct
import zipfile
import zlib
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
from hvdp.torch.sharded_state import Streamed


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

    A sharded optimizer's state (prepare(..., shard_optimizer_state=True)) is written in the unsharded layout
    (torch's state_dict of the original optimizer: the file does not depend on the world size) and streamed:
    rank 0 writes the file's skeleton with torch.serialization.skip_data() (every tensor's space reserved,
    nothing allocated for the state), then each tensor's bytes at its offset, the optimizer state bucket by
    bucket as the ranks all-gather it. So no rank holds more than its shard plus one bucket's gathered state,
    where building the whole state on rank 0 first would need its full size there. On torch < 2.6 (no
    skip_data) or without /proc, rank 0 gathers the whole state and torch.saves it.

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
    sharded = isinstance(optimizer, ShardedOptimizer)
    streamed = sharded and _can_stream()
    name = ckpt.checkpoint_name(global_step, "pt")
    # a sharded optimizer's state in the unsharded layout: streamed into the file (a skeleton now, the values
    # bucket by bucket while rank 0 writes), or on an older torch gathered whole on rank 0 (collectives)
    if streamed:
        keys, state = optimizer.state_skeleton(to=0)
    elif sharded:
        state = optimizer.gathered_state_dict(to=0)
    if hvd.rank() != 0:
        if streamed and hvd.broadcast_object(None, root_rank=0, name=_STREAMING):  # rank 0 is writing: feed it
            optimizer.gather_state(keys)
        return _horovod.save_on_root(hvd, directory, name, None, keep)
    schedule = getattr(optimizer, "hvdp_schedule", None)

    def contents() -> dict:  # called inside save_on_root's error handling: an error is raised on every rank
        return {
            "hvdp": ckpt.make_meta(framework="torch", step=global_step, epoch=epoch, world_size=hvd.size(),
                                   model_fingerprint=_fingerprint(model)),
            "model": model.state_dict(),
            "optimizer": state if sharded else optimizer.state_dict(),
            "position": {"epoch": int(epoch), "step": int(step),
                         "optimizer_steps": schedule.step if schedule else 0,
                         "lr_multiplier": schedule.multiplier if schedule else 1.0},
            "rng": rng,
            "extra": extra,
        }

    if not streamed:
        return _horovod.save_on_root(hvd, directory, name, lambda f: torch.save(contents(), f), keep)

    announced = []

    def announce(writing: bool) -> None:  # tells the other ranks whether to join gather_state()
        announced.append(writing)
        hvd.broadcast_object(writing, root_rank=0, name=_STREAMING)

    def write(f):
        try:
            payload = contents()
            offsets = _write_skeleton(payload, f)
        except BaseException:
            announce(False)
            raise
        announce(True)
        _stream_into(f.fileno(), payload, offsets, optimizer, keys)

    def before_outcome():  # the temp file could not even be created: write() never ran
        if not announced:
            announce(False)

    return _horovod.save_on_root(hvd, directory, name, write, keep, before_outcome=before_outcome)


_STREAMING = "hvdp.save_checkpoint.streaming"


def _can_stream() -> bool:
    """Whether this torch can write a file's skeleton without its tensors' bytes (torch.serialization.skip_data,
    torch >= 2.6) and this system can reopen a write-only file for reading (/proc/self/fd: Linux)."""
    return hasattr(torch.serialization, "skip_data") and os.path.isdir("/proc/self/fd")


def _write_skeleton(payload: dict, f) -> dict:
    """torch.save `payload` into `f` with every tensor's bytes left out (torch.serialization.skip_data: the
    zip's records, the pickle and the space each storage takes, left unwritten), then read the file's index
    back (map_location="meta": no data) for where each storage's bytes go. Returns {id(tensor): offset} for
    every tensor of `payload`. (The zip's CRC-32 of each storage record is then that of bytes not written yet:
    _set_crcs() corrects them at the end.)"""
    with torch.serialization.skip_data():
        torch.save(payload, f)
    f.flush()
    with open(f"/proc/self/fd/{f.fileno()}", "rb") as r:  # the same file, open for reading
        index = torch.load(r, map_location="meta", weights_only=True)
    offsets: dict = {}

    def walk(ours, theirs):
        if isinstance(ours, torch.Tensor):
            offset = getattr(theirs.untyped_storage(), "_checkpoint_offset", None)
            if offset is None:
                raise CheckpointError(f"torch {torch.__version__} gave no storage offset reading back the "
                                      f"checkpoint's index: cannot stream the optimizer state into it")
            offsets[id(ours)] = offset
        elif isinstance(ours, dict):
            for k, v in ours.items():
                walk(v, theirs[k])
        elif isinstance(ours, (list, tuple)):
            for v, w in zip(ours, theirs):
                walk(v, w)

    walk(payload, index)
    return offsets


def _pwrite(fd: int, data, offset: int) -> int:
    """Write `data` (a buffer) at `offset` of `fd`; returns its CRC-32."""
    view = memoryview(data).cast("B")
    crc = zlib.crc32(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    return crc


def _set_crcs(fd: int, crcs: dict) -> None:
    """Put the CRC-32 of each storage record whose data starts at an offset in `crcs` where torch.save puts it
    (the zip's central directory and the record's data descriptor; its local header says 0, as torch's own),
    in place of the CRC of nothing that skip_data left: the file is then a zip that `unzip -t` accepts."""
    with open(f"/proc/self/fd/{fd}", "rb") as r:
        archive = zipfile.ZipFile(r)
        infos, at = archive.infolist(), archive.start_dir
        for info in infos:  # in the central directory's order
            r.seek(info.header_offset + 26)
            data = info.header_offset + 30 + sum(struct.unpack("<HH", r.read(4)))
            r.seek(at + 28)
            name, extra, comment = struct.unpack("<HHH", r.read(6))
            if data in crcs:
                crc = struct.pack("<I", crcs[data])
                os.pwrite(fd, crc, at + 16)
                if info.flag_bits & 0x08:  # a data descriptor follows the data, with or without its signature
                    r.seek(data + info.compress_size)
                    signed = struct.unpack("<I", r.read(4))[0] == 0x08074B50
                    os.pwrite(fd, crc, data + info.compress_size + (4 if signed else 0))
            at += 46 + name + extra + comment


def _stream_into(fd: int, payload: dict, offsets: dict, optimizer: ShardedOptimizer, keys: list) -> None:
    """Fill the storages _write_skeleton left empty: every tensor of `payload` but the optimizer's per-element
    state from memory, then that state bucket by bucket as gather_state() gathers it (with the other ranks);
    each part is written at its storage's offset. An error while writing is raised after the gather, so that
    no rank is left in its collectives."""
    placeholders = {id(v) for entry in payload["optimizer"]["state"].values() for k, v in entry.items()
                    if (k, True) in keys}
    failure, crcs = None, {}
    try:
        for tensor in _tensors(payload):
            if id(tensor) not in placeholders:
                storage = tensor.untyped_storage()
                if storage.nbytes():
                    at = offsets[id(tensor)]
                    crcs[at] = _pwrite(fd, torch.empty(0, dtype=torch.uint8).set_(storage.cpu()).numpy(), at)
    except Exception as e:  # noqa: BLE001 - raised below, after the collectives
        failure = e
    state = payload["optimizer"]["state"]

    def put(index, key, values):
        nonlocal failure
        if failure is None:
            try:
                at = offsets[id(state[index][key])]
                crcs[at] = _pwrite(fd, values.detach().cpu().contiguous().view(torch.uint8).numpy(), at)
            except Exception as e:  # noqa: BLE001 - raised below, after the collectives
                failure = e

    optimizer.gather_state(keys, put)
    if failure is not None:
        raise failure
    _set_crcs(fd, crcs)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def load_checkpoint(directory: str | Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loader: torch.utils.data.DataLoader | None = None) -> dict | None:
    """Restore the newest checkpoint in `directory` on every rank; None (and nothing changed) if there is none.

    Rank 0 reads the file with torch.load(weights_only=True, mmap=True) and broadcasts it; a corrupt, truncated
    or foreign file raises CheckpointError naming it, on every rank. For a sharded optimizer, the per-element
    state (Adam's moments, momentum) is not broadcast whole: it stays in rank 0's mapping of the file, and
    ShardedOptimizer.load_streamed() broadcasts it bucket by bucket, every rank keeping its slice of this
    world's layout (a rank holds its shard plus one bucket's buffer). With `loader`, its data order resumes at
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
    sharded = isinstance(optimizer, ShardedOptimizer)
    held: dict = {}  # rank 0, a sharded optimizer: the per-element state, memory-mapped, sent bucket by bucket

    def read(path):
        payload = _read(path, model, loader is not None)
        if sharded:  # broadcast the rest as it is; these tensors go by load_streamed()
            held.update(optimizer.per_element(payload["optimizer"]))
            payload["optimizer"] = _hold_out(payload["optimizer"], held)
        return payload

    payload = _horovod.read_checkpoint_on_root(hvd, directory, read, _ARRAYS, into=_into(model, optimizer))
    if payload is None:
        return None
    model.load_state_dict(payload["model"])
    if sharded:
        optimizer.load_streamed(payload["optimizer"], (lambda index, key: held[index, key]) if held else None)
        held.clear()
    else:
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


def _hold_out(state_dict: dict, held: dict) -> dict:
    """`state_dict` with each tensor of `held` ({(index, key): tensor}) replaced by a Streamed stand-in."""
    state = {index: {k: Streamed(tuple(v.shape), v.dtype) if (index, k) in held else v for k, v in entry.items()}
             for index, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


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
    # a sharded optimizer: its per-element state is not in the broadcast (load_streamed sends it bucket by
    # bucket), and what is (step counts) is small: allocated as it arrives
    state = {} if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()["state"]

    def into(path, ref):
        if len(path) == 2 and path[0] == "model":
            return params.get(path[1])
        if len(path) == 4 and path[:2] == ("optimizer", "state"):
            return state.get(path[2], {}).get(path[3])
        return None
    return into
