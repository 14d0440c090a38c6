"""The straggler rule, its report line, the step accounting and the ring's formatting, in-process."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hvdp.core import stragglers as sg
from hvdp.core.stragglers import Call, Detector, StepAccount, findings, not_entered, summarize


def summary(input_s, compute_s, steps=50, host="h", waited=0.0):
    step = input_s + compute_s
    return {"host": host, "steps": steps, "input": input_s, "compute": compute_s, "wait": waited / max(steps, 1),
            "optimizer": 0.0, "step": step, "seconds": step * steps, "waited": waited}


# ------------------------------------------------ the accounting of one rank's steps

def test_step_account_splits_a_step_into_its_parts():
    a = StepAccount()
    a.restart(10.0)
    a.input(10.0, 10.5)        # waited 0.5 s for the batch
    a.ready(12.5)              # the last gradient 2.0 s after the batch arrived
    a.waited(12.6, 13.6)       # 1 s in the gradient collectives
    a.ended(14.0, optimizer=0.3)
    (inp, comp, wait, opt, total), = a.take()
    assert (inp, comp, wait, opt, total) == pytest.approx((0.5, 2.0, 1.0, 0.3, 4.0))
    assert a.take() == [] and a.begin == 14.0 and a.idle()


def test_accumulated_passes_count_once_and_the_last_gradient_ends_compute():
    a = StepAccount()
    a.restart(0.0)
    for k in range(3):  # 3 backward passes of one optimizer step: inputs add up, the last ready() counts
        a.input(k * 1.0, k * 1.0 + 0.1)
        a.ready(k * 1.0 + 0.9)
    a.waited(3.0, 3.5)
    a.ended(3.6, optimizer=0.1)
    inp, comp, wait, opt, total = a.take()[0]
    assert inp == pytest.approx(0.3) and comp == pytest.approx(2.9 - 0.3) and total == pytest.approx(3.6)


def test_waits_inside_the_backward_pass_are_not_compute():
    """The sharded path waits for the other ranks' reductions inside the backward pass (at most two buckets in
    flight): a fast rank's 1.5 s there is waiting, not compute, or the fast rank looks like the slow one."""
    a = StepAccount()
    a.restart(0.0)
    a.waited(0.5, 2.0)         # in the backward pass, waiting for a slow peer's bucket
    a.ready(2.5)               # the backward pass ends
    a.waited(2.6, 2.8)         # synchronize()
    a.ended(3.0, optimizer=0.1)
    inp, comp, wait, opt, total = a.take()[0]
    assert comp == pytest.approx(1.0) and wait == pytest.approx(1.7) and total == pytest.approx(3.0)


def test_without_a_ready_mark_compute_ends_where_the_collectives_begin():
    a = StepAccount()
    a.restart(0.0)
    a.waited(1.0, 1.2)
    a.ended(1.5, optimizer=0.3)
    assert a.take()[0][1] == pytest.approx(1.0)


def test_restart_inside_a_step_keeps_its_beginning():
    a = StepAccount()
    a.restart(0.0)
    a.input(0.0, 0.2)
    a.restart(5.0)  # a new epoch's iterator while a step is under way: no effect
    assert a.begin == 0.0


def test_summary_is_the_median_per_part():
    steps = [(0.1, 1.0, 0.2, 0.01, 1.31), (0.1, 9.0, 0.2, 0.01, 9.31), (0.3, 1.2, 0.0, 0.01, 1.51)]
    s = summarize(steps, host="n1")
    assert s["compute"] == 1.2 and s["input"] == 0.1 and s["steps"] == 3 and s["host"] == "n1"
    assert s["seconds"] == pytest.approx(12.13) and s["waited"] == pytest.approx(0.4)


# ------------------------------------------------ the rule

def reference_findings(values, threshold=0.2, min_excess=0.10, steps=None):
    """The rule, written again: value > median(others) * 1.2 and value - median(others) > 10% of median step."""
    out = set()
    steps = steps or [1.0] * len(values)
    mid = sorted(steps)
    step = (mid[(len(mid) - 1) // 2] + mid[len(mid) // 2]) / 2
    for r, v in enumerate(values):
        others = sorted(values[:r] + values[r + 1:])
        ref = (others[(len(others) - 1) // 2] + others[len(others) // 2]) / 2
        if v > ref * (1 + threshold) and v - ref > min_excess * step:
            out.add(r)
    return out


@pytest.mark.parametrize("ranks", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("factor", [1.0, 1.1, 1.17, 1.24, 1.5, 3.0])
@pytest.mark.parametrize("slow_rank", [0, 1, -1])
def test_one_period_against_an_independent_reference(ranks, factor, slow_rank):
    rng = np.random.default_rng(ranks * 100 + int(factor * 100))
    base = list(0.5 + 0.01 * rng.random(ranks))  # within 2%: never named alone
    slow = slow_rank % ranks
    compute = [b * (factor if r == slow else 1.0) for r, b in enumerate(base)]
    got = {f.rank for f in findings([summary(0.05, c) for c in compute]) if f.cause == "compute"}
    assert got == reference_findings(compute, steps=[0.05 + c for c in compute])
    assert got == ({slow} if factor >= 1.24 else set())


def test_a_difference_too_small_to_matter_is_not_named():
    """Input 0.1 ms against 0.05 ms: twice as slow, but 0.1% of a 50 ms step: below the 10% floor."""
    assert findings([summary(0.00005, 0.05), summary(0.0001, 0.05)]) == []
    assert [f.rank for f in findings([summary(0.001, 0.05), summary(0.01, 0.05)])] == [1]


def test_only_consecutive_periods_report():
    d = Detector()
    slow = [summary(0.01, 0.05), summary(0.01, 0.1)]
    balanced = [summary(0.01, 0.05), summary(0.01, 0.05)]
    assert d.update(slow) == []        # once: a one-off
    assert d.update(balanced) == []    # broken: starts again
    assert d.update(slow) == []
    (f,) = d.update(slow)
    assert (f.rank, f.cause, f.periods) == (1, "compute", 2)
    assert d.update(slow)[0].periods == 3


def test_a_period_without_steps_on_some_rank_names_nobody():
    assert findings([summary(0.01, 0.05), summary(0.01, 0.2, steps=0)]) == []


def test_report_line_says_rank_host_cause_ratio_and_the_others_loss():
    d = Detector()
    periods = [[summary(0.010, 0.05, host="a", waited=0.75), summary(0.025, 0.05, host="gpu-7")]] * 2
    for p in periods:
        found = d.update(p)
    line = sg.report_line(found[0], steps=50)
    assert line.startswith("hvdp stragglers: rank 1 (host gpu-7) is slow waiting for its input (data loader): "
                           "25.0 ms per step, 2.50x the other ranks' median (10.0 ms), for 2 consecutive periods")
    assert "of 50 steps" in line and "spend 25% of their time waiting for it" in line


@pytest.mark.parametrize("step_s, target, expected", [(0.1, 180, 1800), (10.0, 180, 50), (0.0, 180, 50),
                                                     (math.nan, 180, 50), (0.001, 180, 180000)])
def test_period_steps(step_s, target, expected):
    assert sg.period_steps(step_s, target) == expected


# ------------------------------------------------ the noise model: false alarms and detection, measured

# (ranks, steps per period, per-step spread sigma): the rule's false alarms over 10 periods of balanced ranks
# (log-normal per-step input and compute, 5% of steps 5x longer), at most as stated in docs/troubleshooting.md.
FALSE_ALARMS = [(2, 50, 0.3, 0.02), (3, 50, 0.3, 0.02), (8, 50, 0.3, 0.02), (64, 200, 0.5, 0.02)]


@pytest.mark.parametrize("ranks, steps, sigma, bound", FALSE_ALARMS)
def test_false_alarm_rate_on_balanced_noisy_ranks(ranks, steps, sigma, bound):
    trials = 300 if ranks < 64 else 40
    rate = sg.alarm_rate(trials, ranks=ranks, periods=10, steps=steps, sigma=sigma, seed=ranks)
    assert rate <= bound, rate


@pytest.mark.parametrize("ranks", [2, 3, 8])
@pytest.mark.parametrize("slow, at_least", [((1, "compute", 1.4), 0.85), ((1, "input", 3.0), 0.99),
                                            ((0, "compute", 2.0), 0.99)])
def test_a_slow_rank_is_named_within_two_periods(ranks, slow, at_least):
    right, wrong = sg.detections(150, ranks=ranks, periods=2, steps=50, slow=slow, seed=7)
    assert right >= at_least and wrong <= 0.01, (right, wrong)


def test_noise_alone_shows_as_false_alarms_on_short_periods():
    """The model's noise is real enough to matter: on periods of 20 steps at sigma 0.5 the rule does raise
    false alarms (so the bounds above are not vacuous), which is why periods have at least 50 steps."""
    assert sg.alarm_rate(100, ranks=8, periods=10, steps=20, sigma=0.5, seed=1) > 0.2
    assert sg.MIN_STEPS >= 50


# ------------------------------------------------ recorded real timings (tests/torch/test_stragglers.py writes them)

RECORDED = Path(__file__).with_name("data") / "balanced_steps.json"


@pytest.mark.skipif(not RECORDED.exists(), reason="no recorded timings")
def test_recorded_balanced_runs_name_nobody_in_20_repetitions():
    """Per-step times recorded from real balanced launches (np=2 and 3, this machine's 2 shared cores),
    re-cut into periods 20 ways (a random start and the rank order shuffled): the rule names nobody."""
    runs = json.loads(RECORDED.read_text())
    rng = np.random.default_rng(0)
    named = 0
    for run in runs:
        ranks = [np.asarray(r) for r in run["steps"]]
        n = min(len(r) for r in ranks)
        for _ in range(20):
            start = int(rng.integers(0, max(1, n - 4 * run["period"])))
            order = rng.permutation(len(ranks))
            d = Detector()
            for p in range(start, n - run["period"] + 1, run["period"]):
                named += len(d.update([summarize([tuple(s) for s in ranks[r][p:p + run["period"]]])
                                       for r in order]))
    assert named == 0


# ------------------------------------------------ the last collectives

def test_ring_lines_show_what_finished_and_what_did_not():
    calls = [Call(41, "allreduce.fc.weight", 4096, 1.0, 1.002), Call(42, "broadcast.config.sz", 8, 2.0, None),
             Call(43, "allgather.x", None, 2.5, 2.6, error="HorovodInternalError: mismatch")]
    text = sg.format_calls(1, calls, now=5.0)
    assert text.splitlines()[0] == "hvdp: rank 1's last 3 collective(s), oldest first:"
    assert "#41 allreduce.fc.weight (4096 B): 0.0020 s, ended 3.998 s ago" in text
    assert "#42 broadcast.config.sz (8 B): NOT FINISHED, in it for 3.000 s" in text
    assert "#43 allgather.x (size unknown)" in text and "raised HorovodInternalError: mismatch" in text


@pytest.mark.parametrize("current, lacks, expected", [
    # two ranks in different collectives, each lacking the other's: both named, both tensors
    ({0: "broadcast.config.sz", 1: "allgather.shapes.sz"}, {0: {"allgather.shapes.sz"}, 1: {"broadcast.config.sz"}},
     [("allgather.shapes.sz", [1], [0]), ("broadcast.config.sz", [0], [1])]),
    # three ranks: 0 and 2 in x, 1 outside any collective and never submitted x
    ({0: "x", 1: None, 2: "x"}, {0: set(), 1: {"x"}, 2: set()}, [("x", [0, 2], [1])]),
    # another order, everything submitted: nobody is missing
    ({0: "a", 1: "b"}, {0: set(), 1: set()}, []),
])
def test_which_ranks_had_not_entered(current, lacks, expected):
    assert not_entered(current, lacks) == expected


def test_the_sentence_names_ranks_and_both_collectives():
    current = {0: "broadcast.config.sz", 1: "allgather.shapes.sz"}
    text = sg.describe_not_entered(not_entered(current, {0: {"allgather.shapes.sz"}, 1: {"broadcast.config.sz"}}),
                                   current)
    assert text == ("rank 0 had not entered allgather.shapes.sz, which rank 1 is in (rank 0 is in "
                    "broadcast.config.sz); rank 1 had not entered broadcast.config.sz, which rank 0 is in (rank 1 "
                    "is in allgather.shapes.sz)")
