"""hvdp's runtime defaults for Horovod and MPI, chosen from `hvdp bench` measurements (docs/benchmarks.md, docs/internals.md).

Each is an environment variable read when Horovod / MPI initialise; hvdp sets it only when the user has
not, so `export NAME=value` (or horovodrun's own flags) always wins.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, MutableMapping

from hvdp.core.errors import ConfigError

RUNTIME_DEFAULTS: dict[str, str] = {
    # Ranks waiting inside MPI yield the core instead of spinning on it. On a host with as many ranks as
    # cores the spinning rank steals the core its peer needs to finish its step.
    "OMPI_MCA_mpi_yield_when_idle": "1",
    # Ranks on one host all-reduce through shared memory, in cache-sized chunks, instead of MPI's ring
    # (csrc/horovod/shm_operations.cc, built into Horovod by `make setup`). At 64 MiB it measured about
    # 3x MPI's bus bandwidth here. No effect across hosts, with Gloo, or on a stock Horovod build.
    "HVDP_SHM_ALLREDUCE": "1",
    # Ranks that submit different collectives (one rank skipped an allreduce, or took another branch after
    # a result it alone saw) wait for each other forever: Horovod's stall inspector only warns, every 60 s,
    # unless told to end the job. After 30 minutes it ends it on every rank, rank 0 naming each rank's
    # missing tensors (measured under MPI; under Gloo it was seen not to fire, see docs/troubleshooting.md). A peer that is
    # merely slow, such as rank 0 writing a large checkpoint, is well inside that; hvdp's watchdog handles
    # hung and vanished ranks much sooner.
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1800",
}


def apply_runtime_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of RUNTIME_DEFAULTS that `environ` lacks; a variable already set is never changed.

    init() calls it before Horovod and MPI read their environment; calling it later has no effect on them.

    Args:
        environ: the mapping to update; default None means os.environ.

    Returns:
        The {name: value} pairs that were set (empty when the user had set them all).
    """
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in RUNTIME_DEFAULTS.items() if k not in env}
    env.update(applied)
    return applied


def check_shm_settings(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a malformed setting of the shared-memory allreduce before Horovod reads it.

    Checks HVDP_SHM_ALLREDUCE ("0" or "1"), HVDP_SHM_CHUNK_BYTES (a whole number from 1 to 2**40) and
    HVDP_SHM_TIMEOUT_SECONDS (a number from 0.001 to 1e9); unset variables are fine. (Horovod's C++ op,
    reached without hvdp, warns and uses its default for such a value.)

    Args:
        environ: the variables to check; default None means os.environ.

    Raises:
        ConfigError: one of them is set to a malformed value (the message quotes it and the allowed range).
    """
    env = os.environ if environ is None else environ
    flag = env.get("HVDP_SHM_ALLREDUCE")
    if flag is not None and flag not in ("0", "1"):
        raise ConfigError(f"HVDP_SHM_ALLREDUCE must be 1 (on) or 0 (off), got {flag!r}")
    chunk = env.get("HVDP_SHM_CHUNK_BYTES")
    if chunk is not None:
        if not (chunk.isdigit() and 0 < int(chunk) <= 1 << 40):
            raise ConfigError(f"HVDP_SHM_CHUNK_BYTES must be a whole number of bytes from 1 to 2**40, got "
                              f"{chunk!r}; unset it for the default (256 KiB)")
    timeout = env.get("HVDP_SHM_TIMEOUT_SECONDS")
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and 0.001 <= seconds <= 1e9):
            raise ConfigError(f"HVDP_SHM_TIMEOUT_SECONDS must be a number of seconds from 0.001 to 1e9, got "
                              f"{timeout!r}; unset it for the default (60)")


__all__ = ["RUNTIME_DEFAULTS", "apply_runtime_defaults", "check_shm_settings"]
