"""hvdp bench's turn-taking (hvdp/tools/rotation.py with benchmarks/turns.py), on small real processes: one job
runs at a time, a stopped job burns no CPU even with a spinning thread, the rounds' order is balanced,
a failing job is named and nothing is left running; and the median interval against its definition."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap

import pytest

from hvdp.tools import rotation
from tests.launch import ROOT

WORKER = textwrap.dedent("""
    import argparse, sys, threading, time
    sys.path.insert(0, sys.argv.pop(1))
    from turns import Turns, add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--reps", type=int)
    p.add_argument("--spin", action="store_true")  # a background thread that never sleeps (an engine's loop)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--seconds", type=float, default=0.2)  # one repetition's busy time
    args = p.parse_args()
    if args.spin:
        threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
    turns = Turns.from_args(args, args.rank)
    turns.wait("warmup")
    turns.done("warmup", {})
    for rep in range(args.reps):
        turns.wait(rep)
        if rep == args.fail_at:
            sys.exit(3)
        start = time.time()
        while time.time() - start < args.seconds:
            pass
        turns.done(rep, {"samples_per_sec": 1.0, "start": start, "end": time.time(), "cpu": time.process_time(),
                         "rank": args.rank})
""")


def _job(tmp_path, name: str, ranks: int = 1, *flags: str, independent: bool = False, reps: int = 3) -> rotation.Job:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmds = [[sys.executable, str(script), str(ROOT / "benchmarks"), "--turns", str(tmp_path / "turns"), "--job",
             name, "--reps", str(reps), *(["--instance", str(r)] if independent else ["--rank", str(r)]), *flags]
            for r in range(ranks)]
    return rotation.Job(name, cmds, {}, processes=ranks, writers=ranks if independent else 1)


def test_one_job_at_a_time_rounds_rotate_and_a_stopped_job_burns_nothing(tmp_path):
    jobs = [_job(tmp_path, "a", 2, "--spin", "--seconds", "0.1"), _job(tmp_path, "b", 1, "--seconds", "1"),
            _job(tmp_path, "independent", 2, "--seconds", "1", independent=True)]
    results = rotation.rotate(jobs, 3, tmp_path / "turns")
    assert set(results) == {"a", "b", "independent"} and all(len(v) == 3 for v in results.values())
    assert [len(r) for r in results["independent"][0]] and len(results["independent"][0]) == 2
    assert {r["rank"] for r in results["a"][0]} == {0}  # rank 0 of a distributed job reports
    turns = sorted((rec["start"], rec["end"], name, i) for name, rounds in results.items()
                   for i, records in enumerate(rounds) for rec in records)
    jobs_in_order = [name for _, _, name, _ in turns]
    for (s1, e1, n1, _), (s2, e2, n2, _) in itertools.pairwise(turns):
        assert n1 == n2 or e1 <= s2, f"{n1} and {n2} ran at once: {turns}"
    # round r runs round_order(3, r): a, b, independent / b, independent, a / independent, a, b
    firsts = [jobs_in_order[i] for i in (0, 4, 8)]  # the independent job's two processes count twice
    assert firsts == ["a", "b", "independent"], jobs_in_order
    # job a spins a thread (one core while it runs, the GIL shared with its main thread): while stopped it gets
    # no CPU, so by its last turn it has used its start-up and its own 0.1 s turns, not the 6 s the others' took
    last = results["a"][-1][0]
    wall = turns[-1][1] - turns[0][0]
    assert wall > 5 and last["cpu"] < 0.35 * wall, (last["cpu"], wall)
    assert not [p for job in jobs for p in job.procs if p.poll() is None]


@pytest.mark.parametrize("n", range(1, 9))
def test_every_job_follows_every_other_equally_often_and_takes_every_place(n):
    rows = [rotation.round_order(n, r) for r in range(2 * n)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    after = {(a, b): 0 for a in range(n) for b in range(n) if a != b}
    for row in rows:
        for a, b in itertools.pairwise(row):
            after[a, b] += 1
    assert set(after.values()) <= {2}, after  # b right after a in exactly 2 of every 2n rounds, for each pair
    assert all(sorted(row[i] for row in rows) == sorted(list(range(n)) * 2) for i in range(n))
    assert rows == [rotation.round_order(n, r + 2 * n) for r in range(2 * n)]  # and so on, every 2n rounds


def test_a_failed_job_is_named_and_nothing_is_left_running(tmp_path):
    jobs = [_job(tmp_path, "good", reps=3), _job(tmp_path, "bad", 2, "--fail-at", "1", reps=3)]
    with pytest.raises(RuntimeError, match=r"job bad exited \(3\)"):
        rotation.rotate(jobs, 3, tmp_path / "turns", turn_timeout=30)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "worker.py")], capture_output=True, text=True).stdout
    assert not left.split(), left


def test_a_worker_that_ends_after_its_last_repetition_is_no_failure(tmp_path):
    """A worker exits once it has reported its last repetition, maybe before the coordinator has stopped it.
    Here one process of a two-process job reports at once and exits while the other still works on the last
    repetition: the coordinator failed on that exit (0) before (CI, under load). A job whose processes all end
    without reporting a repetition they were handed is still a failure, named."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    base = [sys.executable, str(script), str(ROOT / "benchmarks"), "--turns", str(tmp_path / "turns")]
    uneven = rotation.Job("uneven", [base + ["--job", "uneven", "--reps", "2", "--instance", "0", "--seconds", "0"],
                                     base + ["--job", "uneven", "--reps", "2", "--instance", "1", "--seconds", "1"]],
                          {}, processes=2, writers=2)
    results = rotation.rotate([_job(tmp_path, "other", reps=2), uneven], 2, tmp_path / "turns")
    assert [len(r) for r in results["uneven"]] == [2, 2] and [len(r) for r in results["other"]] == [1, 1]
    (tmp_path / "second").mkdir()
    short = _job(tmp_path / "second", "short", reps=1)  # it ends after 1 repetition, and is handed a second one
    with pytest.raises(RuntimeError, match=r"job short ended without finish repetition 1"):
        rotation.rotate([short], 2, tmp_path / "second" / "turns", turn_timeout=30)


def _coverage(n: int, k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k)), computed another way
    return sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2 ** n


@pytest.mark.parametrize("n", [1, 2, 5, 6, 8, 9, 15, 30])
def test_median_interval_is_the_widest_order_statistic_pair_meeting_the_confidence(n):
    values = [float(v) for v in reversed(range(n))]  # unsorted on purpose
    low, high, coverage = rotation.interval(values, 0.95)
    k = int(low) + 1  # values are 0..n-1: x_(k) == k - 1
    assert high == n - k and math.isclose(coverage, _coverage(n, k))
    assert low <= sorted(values)[(n - 1) // 2] <= high
    if k > 1 or n >= 6:
        assert coverage >= 0.95
    if k + 1 <= (n + 1) // 2:  # a narrower pair would miss the confidence
        assert _coverage(n, k + 1) < 0.95
    if n == 5:
        assert (low, high) == (0.0, 4.0) and math.isclose(coverage, 30 / 32)
