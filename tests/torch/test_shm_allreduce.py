"""hvdp's shared-memory allreduce (built into Horovod by scripts/build_horovod.sh) against a reference computed
from every rank's inputs, in MPI jobs of 2 and 3 ranks, with chunks small enough that every tensor crosses
many of them, with the default chunk, and switched off. One launch per configuration runs every check in
worker_shm.py."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks

WORKER = Path(__file__).with_name("worker_shm.py")
CONFIGS = {
    "np2-chunk4k": (2, {"HVDP_SHM_CHUNK_BYTES": "4096"}),
    "np3-chunk4k": (3, {"HVDP_SHM_CHUNK_BYTES": "4096"}),  # parts of unequal length, three slots to sum
    "np2-default-chunk": (2, {}),
    "np2-off": (2, {"HVDP_SHM_ALLREDUCE": "0"}),  # MPI's allreduce: the same references must hold
    # A segment /dev/shm cannot hold (4 TiB): every rank falls back to MPI's allreduce at init, no rank hangs.
    "np2-shm-too-small": (2, {"HVDP_SHM_CHUNK_BYTES": str(1 << 40), "EXPECT_ALLREDUCE_OP": "MPI_ALLREDUCE"}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def results(request, tmp_path_factory):
    np, env = CONFIGS[request.param]
    env = {"HOROVOD_TIMELINE": "DYNAMIC", **env}  # the checks record a timeline of their own
    return request.param, run_checks("mpi", WORKER, tmp_path_factory.mktemp(request.param), np=np, extra_env=env)


@pytest.mark.parametrize("name", check_names(WORKER))
def test_shm_allreduce_check(results, name):
    assert_passed(results, name)
