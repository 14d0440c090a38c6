"""Who am I in the job: rank, size and the launcher that started us, as plain values.

World is this process's (rank, size, local_rank, local_size), read from an initialised Horovod or, without
initialising anything, from the launcher's environment variables (horovodrun, mpirun, Slurm; plain `python`
is a world of size 1). detect_launcher and elastic name how the job was started; gloo_hostname_problem is
a check init() derives from them. Pure functions of their arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from hvdp.core.errors import ConfigError

# Variables each launcher sets, in order of precedence: (launcher, rank, size, local rank, local size).
_LAUNCHER_VARS = (
    ("horovodrun (gloo)", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("mpirun (OpenMPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpirun (MPICH/PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm (srun)", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the job. Size 1 when launched as plain `python`.

    Attributes (also the constructor's arguments):
        rank: this process's index in the job, 0 <= rank < size (default 0).
        size: the number of processes in the job, >= 1 (default 1).
        local_rank: its index among the processes on this host, 0 <= local_rank < local_size (default 0).
        local_size: the number of processes on this host, >= 1 (default 1).

    Raises:
        ConfigError: the values are inconsistent (e.g. rank >= size).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"invalid world: rank={self.rank}, size={self.size} (need 0 <= rank < size)")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"invalid world: local_rank={self.local_rank}, local_size={self.local_size}")

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs, writes checkpoints and prints results."""
        return self.rank == 0

    @classmethod
    def from_horovod(cls, hvd: Any) -> "World":
        """Read the world from an initialised Horovod module.

        Args:
            hvd: horovod.torch or horovod.tensorflow, after hvd.init().
        """
        return cls(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "World":
        """The world as the launcher's environment variables describe it, without initialising anything.

        Args:
            environ: the variables to read; default None means os.environ. The first launcher (in the order
                horovodrun's Gloo, OpenMPI, MPICH/PMI, Slurm) whose rank and size variables are both set wins;
                a missing or non-numeric local rank/size falls back to 0 and 1.

        Returns:
            That World, or World() (size 1) when no launcher's variables are set.

        Raises:
            ValueError: the launcher's rank or size variable is not an integer.
            ConfigError: the values are inconsistent (see World).
        """
        env = os.environ if environ is None else environ
        for _, rank, size, local_rank, local_size in _LAUNCHER_VARS:
            if rank in env and size in env:
                def get(name: str, default: int) -> int:
                    value = env.get(name, "")
                    return int(value) if value.isdigit() else default
                r, s = int(env[rank]), int(env[size])
                return cls(rank=r, size=s, local_rank=get(local_rank, 0),
                           local_size=max(get(local_size, 1), get(local_rank, 0) + 1))
        return cls()


# horovodrun's MPI mode sets no HOROVOD_* variable in the ranks: it runs `mpirun --tag-output -mca pml ob1
# -mca btl ^openib ...`, and mpirun hands those options to every rank as OMPI_MCA_* variables. Together they
# are horovodrun's signature (measured with horovodrun 0.28.1 and OpenMPI 4.1).
_HOROVODRUN_MPI_MARKS = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "OMPI_MCA_orte_tag_output": "1"}


def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Name the launcher that started this process, from its environment variables.

    Args:
        environ: the variables to read; default None means os.environ.

    Returns:
        One of "horovodrun (gloo)", "horovodrun (mpi)", "mpirun (OpenMPI)", "mpirun (MPICH/PMI)",
        "slurm (srun)" or "python (single process)".
    """
    env = os.environ if environ is None else environ
    for name, rank, size, *_ in _LAUNCHER_VARS:
        if rank in env and size in env:
            if name == "mpirun (OpenMPI)" and all(env.get(k) == v for k, v in _HOROVODRUN_MPI_MARKS.items()):
                return "horovodrun (mpi)"
            return name
    return "python (single process)"


def elastic(environ: Mapping[str, str] | None = None) -> bool:
    """True when horovodrun started this process in elastic mode (--min-np/--max-np/--host-discovery-script).

    Args:
        environ: the variables to read (HOROVOD_ELASTIC="1"); default None means os.environ.
    """
    return (os.environ if environ is None else environ).get("HOROVOD_ELASTIC") == "1"


def gloo_hostname_problem(env: Mapping[str, str], hostname: str, address: str | None) -> str | None:
    """Why Horovod 0.28.1's Gloo would give the other hosts an unusable address for this rank, or None.

    Gloo connections are set up twice: once for the global context, on the interface horovodrun names in
    HOROVOD_GLOO_IFACE (--network-interface), and once per process set, including the one every collective
    uses, where Horovod forgets the interface (GlooContext::InitializeForProcessSet never copies it) and
    Gloo falls back to the address this machine's hostname resolves to. If that is a loopback address (as
    with Debian's `127.0.1.1 <hostname>` in /etc/hosts) or nothing, other hosts cannot reach this rank.

    Args:
        env: this rank's environment (os.environ): Gloo rendezvous, HOROVOD_CROSS_SIZE, HOROVOD_GLOO_IFACE.
        hostname: this machine's host name.
        address: what `hostname` resolves to here (None: it does not resolve).

    Returns:
        The message with the fix, or None when the job is not on Gloo, runs on one host, or the address is
        usable.
    """
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in env or int(env.get("HOROVOD_CROSS_SIZE", "1") or 1) < 2:
        return None  # not Gloo, or all ranks on one host: loopback is fine
    if address is None:
        return (f"this host's name {hostname!r} does not resolve, and Horovod's Gloo uses it to pick the "
                f"address other hosts connect to: add it to /etc/hosts with the address of "
                f"{env.get('HOROVOD_GLOO_IFACE') or 'the interface the hosts share'}")
    if address.startswith("127.") or address == "::1":
        return (f"this host's name {hostname!r} resolves to {address}, and Horovod's Gloo gives that address "
                f"to the other hosts (it ignores --network-interface for process sets): make {hostname!r} "
                f"resolve to the address of {env.get('HOROVOD_GLOO_IFACE') or 'the shared interface'} "
                f"(/etc/hosts), or use MPI (horovodrun --mpi)")
    return None


__all__ = ["World", "detect_launcher", "elastic", "gloo_hostname_problem"]
