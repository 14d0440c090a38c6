"""A rank that waits costs next to no CPU (issue 37). Horovod's background thread negotiates with its peers
every cycle; before hvdp's fixes 11 and 12 (scripts/build_horovod.sh) it did so every millisecond whatever
the rank was doing, and under MPI each negotiation's wait spun: a rank sleeping, or waiting in a collective
for a late peer, used 10-16% of a core here (MPI and Gloo alike; 33-69% on an idle host in the issue).

tests/faults/idle_worker.py measures each rank's process CPU time, all threads, while rank 1 sleeps before a
collective rank 0 waits in ("late") and while both sleep ("idle"). The bound, 5% of a core, is the issue's:
a count of CPU seconds, not a speed, and what was measured on this machine with the fixes is a fifth of it.
"""

import json

import pytest

from tests.launch import ROOT, result_line, run, skip_without_mpi

WORKER = ROOT / "tests" / "faults" / "idle_worker.py"
SECONDS = 4.0  # per window: the bound is 0.2 s of CPU, what was measured with the fixes 0.01-0.04


@pytest.mark.parametrize("timeline", [False, True], ids=["", "timeline"])
@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_a_rank_waiting_for_a_late_peer_or_sleeping_uses_under_5_percent_of_a_core(launcher, timeline, tmp_path):
    """With the timeline on (HOROVOD_TIMELINE=file) too: its writer thread yielded in a loop while it had
    nothing to write, a whole core per rank for as long as it waited (issue 52: 20.5 s of CPU in 20 s under
    MPI, 20.1 under Gloo); fix 15 makes it sleep until an event is enqueued."""
    skip_without_mpi(launcher)
    env = {"HOROVOD_TIMELINE": str(tmp_path / "timeline.json")} if timeline else {}
    proc = run(launcher, WORKER, "--seconds", str(SECONDS), timeout=300, extra_env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    used = result_line(proc.stdout)
    for window, what in (("late", "rank 1 slept before a collective rank 0 waited in"),
                         ("idle", "both ranks slept")):
        for rank, cpu in enumerate(used[window]):
            assert cpu < 0.05 * SECONDS, (f"rank {rank} used {cpu:.2f} s of CPU in {SECONDS:.0f} s while {what} "
                                          f"({launcher}{', timeline on' if timeline else ''}): {used}")
    if timeline:  # the timeline was written, and holds the collectives (it is not merely off)
        assert '"allreduce.warm"' in (tmp_path / "timeline.json").read_text(), "no timeline written"


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_ranks_stalled_in_different_collectives_do_not_spin(launcher):
    """Each rank waits in an allreduce that no other rank enqueues (a stall: the stall inspector reports it
    after a minute). Fix 13 starts the next cycle at once for a rank whose tensor waits for a late peer; here
    every rank is such a rank, and cycling at once would spin. Measured (MPI and Gloo): 6-11% of a core per
    rank before fix 13's late-peer start, 6-9% with it; a first version of it, which started at once again
    after each wait of one cycle, used 22-29% under Gloo. The bound, 15%, is above what cycling at Horovod's
    own 1 ms cycle costs."""
    skip_without_mpi(launcher)
    # what Horovod's background thread costs while stalled: hvdp's watchdog, which ends such a job within
    # 3 s of the ranks' heartbeats showing it (issue 47), is off here
    proc = run(launcher, WORKER, "--different-collectives", "--seconds", str(SECONDS), timeout=300,
               extra_env={"HVDP_WATCHDOG": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    every = [json.JSONDecoder().raw_decode(part)[0] for part in proc.stdout.split("result: ")[1:]]
    used = sorted((r["rank"], r["stall_cpu"]) for r in every)
    assert [r for r, _ in used] == [0, 1], proc.stdout[-3000:]
    for rank, cpu in used:
        assert cpu < 0.15 * SECONDS, f"rank {rank} used {cpu:.2f} s of CPU in {SECONDS:.0f} s stalled ({launcher}): {used}"


CYCLE_MS = 200  # Horovod's cycle for the next test: far longer than a small allreduce takes here (~0.1 ms)


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_a_lone_small_allreduce_starts_when_enqueued_not_at_the_next_cycle(launcher):
    """Fix 13: a cycle starts as soon as a tensor no negotiation has taken is enqueued. 30 small allreduces one
    after another (every other one with rank 1 late by up to 2 ms, the rest back to back; sums checked) with
    a 200 ms cycle: before the fix each waited for the rest of its cycle, 30 x ~200 ms = 6 s; with it, 30
    allreduces' time. The bound, 3 s, is half of the cycles' time: a count of cycles waited, not a speed."""
    skip_without_mpi(launcher)
    proc = run(launcher, WORKER, "--prompt", "30", extra_env={"HOROVOD_CYCLE_TIME": str(CYCLE_MS)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = result_line(proc.stdout)
    assert result["sum_ok"], result
    assert max(result["prompt"]) < 0.5 * 30 * CYCLE_MS / 1000, f"the allreduces waited for cycles: {result}"


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_a_late_rank_does_not_wait_for_the_others_next_cycle(launcher):
    """Fix 13 with a late rank: 20 allreduces, each with one rank (alternating) 5-300 ms after the others,
    and a 200 ms cycle. The late rank's wait in its allreduce is an allreduce's time (1-8 ms measured), not
    the rest of the others' cycle. Before the fix, the late rank's cycle often ran empty while the others
    waited, and its enqueue then waited for their next cycle: 40-84 ms in 4 of 12 such allreduces here, and
    in step that way, whole runs of the test above waited a cycle per allreduce (5.7 s of 6 in a CI run)."""
    skip_without_mpi(launcher)
    proc = run(launcher, WORKER, "--late-peer", "20", extra_env={"HOROVOD_CYCLE_TIME": str(CYCLE_MS)},
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = result_line(proc.stdout)
    assert result["sum_ok"], result
    assert len(result["late_wait"]) == 20, result
    assert max(result["late_wait"]) < 0.2 * CYCLE_MS / 1000, f"a late rank waited for a cycle: {result}"


def test_small_allreduces_under_gloo_do_not_wait_for_the_scheduler_tick():
    """Fix 14: Gloo's TCP device loop returned at once, to be called again at once, while a user thread held
    a pair's lock (its socket is level-triggered), and so kept that thread, preempted on the same CPU, off it
    until the scheduler's tick. 600 small allreduces under Gloo, rank 1 late by up to 1 ms before every 4th:
    without the fix 2-48% of the calls took 4 or 8 ms instead of Gloo's ~0.3 ms (13-35% in 5 runs in a row;
    0 of 2,400 calls over 3.5 ms with it). The bound counts calls that waited for a tick, not a speed."""
    proc = run("gloo", WORKER, "--back-to-back", "600", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = result_line(proc.stdout)
    assert result["sum_ok"], result
    for rank, seconds in enumerate(result["seconds"]):
        assert len(seconds) == 450, (rank, len(seconds))
        ticks = sum(s >= 3e-3 for s in seconds)
        assert ticks < 0.01 * len(seconds), (
            f"rank {rank}: {ticks} of {len(seconds)} small allreduces took 3 ms or more (median "
            f"{sorted(seconds)[len(seconds) // 2] * 1e3:.2f} ms)")
