"""What the framework adapters share about Horovod itself: importing it with a useful error, initialising
it, and checking that it was built with what the launcher is about to use. Takes Horovod's framework
module as an argument; imports nothing heavy at module level."""

from __future__ import annotations

import importlib

from hvdp.core.errors import SetupError
from hvdp.core.tuning import apply_runtime_defaults
from hvdp.core.world import World, detect_launcher

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
    if launcher.startswith("mpirun") and not hvd.mpi_built():
        raise SetupError(
            f"launched by {launcher}, but this Horovod was built without MPI: rebuild it with "
            f"HOROVOD_WITH_MPI=1 (`make setup` does) or launch with `horovodrun --gloo`")
    if not hvd.is_initialized():
        apply_runtime_defaults()  # before MPI_Init / Horovod's background thread read them
        hvd.init()
    if timeline:
        hvd.start_timeline(timeline, mark_cycles=False)
    return hvd, World.from_horovod(hvd)


def controller(hvd) -> str:
    """Which controller this job runs on: 'mpi', 'gloo', or 'none' (a single process)."""
    if hvd.mpi_enabled():
        return "mpi"
    if hvd.gloo_enabled():
        return "gloo"
    return "none"
