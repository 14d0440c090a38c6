import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.tuning import apply_runtime_defaults, check_shm_settings


@pytest.mark.parametrize("name,value", [
    ("HVDP_SHM_CHUNK_BYTES", "abc"), ("HVDP_SHM_CHUNK_BYTES", "0"), ("HVDP_SHM_CHUNK_BYTES", "-4096"),
    ("HVDP_SHM_CHUNK_BYTES", "4k"), ("HVDP_SHM_CHUNK_BYTES", "1e6"), ("HVDP_SHM_CHUNK_BYTES", str(2**41)),
    ("HVDP_SHM_TIMEOUT_SECONDS", "abc"), ("HVDP_SHM_TIMEOUT_SECONDS", "0"), ("HVDP_SHM_TIMEOUT_SECONDS", "-1"),
    ("HVDP_SHM_TIMEOUT_SECONDS", "nan"), ("HVDP_SHM_TIMEOUT_SECONDS", "inf"), ("HVDP_SHM_TIMEOUT_SECONDS", ""),
    ("HVDP_SHM_ALLREDUCE", "yes"),
])
def test_bad_shm_settings_are_refused_by_name(name, value):
    with pytest.raises(ConfigError) as e:
        check_shm_settings({name: value})
    assert name in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("env", [
    {}, {"HVDP_SHM_CHUNK_BYTES": "4096"}, {"HVDP_SHM_TIMEOUT_SECONDS": "2.5"}, {"HVDP_SHM_ALLREDUCE": "0"},
])
def test_good_shm_settings_pass(env):
    check_shm_settings(env)


def test_runtime_defaults_never_override_the_user():
    env = {"HVDP_SHM_ALLREDUCE": "0"}
    applied = apply_runtime_defaults(env)
    assert env["HVDP_SHM_ALLREDUCE"] == "0" and "HVDP_SHM_ALLREDUCE" not in applied
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"


def test_ranks_that_submit_different_collectives_are_ended_not_left_waiting():
    env = {}
    apply_runtime_defaults(env)
    assert int(env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]) > 60  # above the stall warning (60 s), so it fires
