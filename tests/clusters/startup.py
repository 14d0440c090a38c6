"""How long each launcher takes to start a two-rank hvdp job on this machine: `python -m tests.clusters.startup`.

The job is tests/clusters/jobs.py:startup (hvdp_torch.init(), one average() over the ranks, exit). Timed with
a monotonic clock in this process: for plain python, horovodrun (Gloo and MPI) and mpirun the whole command
(process start, torch and Horovod import, rendezvous, exit); for Spark and Ray the cluster's start (once:
tests/clusters/procs.py's, as the tests use it) and then each hvdp.spark.run / hvdp.ray.run of the job.
Prints the median and every run of --repeats; docs/launchers.md quotes the latest. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.clusters.procs import start_ray, start_spark, stop_ray, stop_spark
from tests.launch import ROOT, env, launcher_cmd

JOB = "tests.clusters.jobs:startup"
CODE = "from tests.clusters.jobs import startup; startup()"


def timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def command(launcher: str) -> None:
    np = 1 if launcher == "python" else 2
    proc = subprocess.run(launcher_cmd(launcher, np) + ["-c", CODE], capture_output=True, text=True, cwd=ROOT,
                          env=env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: list[tuple[str, list[float]]] = []
    for label, launcher in (("python, 1 process", "python"), ("horovodrun --gloo -np 2", "gloo"),
                            ("horovodrun --mpi -np 2", "mpi"), ("mpirun -np 2", "mpirun")):
        rows.append((label, [timed(lambda: command(launcher)) for _ in range(args.repeats)]))
        print(rows[-1], flush=True)

    import hvdp.ray
    import hvdp.spark

    session = None
    started = time.monotonic()
    try:
        session = start_spark()
        rows.append(("Spark local-cluster[2,1,1024]: session and 2 executors", [time.monotonic() - started]))
        runs = [timed(lambda: hvdp.spark.run(JOB, num_proc=2)) for _ in range(args.repeats)]
        rows.append(("hvdp.spark.run, num_proc=2 (first, then later runs)", runs))
    finally:
        if session is not None:
            stop_spark(session)
    print(rows[-2:], flush=True)

    with tempfile.TemporaryDirectory() as logs:
        started = time.monotonic()
        address, nodes = start_ray(Path(logs))
        try:
            rows.append(("Ray head + 1 node (ray start), driver connected", [time.monotonic() - started]))
            runs = [timed(lambda: hvdp.ray.run(JOB, num_workers=2)) for _ in range(args.repeats)]
            rows.append(("hvdp.ray.run, num_workers=2 (first, then later runs)", runs))
        finally:
            stop_ray(nodes)

    print("\n| launch | median s | every run, s |\n|---|---|---|")
    for label, times in rows:
        print(f"| {label} | {statistics.median(times):.1f} | {', '.join(f'{t:.1f}' for t in times)} |")


if __name__ == "__main__":
    sys.exit(main())
