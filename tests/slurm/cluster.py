"""A real Slurm cluster on this machine: munged, slurmctld and two slurmd (nodes n1 and n2), all under one
directory, all started and stopped by PID. Used by tests/slurm/conftest.py; `python -m tests.slurm.cluster`
starts one, runs a two-node srun and prints the times (docs/launchers.md quotes them).

    DIR/munge/      munge.key, munged's socket, log, pid and seed
    DIR/state/      slurmctld's StateSaveLocation
    DIR/spool/n1/   slurmd n1's SlurmdSpoolDir (and n2's)
    DIR/tmp/n1/     node n1's TmpFS: the PMIx plugin puts each step's spmix_appdir_* there, so two slurmd on
                    one host must not share it (and n2's)
    DIR/slurm.conf  what every daemon and client reads (SLURM_CONF), with its own ports and socket
    DIR/jobcomp.log one line per job run that ended (jobcomp/filetxt): its state and exit code, which stay
                    readable after the job has left slurmctld (MinJobAge=2 s)

Nothing outside DIR is written or read: no /etc/slurm, /etc/munge or /run/munge, no systemd units. Both nodes
are this host (NodeHostname), each slurmd on its own port; the jobs run as the user who submits them (root here,
with munged's ownership checks of a root-owned key waived by --force).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.clusters.procs import free_port

NODES = ("n1", "n2")
CPUS_PER_NODE = 2  # each node offers 2 CPUs (the machine's 2 cores, shared by the two nodes): a job of two
                   # ranks fits one node, or two nodes with one rank each
KILL_WAIT = 30     # seconds between a job's SIGTERM (scancel, requeue, preemption) and its SIGKILL (Slurm's default)
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "sinfo", "scancel")


def why_not() -> str | None:
    """Why this machine cannot run the Slurm tests, or None if it can."""
    missing = [d for d in DAEMONS if not shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if missing:
        return (f"slurm: {', '.join(missing)} not found; `make setup` installs slurmctld, slurmd, slurm-client and "
                f"munge as root (Debian: apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        return f"slurm: slurmd must run as root to start jobs (running as uid {os.geteuid()})"
    return None


def _which(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


@dataclass
class Cluster:
    workdir: Path
    conf: Path
    daemons: list[subprocess.Popen] = field(default_factory=list)
    started_in: float = 0.0  # seconds from the first daemon's start to both nodes idle

    def env(self, **extra: str) -> dict:
        """This process's environment without any Slurm variables (pytest itself may run inside a Slurm job)
        and with SLURM_CONF pointing at this cluster (what the clients need), plus `extra`; a job submitted
        with it inherits it (sbatch's --export=ALL)."""
        mine = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        return {**mine, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *argv: str, timeout: float = 60, check: bool = True, **extra_env: str) -> str:
        """Run a Slurm client (sbatch, scontrol...) against this cluster; its stdout, or an AssertionError
        with its output and the daemons' log tails when `check` and it fails."""
        proc = subprocess.run([_which(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                              env=self.env(**extra_env))
        if check and proc.returncode != 0:
            raise AssertionError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stdout}{proc.stderr}"
                                 f"\n{self.logs()}")
        return proc.stdout

    def sbatch(self, *args: str, cwd: Path | None = None, **extra_env: str) -> int:
        """Submit (sbatch --parsable ARGS) from `cwd`; the job id."""
        proc = subprocess.run([_which("sbatch"), "--parsable", *args], capture_output=True, text=True, timeout=60,
                              cwd=cwd, env=self.env(**extra_env))
        assert proc.returncode == 0, f"sbatch {' '.join(args)} failed: {proc.stdout}{proc.stderr}\n{self.logs()}"
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the job has left slurmctld)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out)) if "JobId=" in out else {}

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 300) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; its record then."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            if record.get("JobState") in states:
                return record
            assert time.monotonic() < deadline, (f"job {job_id} not in {states} within {timeout} s: {record}\n"
                                                 f"{self.logs()}")
            time.sleep(0.2)

    def finished(self, job_id: int, runs: int = 1, timeout: float = 600) -> list[dict[str, str]]:
        """Wait until the job has ended `runs` times (a requeued job ends once per run); each run's jobcomp
        record (JobState, ExitCode "code:signal", StartTime, EndTime...), oldest first."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.completions(job_id)
            if len(done) >= runs:
                return done
            assert time.monotonic() < deadline, (f"job {job_id} did not end {runs} time(s) within {timeout} s "
                                                 f"(ended {len(done)}: {done}); now {self.job(job_id)}\n{self.logs()}")
            time.sleep(0.2)

    def completions(self, job_id: int) -> list[dict[str, str]]:
        log = self.workdir / "jobcomp.log"
        lines = log.read_text().splitlines() if log.exists() else []
        records = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines]
        return [r for r in records if r.get("JobId") == str(job_id)]

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (after a test's jobs: the next test starts on an empty cluster)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
            if states and all(s == "idle" for s in states[1::2]):
                return
            assert time.monotonic() < deadline, f"nodes not idle: {states}\n{self.logs()}"
            time.sleep(0.2)

    def logs(self, tail: int = 2000) -> str:
        parts = []
        for log in sorted(self.workdir.glob("*.log")) + sorted((self.workdir / "munge").glob("*.log")):
            parts.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


def _config(workdir: Path, ports: dict[str, int]) -> str:
    host = socket.gethostname()
    nodes = "".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={CPUS_PER_NODE} "
                    f"RealMemory=2000 State=UNKNOWN\n" for n in NODES)
    return f"""\
# The tests' Slurm cluster (tests/slurm/cluster.py): two nodes on this host, everything under {workdir}
ClusterName=hvdp
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['slurmctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s)
AuthInfo=socket={workdir}/munge/socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool/%n
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd-%n.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd-%n.log
TmpFS={workdir}/tmp/%n
PlugStackConfig={workdir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={workdir}/jobcomp.log
# MinJobAge: a finished job leaves slurmctld after 2 s (default 300; sbatch --wait polls late until then)
MinJobAge=2
KillWait={KILL_WAIT}
ReturnToService=2
InactiveLimit=0
# sched_interval: how often pending jobs are looked at (default 60 s: a requeued job would wait that long)
SchedulerParameters=sched_interval=1
SlurmdTimeout=300
{nodes}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


PREFIX = "hvdp-slurm-"


def make_workdir() -> Path:
    """A new directory for a cluster, /tmp/hvdp-slurm-<this pid>-XXXX (short: Unix socket paths live there),
    after ending the daemons of clusters whose test process has died without stopping them (a timeout's
    SIGKILL); another live test session's cluster is left alone."""
    _clean_leftovers()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))


def _clean_leftovers() -> None:
    owner = re.compile(rf"/tmp/{PREFIX}(\d+)-")
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found = owner.search(cmdline.read_bytes().decode(errors="replace"))
            if found and not Path(f"/proc/{found.group(1)}").exists():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue
    for old in Path("/tmp").glob(f"{PREFIX}*-*"):
        found = owner.search(str(old) + "/")
        if found and not Path(f"/proc/{found.group(1)}").exists():
            shutil.rmtree(old, ignore_errors=True)


def start(workdir: Path, timeout: float = 60) -> Cluster:
    """munged, slurmctld and the slurmd of every node, in the foreground of processes this one started;
    returns once every node is idle. Everything is stopped again if that fails."""
    started = time.monotonic()
    for d in ("munge", "state", *(f"spool/{n}" for n in NODES), *(f"tmp/{n}" for n in NODES)):
        (workdir / d).mkdir(parents=True, exist_ok=True)
    (workdir / "munge").chmod(0o700)
    key = workdir / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (workdir / "plugstack.conf").write_text("")
    ports = {name: free_port() for name in ("slurmctld", *NODES)}
    conf = workdir / "slurm.conf"
    conf.write_text(_config(workdir, ports))
    cluster = Cluster(workdir=workdir, conf=conf)
    munge = workdir / "munge"

    def daemon(name: str, argv: list[str]) -> None:
        log = open(workdir / f"{name}.out", "w")
        cluster.daemons.append(subprocess.Popen([_which(argv[0]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                                                env=cluster.env(), start_new_session=True))

    try:
        # --force: the key and socket are root's, under a directory others cannot enter; nobody else needs them
        daemon("munged", ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge}/socket",
                          f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                          f"--seed-file={munge}/seed"])
        _wait("munged's socket", lambda: (munge / "socket").exists(), cluster, timeout)
        daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
        for node in NODES:
            daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(conf)])
        cluster.wait_idle(timeout)
    except BaseException:
        stop(cluster)
        raise
    cluster.started_in = time.monotonic() - started
    return cluster


def _wait(what: str, ready, cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for d in cluster.daemons:
            assert d.poll() is None, f"{d.args[0]} exited ({d.returncode}) before {what}\n{cluster.logs()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s\n{cluster.logs()}"
        time.sleep(0.1)


def stop(cluster: Cluster) -> None:
    """Cancel what still runs, then SIGTERM every daemon this module started (slurmd first; SIGKILL after 10 s)
    and whatever is left of the jobs they ran (each daemon leads its own session; a job's slurmstepd and
    ranks are in theirs, found by their SLURM_CONF)."""
    if any(d.poll() is None for d in cluster.daemons[1:2]):
        cluster.run("scancel", "--full", "--user", str(os.geteuid()), check=False, timeout=20)
    for d in reversed(cluster.daemons):
        if d.poll() is None:
            d.send_signal(signal.SIGTERM)
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
    _kill_strays(cluster.conf)


def _kill_strays(conf: Path) -> None:
    """SIGKILL the processes whose environment names this cluster's slurm.conf (a job's ranks, slurmstepd)."""
    marker = f"SLURM_CONF={conf}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            pid = int(environ.parent.name)
            if pid != os.getpid() and marker in environ.read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue


def main() -> None:
    """The figures docs/launchers.md quotes: the cluster's start, srun of the smallest hvdp job (init and one
    average, tests/clusters/jobs.py:startup) on one node and across two, 3 times each, and the main job through
    sbatch examples/slurm.sbatch (srun, one node), from submission to the end of its record."""
    import statistics
    import sys

    from tests.launch import ROOT

    cluster = start(make_workdir())
    try:
        print(f"cluster up (munged, slurmctld, 2 x slurmd, nodes idle): {cluster.started_in:.2f} s", flush=True)
        job = [sys.executable, "-c", "from tests.clusters.jobs import startup; startup()"]
        for nodes in (1, 2):
            times = []
            for _ in range(3):
                started = time.monotonic()
                cluster.run("srun", f"-N{nodes}", "-n2", "--mpi=pmix", *job, timeout=300,
                            PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
                times.append(time.monotonic() - started)
            print(f"srun -N{nodes} -n2 --mpi=pmix, init + one average: median {statistics.median(times):.1f} s "
                  f"({', '.join(f'{t:.1f}' for t in times)})", flush=True)
        started = time.monotonic()
        out = cluster.workdir / "main.out"
        job_id = cluster.sbatch("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", f"--output={out}",
                                str(ROOT / "examples" / "slurm.sbatch"), cwd=cluster.workdir,
                                HVDP_CHECKPOINT_DIR=str(cluster.workdir / "checkpoints"))
        record = cluster.finished(job_id)[-1]
        print(f"sbatch examples/slurm.sbatch (srun, 1 node, 2 ranks, 12 epochs): {record['JobState']} "
              f"{time.monotonic() - started:.1f} s from submission to the end ({record['StartTime']} to "
              f"{record['EndTime']})", flush=True)
    finally:
        stop(cluster)
        shutil.rmtree(cluster.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
