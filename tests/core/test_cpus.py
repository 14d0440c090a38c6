"""The CPUs a rank may use: cgroup quotas parsed from files, thread counts split among the ranks that share
them, and the real affinity (taskset) and cgroup limits seen by init()."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdp.core.cpus import CpuShare, cgroup_cpu_limit, cpu_share, threads_per_rank
from tests.launch import ROOT, env


def tree(tmp_path, proc_cgroup: str, files: dict[str, str]):
    (tmp_path / "proc").write_text(proc_cgroup)
    for name, text in files.items():
        f = tmp_path / "cg" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path / "proc"), str(tmp_path / "cg")


def test_cgroup_v2_quota(tmp_path):
    proc, root = tree(tmp_path, "0::/job/step\n", {"job/step/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(proc, root) == (1.5, str(Path(root) / "job/step"))


def test_the_tightest_limit_on_the_path_wins(tmp_path):
    """A quota on a parent cgroup (the container) limits its children (the job) too."""
    proc, root = tree(tmp_path, "0::/pod/job\n", {"pod/cpu.max": "200000 100000", "pod/job/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(proc, root) == (2.0, str(Path(root) / "pod"))


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    proc, root = tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
                      {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
                       "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(proc, root)[0] == 3.0
    (tmp_path / "u").mkdir()
    proc, root = tree(tmp_path / "u", "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(proc, root) == (None, None)


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    """Inside a container /proc/self/cgroup may name a path that is not under the mount: read the mount's root."""
    proc, root = tree(tmp_path, "0::/system.slice/docker-1.scope\n", {"cpu.max": "100000 100000"})
    assert cgroup_cpu_limit(proc, root)[0] == 1.0


@pytest.mark.parametrize("text", ["", "garbage", "0::/\n", "max", "max 100000", "-5 100000", "100000 0", "1.5 x",
                                  "1 2 3", "\x00\xff"])
def test_malformed_or_missing_files_mean_no_limit(tmp_path, text):
    proc, root = tree(tmp_path, "0::/\n", {"cpu.max": text})
    assert cgroup_cpu_limit(proc, root) == (None, None)
    assert cgroup_cpu_limit(str(tmp_path / "absent"), root) == (None, None)


def cpus(*numbers):
    return frozenset(numbers)


@pytest.mark.parametrize("mine,on_host,expected", [
    (CpuShare(cpus(0, 1)), [CpuShare(cpus(0, 1))] * 2, 1),                       # 2 ranks share 2 cores
    (CpuShare(cpus(*range(16))), [CpuShare(cpus(*range(16)))] * 4, 4),
    (CpuShare(cpus(0, 1)), [CpuShare(cpus(0, 1))] * 4, 1),                       # never below 1
    (CpuShare(cpus(*range(8))), [CpuShare(cpus(*range(8))), CpuShare(cpus(*range(8, 16)))], 8),  # bound apart
    (CpuShare(cpus(0)), [CpuShare(cpus(0)), CpuShare(cpus(1))], 1),              # mpirun --bind-to core
    (CpuShare(cpus(*range(16)), 4.0, "/c"), [CpuShare(cpus(*range(16)), 4.0, "/c")] * 2, 2),  # docker --cpus=4
    (CpuShare(cpus(*range(16)), 2.5, "/c"), [CpuShare(cpus(*range(16)), 2.5, "/c")], 2),      # rounded down
    (CpuShare(cpus(*range(16)), 6.0, "/a"), [CpuShare(cpus(*range(16)), 6.0, "/a"),
                                               CpuShare(cpus(*range(16)), 6.0, "/b")], 6),   # own cgroups
])
def test_threads_per_rank_never_oversubscribes(mine, on_host, expected):
    assert threads_per_rank(mine, on_host) == expected


def test_cpu_share_reads_this_process():
    share = cpu_share()
    assert share.cpus == frozenset(os.sched_getaffinity(0))


THREADS = "import hvdp.torch as ht, torch; ht.init(); print('threads', torch.get_num_threads())"


def run_init(prefix):
    e = env()
    e.pop("OMP_NUM_THREADS")  # hvdp chooses only when the user did not
    proc = subprocess.run(prefix + [sys.executable, "-c", THREADS], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("threads")[-1])


@pytest.mark.skipif(os.cpu_count() < 2 or not shutil.which("taskset"), reason="needs 2+ CPUs and taskset")
def test_init_counts_only_the_cpus_taskset_allows():
    assert run_init([]) == len(os.sched_getaffinity(0))
    assert run_init(["taskset", "-c", "0"]) == 1


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs 2+ CPUs")
def test_init_counts_the_cgroup_quota():
    """A real cgroup with a 1-CPU quota (as `docker --cpus=1` makes): init gives torch one thread, not one per
    core. Needs a writable cgroup v1 cpu hierarchy or a cgroup v2 with the cpu controller (root)."""
    v2 = Path("/sys/fs/cgroup")
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        group = CGROUP_V1 / f"hvdp-test-{os.getpid()}"
        limit = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    elif "cpu" in (v2 / "cgroup.controllers").read_text(errors="ignore").split() if (v2 / "cgroup.controllers").exists() else False:
        group = v2 / f"hvdp-test-{os.getpid()}"
        limit = {"cpu.max": "100000 100000"}
    else:
        pytest.skip("no cpu cgroup controller here")
    try:
        group.mkdir()
        for name, value in limit.items():
            (group / name).write_text(value)
    except OSError as e:
        pytest.skip(f"cannot create a cgroup here: {e}")
    try:
        assert run_init(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" "$@"']) == 1
    finally:
        for _ in range(50):  # the exited process leaves the cgroup a moment after wait() returns
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
