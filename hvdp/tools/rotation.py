"""Benchmark jobs that take turns: every implementation's job is started at once, then each runs one short
repetition at a time, in turn, while the others are stopped (SIGSTOP: no CPU at all, not even Horovod's
background thread), so that a slow phase of the host (another tenant, a frequency drop) lasting seconds or
minutes hits every implementation alike, and each ratio compares repetitions seconds apart.

The coordinator (rotate) and the workers (benchmarks/turns.py) talk through files in one directory:
- `<job>.<process>.ready`: a process of the job is set up (imports, init, model) and waits for its first turn;
- `turn`: whose turn it is, "<job> <rep>" (rep "warmup" first, then 0, 1, ...), or "stop" at the end;
- `<job>.<rep>.<process>.json`: a process's measurement of that repetition (written by rename: whole or absent).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.005  # the coordinator's look at the directory; a repetition lasts about a second


@dataclass
class Job:
    """One implementation's run: the processes it starts (one launcher command each; `independent` has several
    plain processes), how many processes report ready, and how many write each repetition's result."""
    name: str
    commands: list[list[str]]
    env: dict
    processes: int  # how many ready files it writes (its ranks)
    writers: int = 1  # result files per repetition (rank 0 of a distributed job; every independent process)
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # every process of the job, launchers included
    final: bool = False  # its last repetition has been handed to it: its processes may end (exit 0) from then


def interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of `values` (independent draws): the order
    statistics (x_(k), x_(n+1-k)) with the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least
    `confidence`. Returns (low, high, coverage); with too few values for `confidence` (n < 6 at 95%) it is
    (min, max) and its own, lower, coverage.

    Raises:
        ValueError: `values` is empty.
    """
    if not values:
        raise ValueError("interval() of no values")
    xs, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def round_order(n: int, r: int) -> list[int]:
    """Round r's order of n jobs: row r mod 2n of a Williams design (a Latin square balanced for the job that
    goes before). Over any 2n consecutive rounds each ordered pair (a, b) is adjacent, b right after a,
    equally often (twice), and each job is in each place twice. So a job's repetition does not always come
    after the same other job's, whose leftovers (caches, memory, a frequency) would otherwise bias one
    implementation against another; a plain rotation (a b c, b c a, ...) puts b after a in all but 1 round of n.
    """
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    row = [(b + r) % n for b in base]
    return row[::-1] if (r // n) % 2 else row  # the mirrored rows: for odd n the square alone is not balanced


def rotate(jobs: list[Job], rounds: int, directory: Path, *, start_timeout: float = 600,
           turn_timeout: float = 300, log=None) -> dict[str, list[list[dict]]]:
    """Start every job, let each take a warm-up turn, then `rounds` rounds of one repetition per job.

    Round r runs the jobs in `round_order(len(jobs), r)`: each job follows every other one equally often, and
    takes every place in a round equally often (over 2n rounds). Returns job name -> per round, the records
    its writers wrote.

    Raises:
        RuntimeError: a job exited or failed to report within the timeouts (with its output's tail).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "turn").write_text("")
    try:
        for job in jobs:
            for i, cmd in enumerate(job.commands):
                log_path = directory / f"{job.name}.{i}.log"
                out = log_path.open("w")
                job.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=job.env,
                                                  start_new_session=True))
                out.close()
                job.logs.append(log_path)
        for job in jobs:
            _wait_for(jobs, job, lambda j=job: len(list(directory.glob(f"{j.name}.*.ready"))) >= j.processes,
                      "to start", start_timeout)
            job.pids = descendants([p.pid for p in job.procs])
        for job in jobs:
            _signal(job, signal.SIGSTOP)
        results: dict[str, list[list[dict]]] = {job.name: [] for job in jobs}
        for r in ["warmup", *range(rounds)]:
            for job in (jobs if r == "warmup" else [jobs[i] for i in round_order(len(jobs), r)]):
                if log and r != "warmup":
                    log(f"round {r + 1}/{rounds}: {job.name}")
                job.final = r == rounds - 1
                records = _turn(jobs, job, r, directory, turn_timeout)
                if r != "warmup":
                    results[job.name].append(records)
        return results
    finally:
        _finish(jobs, directory)


def _turn(jobs: list[Job], job: Job, rep, directory: Path, timeout: float) -> list[dict]:
    """Job `job`'s repetition `rep`: continue it, hand it the turn, wait for its writers, stop it again."""
    write_whole(directory / "turn", f"{job.name} {rep}")
    _signal(job, signal.SIGCONT)
    paths = [directory / f"{job.name}.{rep}.{i}.json" for i in range(job.writers)]
    _wait_for(jobs, job, lambda: all(p.exists() for p in paths), f"to finish repetition {rep}", timeout)
    _signal(job, signal.SIGSTOP)
    return [json.loads(p.read_text()) for p in paths]


def _wait_for(jobs: list[Job], job: Job, done, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for other in jobs:
            for proc, log_path in zip(other.procs, other.logs):
                # A worker ends after its last repetition, maybe before the coordinator stops it: then exit 0
                # is not a failure (unless the job we wait for has ended without its results: below)
                if proc.poll() is not None and not (proc.returncode == 0 and other.final):
                    raise RuntimeError(f"benchmark job {other.name} exited ({proc.returncode}) while waiting for "
                                       f"{job.name} {what}: {' '.join(proc.args)}\n{_tail(log_path)}")
        if all(p.poll() is not None for p in job.procs) and not done():
            raise RuntimeError(f"benchmark job {job.name} ended without {what.removeprefix('to ')}: "
                               f"{' '.join(job.procs[0].args)}\n{_tail(job.logs[0])}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark job {job.name} did not get {what} within {timeout:.0f} s: "
                               f"{' '.join(job.procs[0].args)}\n{_tail(job.logs[0])}")
        time.sleep(POLL_S)


def _finish(jobs: list[Job], directory: Path, timeout: float = 120) -> None:
    """Tell every worker to stop, let them exit, and kill whatever is left after `timeout`."""
    write_whole(directory / "turn", "stop")
    for job in jobs:
        _signal(job, signal.SIGCONT)
    deadline = time.monotonic() + timeout
    for job in jobs:
        for proc in job.procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in job.pids or [p.pid for p in job.procs]:
            kill(pid, signal.SIGKILL)
        for proc in job.procs:
            if proc.poll() is None:
                proc.wait()


def _signal(job: Job, sig: int) -> None:
    for pid in job.pids:
        kill(pid, sig)


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(roots: list[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL `roots` and every process below them, and return once none of them runs any more (exited or a
    zombie), or after `timeout`: a killed process may still be running for a moment after the signal is sent,
    holding its memory and CPU while the next job starts. Returns the processes killed."""
    pids = descendants(roots)
    for pid in reversed(pids):  # the deepest first: a rank does not outlive its launcher by a reparenting
        kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them (by parent pid: torchrun's workers are in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` by rename, so a reader sees the old content or the new, never a part (the
    coordinator's turn file, the workers' ready and result files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
