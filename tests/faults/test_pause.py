"""A pause is not silence (issue 30): every process of a job stopped (SIGSTOP, as `scontrol suspend`, gang
scheduling or Ctrl-Z do it) for 3x the watchdog's and the shared-memory allreduce's limits, then continued,
trains on to identical replicas; one rank stopped alone is still named, and the job ended, within the limit.

np=3, MPI (with hvdp's shared-memory allreduce, whose barriers have their own timeout) and Gloo side by side.
tests/slurm/test_sbatch.py suspends a job through real Slurm (`scontrol suspend`/`resume`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.launch import ROOT, env, launcher_cmd

WORKER = Path(__file__).with_name("pause_worker.py")
LIMIT = 4     # HVDP_WATCHDOG_TIMEOUT and HVDP_SHM_TIMEOUT_SECONDS
PAUSE = 12    # how long the processes stay stopped: 3x both limits
NP = 3
LAUNCHERS = ("mpi", "gloo")


class Job:
    """One launch of pause_worker.py, its output in a file the test reads while it runs."""

    def __init__(self, launcher: str, tmp: Path, steps: int, sleep: float = 0.2, label: str = "", **extra_env: str):
        self.launcher = label or launcher  # the job's name in the test's results
        self.log = tmp / f"{self.launcher}.log"
        tmp.mkdir(parents=True, exist_ok=True)
        self.stop_file = tmp / f"{self.launcher}.stop"
        cmd = launcher_cmd(launcher, NP) + [str(WORKER), "--steps", str(steps), "--sleep", str(sleep),
                                            "--stop-file", str(self.stop_file)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env(HVDP_WATCHDOG_TIMEOUT=str(LIMIT), HVDP_SHM_TIMEOUT_SECONDS=str(LIMIT),
                                                 HVDP_SHM_CHUNK_BYTES="4096", **extra_env))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(rf"pause_worker: step {step}(?!\d)", self.output()):
            assert self.proc.poll() is None, f"{self.launcher}: ended before step {step}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.launcher}: no step {step} in time:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def stop_after(self, steps: int) -> None:
        """Every rank stops `steps` steps after the last one rank 0 printed."""
        last = max(int(n) for n in re.findall(r"pause_worker: step (\d+)", self.output()))
        partial = self.stop_file.with_suffix(".partial")
        partial.write_text(str(last + steps))
        partial.rename(self.stop_file)

    def rank_pid(self, rank: int) -> int:
        return int(re.search(rf"pause_worker: rank {rank} pid (\d+)", self.output()).group(1))

    def processes(self) -> list[psutil.Process]:
        """Every process of the job: the launcher and all it started (mpirun, the ranks, their helpers)."""
        try:
            launcher = psutil.Process(self.proc.pid)
            return [launcher] + launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> int:
        """End whatever is left of the job (continued first, if stopped); its exit code."""
        if self.proc.poll() is None:
            signal_all(self.processes(), signal.SIGCONT)
            signal_all(self.processes(), signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["pkill", "-KILL", "-f", str(WORKER)])
        return self.proc.wait()


def watch(jobs: list[Job], seconds: float, ended: dict[str, float]) -> None:
    """Wait `seconds` (or until every job ended), noting in `ended` when each job ends."""
    deadline = time.monotonic() + seconds
    while len(ended) < len(jobs) and time.monotonic() < deadline:
        for job in jobs:
            if job.launcher not in ended and job.proc.poll() is not None:
                ended[job.launcher] = time.monotonic()
        time.sleep(0.1)


def finish(jobs: list[Job], timeout: float, ended: dict[str, float] | None = None) -> dict[str, tuple[int | None, float]]:
    """Each job's (exit code, when it ended), waiting up to `timeout` for all; the rest is killed. `ended`:
    end times noted earlier by watch()."""
    ended = {} if ended is None else ended
    watch(jobs, timeout, ended)
    results = {}
    for job in jobs:
        code = job.proc.poll()
        job.kill()
        results[job.launcher] = (code, ended.get(job.launcher, time.monotonic()))
    return results


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def test_a_whole_job_stopped_for_longer_than_every_limit_trains_on_to_identical_replicas(tmp_path):
    # MPI with no sleep between steps: its ranks spend most of a step in the shared-memory allreduce, so they
    # are stopped inside it (the old barrier then failed the allreduce on resume in 2 of 2 runs, with the
    # watchdog off); Gloo sleeps a little, or it would finish before the pause.
    jobs = [Job("mpi", tmp_path, steps=10_000, sleep=0.0), Job("gloo", tmp_path, steps=10_000, sleep=0.05)]
    try:
        for job in jobs:  # the slower to start first: neither may finish before it is stopped
            job.wait_for_step(10)
        # Rank 0 last, a second after the rest (as a scheduler stops a job node by node): by then it waits
        # for them inside a collective (MPI: in the shared-memory allreduce's barrier), where it is stopped.
        stopped = {job.launcher: job.processes() for job in jobs}
        last = {job.launcher: psutil.Process(job.rank_pid(0)) for job in jobs}
        for launcher, processes in stopped.items():
            signal_all([p for p in processes if p.pid != last[launcher].pid], signal.SIGSTOP)
        time.sleep(1)
        signal_all(list(last.values()), signal.SIGSTOP)
        time.sleep(PAUSE)
        for processes in stopped.values():
            signal_all(processes[::-1], signal.SIGCONT)
        time.sleep(2)
        for job in jobs:
            job.stop_after(50)  # some steps after the pause, then end
    except BaseException:
        for job in jobs:
            job.kill()
        raise
    results = finish(jobs, timeout=240)
    for job in jobs:
        out = job.output()
        code, _ = results[job.launcher]
        assert code == 0, f"{job.launcher}: exit {code} after the pause:\n{out[-4000:]}"
        digests = set(re.findall(r"pause_worker: rank \d finished, weights ([0-9a-f]{64})", out))
        assert len(re.findall(r"finished, weights", out)) == NP and len(digests) == 1, (job.launcher, out[-3000:])
        assert "stopped responding" not in out and "did not reach the" not in out, out[-4000:]
        assert re.search(r"hvdp watchdog: rank 0's process was paused for 1\d s", out), out[-4000:]


def test_one_rank_stopped_alone_is_named_within_the_limit(tmp_path):
    jobs = [Job(launcher, tmp_path, steps=2000) for launcher in LAUNCHERS]
    stopped_at, ended = {}, {}
    try:
        for job in jobs:
            job.wait_for_step(10)
            os.kill(job.rank_pid(1), signal.SIGSTOP)
            stopped_at[job.launcher] = time.monotonic()
    except BaseException:
        for job in jobs:
            job.kill()
        raise
    results = finish(jobs, timeout=LIMIT + 60, ended=ended)
    for job in jobs:
        out = job.output()
        code, when = results[job.launcher]
        assert code not in (0, None), f"{job.launcher}: not ended:\n{out[-4000:]}"
        assert "rank 1 (last heard" in out or "rank 1 did not reach the" in out, (job.launcher, out[-4000:])
        # the limit, plus a heartbeat interval, plus the launcher's tear-down on 2 shared cores
        assert when - stopped_at[job.launcher] < LIMIT + 30, (job.launcher, when - stopped_at[job.launcher])
