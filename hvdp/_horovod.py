"""What the framework adapters share about Horovod itself: importing it with a useful error, initialising
it, and checking that it was built with what the launcher is about to use. Takes Horovod's framework
module as an argument; imports nothing heavy at module level."""

from __future__ import annotations

import atexit
import copy
import functools
import importlib
import os
import secrets
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hvdp import _output, _workers
from hvdp.core import checkpoint as ckpt
from hvdp.core import errors as _errors
from hvdp.core.consistency import failure, settings_mismatch
from hvdp.core.cpus import cpu_share, threads_per_rank
from hvdp.core.devices import DeviceRequest, gpu_index, shared_gpus, sharing_error
from hvdp.core.errors import CheckpointError, ConfigError, SetupError
from hvdp.core.scaling import LRScalingWarning, adaptive_warning, describe_scaling
from hvdp.core.tuning import apply_runtime_defaults, check_shm_settings
from hvdp.core.watchdog import EXIT_CODE as WATCHDOG_EXIT_CODE
from hvdp.core.heartbeats import open_socket
from hvdp.core.watchdog import Collectives, Watchdog
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

    Collective the first time (the watchdog's address exchange, the CPU count); a later call in the same
    world runs no collective, so one rank alone may call it again.

    `timeline` starts Horovod's timeline (a Chrome trace of every collective) written by rank 0 there.
    """
    hvd = import_horovod(framework)
    launcher = detect_launcher()
    if launcher != "python (single process)":
        _output.whole_lines()  # the launcher tags what it reads: a rank's lines must leave it whole
    if (launcher.startswith("mpirun") or launcher == "horovodrun (mpi)") and not hvd.mpi_built():
        raise SetupError(
            f"launched by {launcher}, but this Horovod was built without MPI: rebuild it with "
            f"HOROVOD_WITH_MPI=1 (`make setup` does) or launch with `horovodrun --gloo`")
    if not hvd.is_initialized():
        _workers.refuse_helper_import(f"hvdp.{framework}.init()")  # a worker re-importing the script: no Horovod
        check_shm_settings()
        apply_runtime_defaults()  # before MPI_Init / Horovod's background thread read them
        hvd.init()
        _workers.note_init_site(f"hvdp.{framework}.init()")
    _workers.guard_forks()  # Horovod's threads run from here on: warn once at a fork
    if timeline:
        hvd.start_timeline(timeline, mark_cycles=False)
    world = World.from_horovod(hvd)
    global _threads, _ready
    if _ready != (world.rank, world.size):  # a later call in the same world gathers nothing: no collective
        _start_watchdog(hvd, world)
        _threads = _thread_share(hvd, world)
        _ready = (world.rank, world.size)
    return hvd, world


_threads = 1
_ready: tuple[int, int] | None = None  # (rank, size) of the world init() last set up


def threads() -> int:
    """Intra-op threads for this rank, decided at init() from what every rank on its host may use."""
    return _threads


def _thread_share(hvd, world: World) -> int:
    # Collective (every rank calls init): each rank's affinity and cgroup quota, so that ranks bound to
    # disjoint cores keep theirs and ranks sharing cores or a quota split them (hvdp.core.cpus).
    if world.size == 1 or elastic():
        # Under elastic not a collective: a worker that joins a running elastic job calls init() alone (the
        # others are already training), so it would wait forever. Assume the local ranks share its CPUs.
        mine = cpu_share()
        return threads_per_rank(mine, [mine] * (world.local_size if elastic() else 1))
    host = socket.gethostname()
    everyone = gather_or_raise(hvd, lambda: (host, cpu_share()), name="hvdp.cpus", operation="init()'s CPU count")
    mine = everyone[world.rank][1]
    return threads_per_rank(mine, [share for h, share in everyone if h == host])


def place(hvd, world: World, req: DeviceRequest, visible: int, gpu_id: Callable[[int], str]) -> int | None:
    """This rank's GPU index among the `visible` ones (hvdp.core.devices.gpu_index), or None for the CPU.

    Collective in a job of 2+ ranks (outside elastic mode, where a joining worker calls init() alone): the
    ranks exchange which GPU each took, identified by `gpu_id(index)` (a UUID), so that two ranks on one GPU
    (NCCL's "Duplicate GPU detected", or both out of memory) and a rank that cannot have the device it asked
    for are a ConfigError on every rank, naming them, instead of a hang or a crash on one.
    """
    mine: list = []

    def choose():
        index = gpu_index(req, world.local_rank, visible)
        mine.append(index)
        return None if index is None else (socket.gethostname(), gpu_id(index))

    everyone = gather_or_raise(hvd, choose, name="hvdp.gpus", operation="init()'s device placement")
    message = None if req.share else sharing_error(shared_gpus(everyone), visible)
    if message:
        raise ConfigError(message, rank=world.rank)
    index = mine[0]
    return index


_in_elastic_world = False  # this process has been synced into its elastic job's world (elastic_run's body ran)


def entered_elastic_world() -> None:
    """Note that this process's elastic world is formed: Horovod's elastic run synced it with the others, so
    from here on every rank of the job runs the same collectives (inside the run, and after it returns on
    all ranks). Before that, a worker joining a running job runs init(), shard()... alone."""
    global _in_elastic_world
    _in_elastic_world = True


def elastic_body(train: Callable, failed_collective: Callable[[BaseException], bool] | None = None) -> Callable:
    """`train(state, ...)` as Horovod's elastic loop is to call it (hvdp.torch.elastic_run, hvdp.keras's): it
    notes that this process is synced into its job's world (entered_elastic_world), and a framework's error
    for which `failed_collective(error)` holds (a collective that failed inside Keras's fit comes out as a
    TensorFlow error) is raised as HorovodInternalError, which that loop takes for a lost worker."""
    @functools.wraps(train)
    def body(state, *args, **kwargs):
        entered_elastic_world()  # from here collectives (evaluate, checkpoints) span every rank
        entered = getattr(state, "_hvdp_entered", None)
        if entered is not None:  # every rank of the world, at each (re)entry: hvdp.torch.ElasticState's
            entered()
        try:
            return train(state, *args, **kwargs)
        except Exception as e:
            if failed_collective is None or not failed_collective(e):
                raise
            from horovod.common.exceptions import HorovodInternalError
            raise HorovodInternalError(e) from e
    return body


class CopiedExtras:
    """A base to put before horovod.common.elastic.ObjectState: an elastic state's extras are kept by value.
    ObjectState keeps references, so an extra changed in place after a commit (history.append(...)) was not
    undone by the rollback after a lost worker, and what it recorded of the rolled-back steps stayed, twice
    once they were trained again. Here a commit saves deep copies, and a restore or sync sets copies of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._saved_state = copy.deepcopy(self._saved_state)

    def save(self) -> None:
        super().save()
        self._saved_state = copy.deepcopy(self._saved_state)

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _alone(hvd) -> bool:
    # No rank to gather from: a world of one, or an elastic worker not yet synced into its job's world.
    return hvd.size() == 1 or (elastic() and not _in_elastic_world)


def gather_or_raise(hvd, compute: Callable[[], Any], *, name: str, operation: str) -> list:
    """Run `compute()` on this rank and all-gather the results: a list of every rank's, the same everywhere.

    An exception in `compute` on any rank is raised on every rank after the all-gather, so no rank is left
    waiting in a collective the failed one never reaches: the failed ranks' own hvdp error class when they all
    raised the same one (ConfigError...), else RankError naming each failed rank and its exception (chained
    on that rank). Every rank must call it, with the same `name`. In a world of size 1, or in an elastic job
    before this process's first elastic run (a joining worker is alone there), nothing is gathered: the list
    holds this rank's result only.

    Args:
        hvd: Horovod's framework module.
        compute: this rank's part, called with no arguments; its result must pickle.
        name: the all-gather's name in Horovod.
        operation: what the ranks are doing, for the message (e.g. "hvdp.torch.evaluate").
    """
    try:
        mine, problem = compute(), None
    except Exception as e:  # noqa: BLE001 - whatever failed, every rank must hear of it
        mine, problem, error = None, (type(e).__name__, str(e), isinstance(e, _errors.HvdpError)), e
    if _alone(hvd):
        gathered = [(mine, problem)]
    else:
        gathered = hvd.allgather_object((mine, problem), name=name)
    found = failure([p for _, p in gathered], operation=operation)
    if found is None:
        return [m for m, _ in gathered]
    cls, message = found
    if problem is not None and cls == type(error).__name__ and message == problem[1]:
        raise error  # this rank alone failed: its own error, as it was; the others raise its message
    raise getattr(_errors, cls, _errors.RankError)(message) from (error if problem is not None else None)


def report_scaling(rank: int, optimizer_name: str, base: float, **scaling) -> None:
    """On rank 0: log what prepare()/DistributedOptimizer did to the rate (stderr, one line) and warn
    (LRScalingWarning) when the linear rule meets an adaptive optimizer. `scaling`: describe_scaling's keywords."""
    if rank != 0:
        return
    print(f"hvdp: {describe_scaling(base, **scaling)}", file=sys.stderr, flush=True)
    warning = adaptive_warning(optimizer_name, **{k: v for k, v in scaling.items() if k != "warmup_steps"})
    if warning:
        warnings.warn(warning, LRScalingWarning, stacklevel=3)


def agree(hvd, settings: Callable[[], dict], *, call: str) -> None:
    """Raise ConfigError on every rank, naming the rank and the value, unless every rank's `settings()` (a dict
    of plain values: batch_size, seed, the data's length and fingerprint...) equals rank 0's. One small
    all-gather; every rank must call it. An exception in `settings` on one rank is raised on every rank.

    Args:
        hvd: Horovod's framework module.
        settings: this rank's settings, computed inside the check.
        call: the call the settings were given to, as the message names it (e.g. "shard()").
    """
    problem = settings_mismatch(gather_or_raise(hvd, settings, name="hvdp.settings", operation=call), call=call)
    if problem:
        raise ConfigError(problem, rank=hvd.rank())


_watchdog: Watchdog | None = None
_collectives = Collectives()  # this rank's Horovod collectives in flight, kept by the adapter for the watchdog


def progress(step: int, phase: str) -> None:
    """Tell the watchdog where this rank is (no-op without one)."""
    if _watchdog is not None:
        _watchdog.progress(step, phase)


def collectives() -> Collectives | None:
    """The registry of this rank's collectives the watchdog reads, for the adapter to keep (it wraps Horovod's
    submit and wait functions); None when no watchdog runs (a world of 1, elastic, HVDP_WATCHDOG=0)."""
    return _collectives if _watchdog is not None else None


def enter(phase: str) -> str | None:
    """Tell the watchdog that this rank now does `phase` (at the same step); returns what leave() restores.
    A no-op returning None without a watchdog."""
    return _watchdog.enter(phase) if _watchdog is not None else None


def leave(before: str | None) -> None:
    """Tell the watchdog that the phase enter() started is over (`before`: what enter() returned)."""
    if before is not None and _watchdog is not None:
        _watchdog.leave(before)


def watched(items, phase: str):
    """Yield from `items`, with the watchdog told `phase` while each next item is awaited (a DataLoader's
    batch: a rank stuck there is then named as such), and the phase before it while the caller works."""
    items = iter(items)
    while True:
        before = enter(phase)
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            leave(before)
        yield item


def _start_watchdog(hvd, world: World) -> None:
    """Start hvdp's heartbeat thread (see hvdp.core.watchdog) once per process, for jobs of 2+ ranks.

    It listens on one UDP port: on loopback when all ranks share this host, otherwise on the addresses, IPv4
    or IPv6, of HVDP_WATCHDOG_IFACE / HOROVOD_GLOO_IFACE when set (the interface the job runs on), else of
    every interface. Heartbeats are only taken from the addresses of the job's hosts.
    """
    global _watchdog
    enabled, timeout, elsewhere_timeout = watchdog_settings()
    if _watchdog is not None or not enabled or world.size == 1 or elastic():
        return  # an elastic job expects to lose ranks: Horovod's elastic driver handles that, not the watchdog
    opened = []

    def listen():  # an error here (no address, no port) is raised on every rank, not left to hang the others
        if world.local_size == world.size:
            addresses = ["127.0.0.1"] if _has_address("127.0.0.1") else ["::1"]
        else:
            iface = os.environ.get("HVDP_WATCHDOG_IFACE") or os.environ.get("HOROVOD_GLOO_IFACE")
            addresses = _interface_addresses(iface)
        opened.append(_listen_on(addresses))
        port = opened[0].getsockname()[1]
        return [(a, port) for a in addresses], _interface_addresses(None, every=True)

    try:
        listens = gather_or_raise(hvd, listen, name="hvdp.watchdog.peers", operation="init()'s watchdog set-up")
    except Exception:
        for s in opened:
            s.close()
        raise
    sock = opened[0]
    peers = [targets for targets, _ in listens]
    sources = {a for _, addresses in listens for a in addresses}
    # The heartbeats are signed with a per-job secret agreed through Horovod, so that no other process (or
    # other hvdp job on the host) can forge or confuse them.
    secret = hvd.broadcast_object(secrets.token_bytes(32) if world.rank == 0 else None, root_rank=0,
                                  name="hvdp.watchdog.secret")
    _watchdog = Watchdog(world.rank, peers, sock, secret=secret, timeout=timeout, on_hang=_end_job,
                         elsewhere_timeout=elsewhere_timeout, collectives=_collectives, sources=sources).start()
    atexit.register(_watchdog.stop)


def _listen_on(addresses: list[str]) -> socket.socket:
    """The watchdog's socket: bound to the one address, or to every interface of the addresses' families."""
    if len(addresses) == 1:
        return open_socket(addresses[0])
    if all(":" not in a for a in addresses):
        return open_socket("0.0.0.0")
    return open_socket("::")  # dual stack: IPv6 and IPv4 peers alike


def _has_address(address: str) -> bool:
    return address in _interface_addresses(None, every=True)


def _ring_text() -> str:
    """This rank's last collectives (hvdp.core.stragglers.format_calls), for stderr."""
    import time

    from hvdp.core.stragglers import format_calls
    return format_calls(_watchdog.rank if _watchdog is not None else -1, _collectives.recent(), time.monotonic())


_failures_written = 0


def collective_failed(key, error: str) -> None:
    """A collective raised on this rank (the adapter's wait wrapper): mark it in the ring and write the ring to
    stderr (the first 3 times in a process); rank 0 adds which ranks had not entered the collective the
    others were in, from the watchdog's last heartbeats. Then forgets the collective (it is over)."""
    global _failures_written
    try:
        missing = _watchdog.not_entered() if _watchdog is not None and _watchdog.rank == 0 else ""
    except Exception:  # noqa: BLE001 - the record must not hide the collective's own error
        missing = ""
    if key is not None:
        _collectives.finished(key, error)
    if _failures_written >= 3:
        return
    _failures_written += 1
    try:
        text = _ring_text() + (f"\nhvdp: at the failure, {missing}" if missing else "")
        print(text, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass


def _end_job(message: str) -> None:
    """The watchdog's end of a hung job: print why and this rank's last collectives, kill this rank's own
    child processes (DataLoader workers, the forkserver: a stuck worker keeps the launcher's output pipe open,
    and horovodrun --gloo waits for it), and exit with the watchdog's code so that the launcher tears the job
    down."""
    print(message, file=sys.stderr, flush=True)
    try:
        print(_ring_text(), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - ending the job must not fail
        pass
    try:
        import psutil  # a Horovod dependency

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - ending the job must not fail
        pass
    _output.close_lines()
    os._exit(WATCHDOG_EXIT_CODE)


def _interface_addresses(iface: str | None, every: bool = False) -> list[str]:
    """The addresses the watchdog listens on: those of interface `iface`, or of every interface but
    loopback; IPv4 first, then IPv6 (not link-local: its scope is the receiver's, which a sender on another
    host cannot name). With `every`: all addresses of every interface, loopback and link-local included (the
    sources a peer's heartbeats may come from).

    Raises:
        SetupError: no usable address (an unknown interface, or one with no IPv4 or routable IPv6 address).
    """
    import psutil  # a Horovod dependency
    v4, v6 = [], []
    interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        if not every and ((iface and name != iface) or (not iface and name == "lo")):
            continue
        for a in addrs:
            if a.family == socket.AF_INET:
                v4.append(a.address)
            elif a.family == socket.AF_INET6 and (every or not a.address.lower().startswith("fe80")):
                v6.append(a.address.split("%", 1)[0])
    if v4 or v6 or every:
        return v4 + v6
    where = f"interface {iface!r}" if iface else "any interface but loopback"
    known = ", ".join(sorted(interfaces)) or "none"
    raise SetupError(f"hvdp watchdog: {where} has no IPv4 or routable IPv6 address for the heartbeats (this "
                     f"host's interfaces: {known}). Set HVDP_WATCHDOG_IFACE (or HOROVOD_GLOO_IFACE) to the "
                     f"interface the job's hosts reach each other on, or HVDP_WATCHDOG=0 to run without the "
                     f"watchdog.")


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
        except Exception as e:  # noqa: BLE001 - a malformed file (a missing entry), memory: every rank hears of it
            outcome = {"error": f"cannot read checkpoint {path or directory} on rank 0: {type(e).__name__}: {e}. "
                                f"The file is not a checkpoint this job can load; delete it to resume from an "
                                f"older one"}
    outcome = broadcast_tree(hvd, ops, outcome, name="hvdp.load_checkpoint",
                             into=(lambda path, ref: into(path[1:], ref)) if into else None)
    if "error" in outcome:
        raise CheckpointError(outcome["error"], rank=hvd.rank())
    return outcome.get("payload")


def save_on_root(hvd, directory, name: str, write: Callable, keep: int, before_outcome: Callable | None = None):
    """Rank 0 writes `directory`/`name` atomically with `write(fileobj)` and keeps the newest `keep`; every
    rank returns together (the path on rank 0, None elsewhere) or raises the same CheckpointError naming the
    path, the OS error and the rank (read-only directory, disk full). Every rank must call it; `write` is
    only called on rank 0. `before_outcome()`, on rank 0, runs after the write (or its failure, whether or not
    `write` was called) and before the outcome is broadcast: where `write` runs collectives with the other
    ranks, it tells them when it never ran, so that none is left waiting for it."""
    outcome: dict = {}
    if hvd.rank() == 0:
        path = Path(directory) / name
        try:
            try:
                ckpt.write_atomic(path, write)
            finally:
                if before_outcome is not None:
                    before_outcome()
        except Exception as e:  # noqa: BLE001 - whatever failed, every rank must hear of it
            outcome = {"error": f"cannot write checkpoint {path} on rank 0: {type(e).__name__}: {e}. Nothing was "
                                f"replaced: the older checkpoints are intact. Check that the directory is writable "
                                f"and has room for the checkpoint"}
        else:
            try:
                ckpt.prune(directory, keep)
                outcome = {"path": str(path)}
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                outcome = {"error": f"wrote checkpoint {path} on rank 0, but could not delete the older ones "
                                    f"(keep={keep}): {type(e).__name__}: {e}"}
    outcome = hvd.broadcast_object(outcome, root_rank=0, name="hvdp.save_checkpoint")
    if "error" in outcome:
        raise CheckpointError(outcome["error"], rank=hvd.rank())
    return Path(outcome["path"]) if hvd.rank() == 0 else None
