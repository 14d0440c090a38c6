"""What the framework adapters share about Horovod itself: importing it with a useful error, initialising
it, and checking that it was built with what the launcher is about to use. Takes Horovod's framework
module as an argument; imports nothing heavy at module level."""

from __future__ import annotations

import atexit
import importlib
import os
import secrets
import socket

from hvdp.core import checkpoint as ckpt
from hvdp.core.cpus import cpu_share, threads_per_rank
from hvdp.core.errors import CheckpointError, SetupError
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
    host = socket.gethostname()
    everyone = hvd.allgather_object((host, mine), name="hvdp.cpus")
    return threads_per_rank(mine, [share for h, share in everyone if h == host])


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


def read_checkpoint_on_root(hvd, directory, read):
    """Rank 0 reads the newest checkpoint in `directory` with `read(path)`; every rank gets the payload (None
    when there is none), or raises the same CheckpointError, so no rank is left waiting for the others."""
    result: dict = {}
    if hvd.rank() == 0:
        path = ckpt.latest_checkpoint(directory)
        try:
            result = {"payload": read(path)} if path else {}
        except CheckpointError as e:
            result = {"error": str(e)}
    result = hvd.broadcast_object(result, root_rank=0, name="hvdp.load_checkpoint")
    if "error" in result:
        raise CheckpointError(result["error"], rank=hvd.rank())
    return result.get("payload")
