"""Many collectives in flight on uneven ranks (worker_inflight.py), under every allreduce path hvdp can take
on one host: MPI with the shared-memory op (default and 4 KiB chunks), MPI without it, and Gloo, at 2 and
3 ranks. Every result is compared exactly; on the shared-memory op before its fix (slot parity restarting
with every response) 60 iterations at np=2 gave 11 wrong results.

`make soak` runs the same with HVDP_SOAK_ITERATIONS (default here 60) iterations per launch.
"""

import json
import os
from pathlib import Path

import pytest

from tests.launch import run

WORKER = Path(__file__).with_name("worker_inflight.py")
ITERATIONS = int(os.environ.get("HVDP_SOAK_ITERATIONS", "60"))
FUSION = {"HOROVOD_FUSION_THRESHOLD": str(1 << 20)}  # 1 MiB, so some tensors are above it
CONFIGS = {
    "mpi-shm-np2": ("mpi", 2, {}),
    "mpi-shm-np2-chunk4k": ("mpi", 2, {"HVDP_SHM_CHUNK_BYTES": "4096"}),
    "mpi-shm-np3-chunk4k": ("mpi", 3, {"HVDP_SHM_CHUNK_BYTES": "4096"}),
    "mpi-np2": ("mpi", 2, {"HVDP_SHM_ALLREDUCE": "0"}),
    "gloo-np2": ("gloo", 2, {}),
    "gloo-np3": ("gloo", 3, {}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_result_exact_with_many_collectives_in_flight(config, tmp_path):
    launcher, np, env = CONFIGS[config]
    out = tmp_path / "inflight.json"
    proc = run(launcher, WORKER, str(out), str(ITERATIONS), np=np, timeout=300, extra_env={**FUSION, **env})
    assert out.exists(), f"no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == list(range(np))
    # 12 allreduces, 4 grouped tensors, an allgather and a broadcast per iteration, on every rank.
    assert all(r["checked"] == ITERATIONS * 18 for r in ranks), ranks
    assert sum(r["error_count"] for r in ranks) == 0, "\n".join(e for r in ranks for e in r["errors"])
