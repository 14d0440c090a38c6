"""What the framework adapters share about Horovod itself: importing it with a useful error, initialising
it, and checking that it was built with what the launcher is about to use. Takes Horovod's framework
module as an argument; imports nothing heavy at module level."""

from __future__ import annotations

import atexit
import importlib
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hvdp.core import checkpoint as ckpt
from hvdp.core.cpus import cpu_share, threads_per_rank
from hvdp.core.devices import DeviceRequest, gpu_index, shared_gpus, sharing_error
from hvdp.core.errors import CheckpointError, ConfigError, SetupError
from hvdp.core.tuning import apply_runtime_defaults, check_shm_settings
from hvdp.core.watchdog import Watchdog, open_socket
from hvdp.core.watchdog import settings as watchdog_settings
from hvdp.core.world import World, detect_launcher, elastic

_FRAMEWORK_MODULES = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}


def import_horovod(framework: str):
    """Import horovod.<framework>, turning a missing or mis-built Horovod into the fix to apply."""
    name = _FRAMEWORK_MODULES[framework]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise SetupError(
            f"cannot import {name} ({e}). Horovod is missing or was not built with "
            f"{'PyTorch' if framework == 'torch' else 'TensorFlow'}: run `make setup` "
            f"(or check `horovodrun --check-build`)") from e


def init(framework: str, timeline: str | None = None):
    """hvd.init() for `framework`; returns (horovod module, World). Safe to call twice.

    `timeline` starts Horovod's timeline (a Chrome trace of every collective) written by rank 0 there.
    """
    hvd = import_horovod(framework)
    launcher = detect_launcher()
    if (launcher.startswith("mpirun") or launcher == "horovodrun (mpi)") and not hvd.mpi_built():
        raise SetupError(
            f"launched by {launcher}, but this Horovod was built without MPI: rebuild it with "
            f"HOROVOD_WITH_MPI=1 (`make setup` does) or launch with `horovodrun --gloo`")
    if not hvd.is_initialized():
        check_shm_settings()
        apply_runtime_defaults()  # before MPI_Init / Horovod's background thread read them
        hvd.init()
    if timeline:
        hvd.start_timeline(timeline, mark_cycles=False)
    world = World.from_horovod(hvd)
    _start_watchdog(hvd, world)
    global _threads
    _threads = _thread_share(hvd, world)
    return hvd, world


_threads = 1


def threads() -> int:
    """Intra-op threads for this rank, decided at init() from what every rank on its host may use."""
    return _threads


def _thread_share(hvd, world: World) -> int:
    # Collective (every rank calls init): each rank's affinity and cgroup quota, so that ranks bound to
    # disjoint cores keep theirs and ranks sharing cores or a quota split them (hvdp.core.cpus).
    mine = cpu_share()
    if world.size == 1:
        return threads_per_rank(mine, [mine])
    if elastic():
        # Not a collective here: a worker that joins a running elastic job calls init() alone (the others
        # are already training), so it would wait forever. Assume the local ranks share this rank's CPUs.
        return threads_per_rank(mine, [mine] * world.local_size)
    host = socket.gethostname()
    everyone = hvd.allgather_object((host, mine), name="hvdp.cpus")
    return threads_per_rank(mine, [share for h, share in everyone if h == host])


def place(hvd, world: World, req: DeviceRequest, visible: int, gpu_id: Callable[[int], str]) -> int | None:
    """This rank's GPU index among the `visible` ones (hvdp.core.devices.gpu_index), or None for the CPU.

    Collective in a job of 2+ ranks (outside elastic mode, where a joining worker calls init() alone): the
    ranks exchange which GPU each took, identified by `gpu_id(index)` (a UUID), so that two ranks on one GPU
    (NCCL's "Duplicate GPU detected", or both out of memory) and a rank that cannot have the device it asked
    for are a ConfigError on every rank, naming them, instead of a hang or a crash on one.
    """
    try:
        index = gpu_index(req, world.local_rank, visible)
        mine, problem = (None if index is None else (socket.gethostname(), gpu_id(index))), None
    except ConfigError as e:
        index, mine, problem = None, None, str(e)
    if world.size == 1 or elastic():
        everyone = [(mine, problem)]
    else:
        everyone = hvd.allgather_object((mine, problem), name="hvdp.gpus")
    failed = [(rank, p) for rank, (_, p) in enumerate(everyone) if p]
    if failed:
        raise ConfigError("; ".join(f"rank {rank}: {p}" for rank, p in failed), rank=world.rank)
    message = None if req.share else sharing_error(shared_gpus([m for m, _ in everyone]), visible)
    if message:
        raise ConfigError(message, rank=world.rank)
    return index


_watchdog: Watchdog | None = None


def progress(step: int, phase: str) -> None:
    """Tell the watchdog where this rank is (no-op without one)."""
    if _watchdog is not None:
        _watchdog.progress(step, phase)


def _start_watchdog(hvd, world: World) -> None:
    """Start hvdp's heartbeat thread (see hvdp.core.watchdog) once per process, for jobs of 2+ ranks.

    It listens on one UDP port: on 127.0.0.1 when all ranks share this host, otherwise on the address of
    HVDP_WATCHDOG_IFACE / HOROVOD_GLOO_IFACE when set (the interface the job runs on), else on all.
    """
    global _watchdog
    enabled, timeout, elsewhere_timeout = watchdog_settings()
    if _watchdog is not None or not enabled or world.size == 1 or elastic():
        return  # an elastic job expects to lose ranks: Horovod's elastic driver handles that, not the watchdog
    if world.local_size == world.size:
        bind, addresses = "127.0.0.1", ["127.0.0.1"]
    else:
        addresses = _interface_addresses(os.environ.get("HVDP_WATCHDOG_IFACE") or os.environ.get("HOROVOD_GLOO_IFACE"))
        bind = addresses[0] if len(addresses) == 1 else "0.0.0.0"
    sock = open_socket(bind)
    port = sock.getsockname()[1]
    peers = hvd.allgather_object([(a, port) for a in addresses], name="hvdp.watchdog.peers")
    # The heartbeats are signed with a per-job secret agreed through Horovod, so that no other process (or
    # other hvdp job on the host) can forge or confuse them.
    secret = hvd.broadcast_object(secrets.token_bytes(32) if world.rank == 0 else None, root_rank=0,
                                  name="hvdp.watchdog.secret")
    _watchdog = Watchdog(world.rank, peers, sock, secret=secret, timeout=timeout,
                         elsewhere_timeout=elsewhere_timeout).start()
    atexit.register(_watchdog.stop)


def _interface_addresses(iface: str | None) -> list[str]:
    import psutil  # a Horovod dependency
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        if (iface and name != iface) or (not iface and name == "lo"):
            continue
        found += [a.address for a in addrs if a.family == socket.AF_INET]
    return found or ["127.0.0.1"]


def controller(hvd) -> str:
    """Which controller this job runs on: 'mpi', 'gloo', or 'none' (a single process)."""
    if hvd.mpi_enabled():
        return "mpi"
    if hvd.gloo_enabled():
        return "gloo"
    return "none"


# ------------------------------------------------------------------ checkpoints and big state, streamed

STREAM_CHUNK = 64 << 20  # bytes per collective when broadcasting arrays; every rank holds one such buffer


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """Where an array was in a broadcast tree: its index in the stream, key path, shape, dtype and size."""

    index: int
    path: tuple
    shape: tuple
    dtype: Any
    nbytes: int


class ArrayOps:
    """How broadcast_tree handles one framework's arrays; each adapter passes its own (TorchArrays, ...)."""

    def is_array(self, x) -> bool: ...
    def describe(self, x) -> tuple[tuple, Any, int]: ...   # (shape, dtype, nbytes)
    def empty(self, ref: ArrayRef): ...
    def fits(self, x, ref: ArrayRef) -> bool: ...          # can `x` receive `ref`'s bytes in place?
    def as_bytes(self, x): ...                             # a 1-D uint8 numpy view sharing x's memory
    def broadcast(self, hvd, buffer, name: str) -> None: ...  # in place, from rank 0


def broadcast_tree(hvd, ops: ArrayOps, tree, *, name: str, into: Callable | None = None):
    """Broadcast `tree` (nested dicts, lists and tuples of arrays and plain values, on rank 0; ignored
    elsewhere) from rank 0 without pickling its arrays. Every rank must call it.

    The structure and the plain values go by broadcast_object (small); the arrays' bytes stream through one
    STREAM_CHUNK-byte buffer, several small arrays packed into one collective. So a state of any size
    (Horovod's broadcast_object sends its length as int32: 2 GiB at most) is sent with bounded extra memory:
    `into(path, ref)` may name an existing array of the same shape and dtype to receive an array in place
    (a model's parameters); the others are allocated once. Returns the tree on every rank (on rank 0 too,
    with its arrays copied into those destinations, so that no rank keeps the source's memory).
    """
    import numpy as np

    root = hvd.rank() == 0
    sources: list = []

    def strip(x, path):
        if ops.is_array(x):
            shape, dtype, nbytes = ops.describe(x)
            sources.append(x)
            return ArrayRef(len(sources) - 1, path, shape, dtype, nbytes)
        if isinstance(x, dict):
            return type(x)((k, strip(v, path + (k,))) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v, path + (i,)) for i, v in enumerate(x))
        return x

    skeleton = hvd.broadcast_object(strip(tree, ()) if root else None, root_rank=0, name=name)
    refs: list[ArrayRef] = []

    def collect(x):
        if isinstance(x, ArrayRef):
            refs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(skeleton)
    dests = []
    for ref in refs:
        d = into(ref.path, ref) if into is not None else None
        dests.append(d if d is not None and ops.fits(d, ref) else ops.empty(ref))
    total = sum(ref.nbytes for ref in refs)
    if total and hvd.size() > 1:
        size = min(STREAM_CHUNK, total)
        staging = np.empty(size, dtype=np.uint8)
        pending, fill = [], 0

        def flush():
            ops.broadcast(hvd, staging, f"{name}.stream")  # always the whole buffer: one shape, one name
            if not root:
                for view, at, start, n in pending:
                    view[at:at + n] = staging[start:start + n]
            pending.clear()

        for ref, dest in zip(refs, dests):
            view = ops.as_bytes(dest)
            source = ops.as_bytes(sources[ref.index]) if root else None
            offset = 0
            while offset < ref.nbytes:
                n = min(ref.nbytes - offset, size - fill)
                if root:
                    staging[fill:fill + n] = source[offset:offset + n]
                else:
                    pending.append((view, offset, fill, n))
                fill += n
                offset += n
                if fill == size:
                    flush()
                    fill = 0
            if root:
                view[:] = source
        if fill:
            flush()
    elif root:
        for ref, dest in zip(refs, dests):
            ops.as_bytes(dest)[:] = ops.as_bytes(sources[ref.index])
    sources.clear()

    def build(x):
        if isinstance(x, ArrayRef):
            return dests[x.index]
        if isinstance(x, dict):
            return type(x)((k, build(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(build(v) for v in x)
        return x

    return build(skeleton)


def read_checkpoint_on_root(hvd, directory, read, ops: ArrayOps, into: Callable | None = None):
    """Rank 0 reads the newest checkpoint in `directory` with `read(path)`; every rank gets the payload
    (None when there is none), streamed by broadcast_tree (`into` as there), or raises the same
    CheckpointError naming the file, the OS error and the rank, so no rank is left waiting for the others."""
    outcome: dict = {}
    if hvd.rank() == 0:
        path = None
        try:
            path = ckpt.latest_checkpoint(directory)
            outcome = {"payload": read(path)} if path else {}
        except CheckpointError as e:
            outcome = {"error": str(e)}
        except OSError as e:  # deleted between the listing and the read, unreadable, an I/O error
            outcome = {"error": f"cannot read checkpoint {path or directory} on rank 0: {type(e).__name__}: {e}. "
                                f"Check that it exists and is readable (another job pruning the same directory "
                                f"deletes files while they are read)"}
    outcome = broadcast_tree(hvd, ops, outcome, name="hvdp.load_checkpoint",
                             into=(lambda path, ref: into(path[1:], ref)) if into else None)
    if "error" in outcome:
        raise CheckpointError(outcome["error"], rank=hvd.rank())
    return outcome.get("payload")


def save_on_root(hvd, directory, name: str, write: Callable, keep: int):
    """Rank 0 writes `directory`/`name` atomically with `write(fileobj)` and keeps the newest `keep`; every
    rank returns together (the path on rank 0, None elsewhere) or raises the same CheckpointError naming the
    path, the OS error and the rank (read-only directory, disk full). Every rank must call it; `write` is
    only called on rank 0."""
    outcome: dict = {}
    if hvd.rank() == 0:
        path = Path(directory) / name
        try:
            ckpt.write_atomic(path, write)
        except Exception as e:  # noqa: BLE001 - whatever failed, every rank must hear of it
            outcome = {"error": f"cannot write checkpoint {path} on rank 0: {type(e).__name__}: {e}. Nothing was "
                                f"replaced: the older checkpoints are intact. Check that the directory is writable "
                                f"and has room for the checkpoint"}
        else:
            try:
                ckpt.prune(directory, keep)
                outcome = {"path": str(path)}
            except OSError as e:
                outcome = {"error": f"wrote checkpoint {path} on rank 0, but could not delete the older ones "
                                    f"(keep={keep}): {type(e).__name__}: {e}"}
    outcome = hvd.broadcast_object(outcome, root_rank=0, name="hvdp.save_checkpoint")
    if "error" in outcome:
        raise CheckpointError(outcome["error"], rank=hvd.rank())
    return Path(outcome["path"]) if hvd.rank() == 0 else None
