import argparse

import pytest

from hvdp import TrainConfig, World
from hvdp.core.errors import ConfigError, HvdpError
from hvdp.core.world import detect_launcher, gloo_hostname_problem


def test_plain_python_is_size_one():
    assert World.from_env({}) == World(rank=0, size=1, local_rank=0, local_size=1)
    assert detect_launcher({}) == "python (single process)"


_OMPI_RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


@pytest.mark.parametrize("env,world,launcher", [
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"},
     World(rank=1, size=4, local_rank=1, local_size=2), "horovodrun (gloo)"),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, World(rank=3, size=8, local_rank=3, local_size=4), "mpirun (OpenMPI)"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
     World(rank=2, size=4, local_rank=0, local_size=1), "slurm (srun)"),
    # What `horovodrun --mpi` (0.28.1, OpenMPI 4.1) puts in a rank's environment: OpenMPI's variables plus
    # the MCA options it passes to mpirun; no HOROVOD_* variable at all.
    ({**_OMPI_RANK1, "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "OMPI_MCA_orte_tag_output": "1",
      "OMPI_MCA_btl_tcp_if_include": "eth0", "NCCL_SOCKET_IFNAME": "eth0"},
     World(rank=1, size=2, local_rank=0, local_size=1), "horovodrun (mpi)"),
    # Plain mpirun, even with one of those options given by hand, is mpirun.
    ({**_OMPI_RANK1, "OMPI_MCA_pml": "ob1"}, World(rank=1, size=2, local_rank=0, local_size=1), "mpirun (OpenMPI)"),
    # HOROVOD_HOSTNAME is horovodrun's Gloo mode (or a user's export), not a sign of its MPI mode.
    ({**_OMPI_RANK1, "HOROVOD_HOSTNAME": "node1"}, World(rank=1, size=2, local_rank=0, local_size=1),
     "mpirun (OpenMPI)"),
])
def test_world_from_launcher_env(env, world, launcher):
    assert World.from_env(env) == world
    assert detect_launcher(env) == launcher
    assert World.from_env(env).is_main == (world.rank == 0)


@pytest.mark.parametrize("kw", [dict(rank=2, size=2), dict(rank=0, size=0), dict(local_rank=1, local_size=1)])
def test_world_rejects_impossible(kw):
    with pytest.raises(ConfigError):
        World(**kw)


def test_config_flags_round_trip():
    parser = TrainConfig.add_arguments(argparse.ArgumentParser(), epochs=7)
    args = parser.parse_args(["--batch-size", "16", "--lr-scaling", "sqrt", "--adasum", "--lr", "0.2"])
    cfg = TrainConfig.from_args(args)
    assert (cfg.epochs, cfg.batch_size, cfg.lr_scaling, cfg.lr, cfg.op) == (7, 16, "sqrt", 0.2, "adasum")


def test_config_rejects_unknown_choice_at_parse_time(capsys):
    parser = TrainConfig.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--compression", "zip"])
    assert "invalid choice: 'zip'" in capsys.readouterr().err


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(lr=-1.0), "lr must be > 0"),
    (dict(lr_scaling="cubic"), "lr_scaling='cubic' is not one of linear, sqrt, none"),
    (dict(accumulate=0), "accumulate must be"),
    (dict(warmup_epochs=-2), "warmup_epochs must be >= 0"),
])
def test_config_validation_names_the_value(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kw)


def test_errors_name_the_rank():
    assert str(HvdpError("boom", rank=3)) == "[rank 3] boom"
    assert isinstance(ConfigError("x"), ValueError)


def test_runtime_defaults_never_override_the_user():
    from hvdp.core.tuning import RUNTIME_DEFAULTS, apply_runtime_defaults
    name = next(iter(RUNTIME_DEFAULTS))
    env = {name: "user-choice"}
    applied = apply_runtime_defaults(env)
    assert env[name] == "user-choice" and name not in applied
    fresh: dict = {}
    assert apply_runtime_defaults(fresh) == RUNTIME_DEFAULTS == fresh


_GLOO_2HOSTS = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_GLOO_IFACE": "eth1"}


@pytest.mark.parametrize("env,address,match", [
    (_GLOO_2HOSTS, "127.0.1.1", "'node1' resolves to 127.0.1.1"),
    (_GLOO_2HOSTS, None, "'node1' does not resolve"),
    (_GLOO_2HOSTS, "10.0.0.2", None),
    ({**_GLOO_2HOSTS, "HOROVOD_CROSS_SIZE": "1"}, "127.0.0.1", None),  # one host: loopback is right
    ({}, "127.0.0.1", None),                                            # not Gloo
])
def test_gloo_hostname_problem(env, address, match):
    problem = gloo_hostname_problem(env, "node1", address)
    assert (problem is None) if match is None else (match in problem and "eth1" in problem)
