"""hvdp's runtime defaults for Horovod and MPI, chosen from `hvdp bench` measurements (see README, Benchmarks).

Each is an environment variable read when Horovod / MPI initialise; hvdp sets it only when the user has
not, so `export NAME=value` (or horovodrun's own flags) always wins.
"""

from __future__ import annotations

import os
from typing import MutableMapping

RUNTIME_DEFAULTS: dict[str, str] = {
    # Ranks waiting inside MPI yield the core instead of spinning on it. On a host with as many ranks as
    # cores the spinning rank steals the core its peer needs to finish its step.
    "OMPI_MCA_mpi_yield_when_idle": "1",
    # Ranks on one host all-reduce through shared memory, in cache-sized chunks, instead of MPI's ring
    # (docker/horovod/shm_operations.cc, built into Horovod by `make setup`). At 64 MiB it measured about
    # 3x MPI's bus bandwidth here. No effect across hosts, with Gloo, or on a stock Horovod build.
    "HVDP_SHM_ALLREDUCE": "1",
}


def apply_runtime_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each default that `environ` (os.environ) lacks; return the ones that were set."""
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in RUNTIME_DEFAULTS.items() if k not in env}
    env.update(applied)
    return applied
