"""Checkpoint policy shared by every adapter: file names, atomic writes, retention and the metadata check.

The adapters only serialise (torch.save, numpy's savez); where and how safely the bytes land is decided
here. A checkpoint is written to a temporary file in the same directory, fsynced, renamed into place and
the directory fsynced, so a crash at any moment leaves either the old set of checkpoints or the new one,
never a half-written file under a checkpoint name.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from hvdp.core.errors import CheckpointError, ConfigError

FORMAT = "hvdp-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d{8})\.(pt|npz)$")


def checkpoint_name(step: int, suffix: str) -> str:
    """The file name for the checkpoint taken after global optimizer step `step`: "ckpt-<step:08d>.<suffix>".

    Args:
        step: the global optimizer step, >= 0; names sort in step order.
        suffix: the format's extension without the dot: "pt" (PyTorch) or "npz" (TensorFlow/Keras).
    """
    return f"ckpt-{step:08d}.{suffix}"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first. Temporary files of interrupted saves are ignored.

    Returns an empty list when `directory` does not exist.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike | None) -> Path | None:
    """The newest checkpoint in `directory`, or None when there is none (or no directory)."""
    if directory is None:
        return None
    found = list_checkpoints(directory)
    return found[-1] if found else None


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None]) -> Path:
    """Call `write(fileobj)` on a temp file next to `path`, then fsync and rename it into place.

    The parent directories are created; the directory is fsynced after the rename. If `write` raises, the
    temp file is removed, the error propagates, and whatever was at `path` before is untouched.

    Args:
        path: the final file name.
        write: called once with the open binary file object; it must not close it.

    Returns:
        `path` as a Path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by its path (a directory after a rename in it, so that the rename lasts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and stale temp files); return what was deleted.

    Args:
        directory: the checkpoint directory (one that does not exist has nothing to delete).
        keep: how many of the newest to keep; 0 or less deletes them all.

    Returns:
        The checkpoint paths deleted, oldest first (temp files are not listed).
    """
    found = list_checkpoints(directory)
    doomed = found[:-keep] if keep > 0 else found
    for p in doomed:
        p.unlink(missing_ok=True)
    for stale in Path(directory).glob(".ckpt-*.tmp"):
        stale.unlink(missing_ok=True)
    return doomed


def fingerprint(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """A short hash of a model's parameter names and shapes, to recognise a checkpoint of another model.

    Args:
        shapes: (name, shape) pairs in the model's fixed order; values are not hashed.

    Returns:
        16 hex characters.
    """
    h = hashlib.sha256()
    for name, shape in shapes:
        h.update(f"{name}:{tuple(int(s) for s in shape)};".encode())
    return h.hexdigest()[:16]


def make_meta(*, framework: str, step: int, epoch: int, world_size: int, model_fingerprint: str) -> dict:
    """The metadata header every hvdp checkpoint carries, checked by check_meta on load.

    Args:
        framework: the adapter's tag ("torch", or "tensorflow" for hvdp.tensorflow and hvdp.keras).
        step: the global optimizer step the checkpoint was taken at.
        epoch: the epoch the data position is in.
        world_size: the number of ranks that wrote it.
        model_fingerprint: fingerprint() of the model.

    Returns:
        A plain dict (JSON-serialisable) with "format" = FORMAT and the values above.
    """
    return {"format": FORMAT, "framework": framework, "step": int(step), "epoch": int(epoch),
            "world_size": int(world_size), "fingerprint": model_fingerprint}


def check_meta(meta: Any, path: Path, *, framework: str, model_fingerprint: str) -> dict:
    """Refuse a checkpoint that hvdp did not write, or that belongs to another framework or model.

    Args:
        meta: the header read from the file (anything: a non-dict is refused).
        path: the file, for the messages.
        framework: the adapter's tag that must match the header's.
        model_fingerprint: fingerprint() of the model being restored; must match the header's.

    Returns:
        `meta`, when it is acceptable.

    Raises:
        CheckpointError: `meta` is not an hvdp header (FORMAT), or is from another framework or model.
    """
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an hvdp checkpoint (no '{FORMAT}' header); "
                              f"point --checkpoint-dir at a directory written by hvdp")
    if meta.get("framework") != framework:
        raise CheckpointError(f"{path} was written by the {meta.get('framework')} adapter, not {framework}")
    if meta.get("fingerprint") != model_fingerprint:
        raise CheckpointError(
            f"{path} holds a different model (parameter names/shapes fingerprint {meta.get('fingerprint')}, "
            f"this model {model_fingerprint}); use another --checkpoint-dir or the model it was saved from")
    return meta


def check_keep(keep: Any) -> int:
    """Refuse a retention count that would delete the checkpoint just written.

    Args:
        keep: how many checkpoints to keep.

    Returns:
        `keep`, an integer >= 1.

    Raises:
        ConfigError: `keep` is not an integer >= 1 (prune(directory, 0) deletes every checkpoint).
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError(f"keep must be an integer >= 1 (the checkpoint just written counts), got {keep!r}")
    return keep


__all__ = ["FORMAT", "checkpoint_name", "list_checkpoints", "latest_checkpoint", "write_atomic", "fsync_path", "prune",
           "check_keep", "fingerprint", "make_meta", "check_meta"]
