"""The CPUs this process may use, and how many intra-op threads each rank gets from them.

`os.cpu_count()` counts the host's cores, but a rank may be allowed fewer: its CPU affinity (`taskset`,
`mpirun --bind-to`, Slurm's cpuset) and its cgroup's CPU quota (Docker `--cpus`, Kubernetes limits, Slurm).
Starting one thread per host core in every rank oversubscribes what the ranks were given, and synchronous
training runs at the pace of its slowest rank.

cpu_share() reads this process's affinity and quota; init() gathers every rank's share and
threads_per_rank() splits each resource among the ranks on the same host that actually share it: ranks
bound to disjoint cores each keep theirs, ranks in one cgroup split its quota. Stdlib only; a malformed or
unreadable cgroup file is treated as "no limit", never an error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuShare:
    """What one rank may use.

    Attributes:
        cpus: the CPU numbers in its affinity mask.
        quota: its cgroup's CPU limit in CPUs (quota / period, e.g. 1.5), or None when unlimited.
        cgroup: the cgroup directory that sets that limit (ranks with the same one split it), or None.
    """

    cpus: frozenset[int]
    quota: float | None = None
    cgroup: str | None = None


def cpu_share(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> CpuShare:
    """This process's CpuShare: os.sched_getaffinity and the tightest cgroup CPU limit (cgroup v2 or v1).

    Args:
        proc_cgroup: the file naming this process's cgroups (default /proc/self/cgroup).
        root: where the cgroup filesystems are mounted (default /sys/fs/cgroup).
    """
    if hasattr(os, "sched_getaffinity"):
        cpus = frozenset(os.sched_getaffinity(0))
    else:  # macOS has no affinity: every core
        cpus = frozenset(range(os.cpu_count() or 1))
    quota, where = cgroup_cpu_limit(proc_cgroup, root)
    return CpuShare(cpus, quota, where)


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[float | None, str | None]:
    """(CPUs, directory) of the tightest CPU quota on the path from this process's cgroup up to its root,
    or (None, None) when there is none or it cannot be read.

    Reads cgroup v2's `cpu.max` ("max 100000" or "150000 100000") and v1's `cpu.cfs_quota_us` /
    `cpu.cfs_period_us` (quota -1 is unlimited). Inside a container the cgroup path may not exist under the
    mount (the container sees its own cgroup as the root): then the mount's root is read.

    Args:
        proc_cgroup: the file naming this process's cgroups.
        root: where the cgroup filesystems are mounted.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None, None
    best: tuple[float | None, str | None] = (None, None)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy, mounted at root (or root/unified in hybrid mode)
            bases, read = [Path(root), Path(root) / "unified"], _read_v2
        elif "cpu" in controllers.split(","):
            bases, read = [Path(root) / controllers, Path(root) / "cpu", Path(root) / "cpu,cpuacct"], _read_v1
        else:
            continue
        for base in bases:
            if not base.is_dir():
                continue
            here = base / path.lstrip("/")
            if not here.is_dir():
                here = base
            while True:
                limit = read(here)
                if limit is not None and (best[0] is None or limit < best[0]):
                    best = (limit, str(here))
                if here == base or base not in here.parents:
                    break
                here = here.parent
            break  # the first base that exists is this hierarchy's mount
    return best


def _read_v2(directory: Path) -> float | None:
    try:
        fields = (directory / "cpu.max").read_text().split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def threads_per_rank(mine: CpuShare, on_host: list[CpuShare]) -> int:
    """Intra-op threads for this rank, so that the ranks on its host do not oversubscribe what they may use.

    Args:
        mine: this rank's CpuShare.
        on_host: the CpuShares of every rank on this host, this one included.

    Returns:
        The smaller of: this rank's CPUs divided among the ranks whose affinity overlaps them, and its
        cgroup's quota divided among the ranks in that cgroup (rounded down); at least 1.
    """
    sharing = max(1, sum(1 for other in on_host if other.cpus & mine.cpus))
    threads = len(mine.cpus) // sharing
    if mine.quota is not None:
        in_cgroup = max(1, sum(1 for other in on_host if other.cgroup == mine.cgroup))
        threads = min(threads, math.floor(mine.quota / in_cgroup))
    return max(1, threads)


__all__ = ["CpuShare", "cpu_share", "cgroup_cpu_limit", "threads_per_rank"]
