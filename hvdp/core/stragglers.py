"""Which rank is slow, and why: per-rank step accounting, the straggler rule and its report line, and the
formatting of a rank's last collectives. Framework-free (stdlib only); the adapters feed it plain numbers.

In data parallelism every rank's step lasts as long as the slowest rank's: the fast ones wait for it in the
gradient collectives. So a rank's step time says nothing; what it spends *before* the collectives does. Each
rank splits every optimizer step into

- input: waiting for its data loader;
- compute: the rest of the step until its last gradient is ready (forward, backward, the user's own code);
- wait: in the gradient collectives (a fast rank waits there for the slow one);
- optimizer: the optimizer's update after them;

(StepAccount, fed by the adapter's hooks with time.perf_counter() readings). Every reporting period (an
epoch of shard()'s loader, or K optimizer steps: both reached by every rank at the same step) the ranks
gather their period's summary (summarize()) and rank 0 applies the rule (Detector):

    a rank is a straggler when the median over the period of its per-step input (or compute) time is more
    than THRESHOLD (20%) above the median of the other ranks' medians, by at least MIN_EXCESS (10%) of the
    median step, in at least CONSECUTIVE (2) consecutive periods.

Medians over a period make one slow step (a collection, a page fault) count for nothing; the median of the
*other* ranks is the reference, so that at 2 ranks a rank 40% slow is 40% above it (against the median of
both it would be 17% above); the absolute floor keeps a 50% difference of 0.1 ms of input out of the report;
two periods keep a one-off (a checkpoint written on one rank, a neighbour's burst) out. The false-alarm rate
of the rule on balanced, noisy ranks is measured by alarm_rate() (tests/core/test_stragglers.py;
docs/troubleshooting.md states it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

THRESHOLD = 0.20     # a rank's median above the other ranks' median by more than this fraction
MIN_EXCESS = 0.10    # ... and by at least this fraction of the median step
CONSECUTIVE = 2      # ... in this many consecutive periods
CAUSES = ("input", "compute")  # what the rule looks at: the time a rank spends before the collectives
PARTS = ("input", "compute", "wait", "optimizer")
FIRST_STEPS = 50     # the first period ends after this many steps (or at the end of the epoch)
DEFAULT_SECONDS = 180.0  # later periods last about this long (HVDP_STRAGGLER_SECONDS), in whole steps
MIN_STEPS = 50       # ... and have at least this many steps
RING = 32            # collectives each rank remembers


class StepAccount:
    """One rank's per-step times, as the adapter's hooks report them (times from time.perf_counter()).

    A step begins when the previous one ended (or when the loader starts an epoch); input() adds the time
    spent waiting for a batch, ready() marks the last gradient ready (each backward pass's end), waited()
    adds time in the gradient collectives, and ended() closes the step with the optimizer's update time.
    compute = (the last ready(), or the first waited() start when none came) - begin - input - the waits
    before that ready() (the sharded path waits for the other ranks inside the backward pass, to bound the
    gradients in flight: a fast rank's wait there is not its compute). A few float operations per call;
    `steps` holds the closed steps since the last take().
    """

    __slots__ = ("begin", "input_s", "ready_at", "wait_s", "wait_from", "wait_at_ready", "steps")

    def __init__(self):
        self.begin: float | None = None
        self.input_s = 0.0
        self.ready_at: float | None = None
        self.wait_s = 0.0
        self.wait_from: float | None = None
        self.wait_at_ready = 0.0  # wait_s at the last ready()
        self.steps: list[tuple[float, float, float, float, float]] = []  # (input, compute, wait, optimizer, total)

    def idle(self) -> bool:
        """No step is under way (nothing measured since the last one ended)."""
        return self.input_s == 0.0 and self.ready_at is None and self.wait_from is None

    def restart(self, now: float) -> None:
        """Begin the next step at `now` (an epoch starts, a report ended): what came before counts in no step."""
        if self.idle():
            self.begin = now

    def input(self, start: float, end: float) -> None:
        if self.begin is None:
            self.begin = start
        self.input_s += end - start

    def ready(self, now: float) -> None:
        self.ready_at, self.wait_at_ready = now, self.wait_s

    def waited(self, start: float, end: float) -> None:
        if self.wait_from is None:
            self.wait_from = start
        self.wait_s += end - start

    def ended(self, now: float, optimizer: float) -> None:
        """The optimizer step ended at `now`, its update having taken `optimizer` seconds."""
        begin = self.begin if self.begin is not None else now
        ready = self.ready_at if self.ready_at is not None else (self.wait_from if self.wait_from is not None
                                                                 else now - optimizer)
        early = self.wait_at_ready if self.ready_at is not None else 0.0
        compute = max(0.0, ready - begin - self.input_s - early)
        self.steps.append((self.input_s, compute, self.wait_s, max(0.0, optimizer), max(0.0, now - begin)))
        self.begin, self.input_s, self.ready_at, self.wait_s, self.wait_from = now, 0.0, None, 0.0, None
        self.wait_at_ready = 0.0

    def take(self) -> list[tuple[float, float, float, float, float]]:
        """The steps closed since the last take(), forgotten here."""
        steps, self.steps = self.steps, []
        return steps


def summarize(steps, host: str = "") -> dict:
    """A period's figures for one rank: its step count, the median per step of each part and of the step,
    and its total and waiting seconds (plain values, for the all-gather)."""
    if not steps:
        return {"host": host, "steps": 0, "step": 0.0, "seconds": 0.0, "waited": 0.0,
                **{p: 0.0 for p in PARTS}}
    columns = list(zip(*steps))
    out = {"host": host, "steps": len(steps), "step": statistics.median(columns[4]),
           "seconds": math.fsum(columns[4]), "waited": math.fsum(columns[2])}
    out.update({p: statistics.median(columns[i]) for i, p in enumerate(PARTS)})
    return out


@dataclass(frozen=True, slots=True)
class Finding:
    """One rank slow in one part, for one period."""

    rank: int
    host: str
    cause: str           # "input" or "compute"
    value: float         # its median seconds per step
    reference: float     # the other ranks' median of medians
    others_wait: float   # the other ranks' median fraction of their time spent waiting in the collectives
    periods: int = 1     # consecutive periods the rule held, this one included


def findings(summaries: list[dict], threshold: float = THRESHOLD, min_excess: float = MIN_EXCESS) -> list[Finding]:
    """Which ranks are slow in which part in this period (one period: no persistence yet).

    Args:
        summaries: every rank's summarize() of the period, by rank.
        threshold: the fraction above the other ranks' median that counts as slow.
        min_excess: the least excess, as a fraction of the median step, that counts.
    """
    if len(summaries) < 2 or any(s["steps"] == 0 for s in summaries):
        return []
    step = statistics.median(s["step"] for s in summaries)
    out = []
    for cause in CAUSES:
        for r, s in enumerate(summaries):
            others = [q for i, q in enumerate(summaries) if i != r]
            reference = statistics.median(q[cause] for q in others)
            if s[cause] > reference * (1 + threshold) and s[cause] - reference > min_excess * step:
                waits = [q["waited"] / q["seconds"] for q in others if q["seconds"] > 0]
                out.append(Finding(r, s.get("host", ""), cause, s[cause], reference,
                                   statistics.median(waits) if waits else 0.0))
    return out


@dataclass
class Detector:
    """The rule over consecutive periods (kept by rank 0): update() with each period's summaries returns the
    findings that held in `consecutive` periods in a row (so a balanced run returns none)."""

    threshold: float = THRESHOLD
    consecutive: int = CONSECUTIVE
    min_excess: float = MIN_EXCESS
    streak: dict = field(default_factory=dict)  # (rank, cause) -> consecutive periods it held

    def update(self, summaries: list[dict]) -> list[Finding]:
        now = findings(summaries, self.threshold, self.min_excess)
        streak = {(f.rank, f.cause): self.streak.get((f.rank, f.cause), 0) + 1 for f in now}
        self.streak = streak
        return [Finding(f.rank, f.host, f.cause, f.value, f.reference, f.others_wait, streak[(f.rank, f.cause)])
                for f in now if streak[(f.rank, f.cause)] >= self.consecutive]


def report_line(finding: Finding, steps: int) -> str:
    """The line rank 0 logs for a straggler: which rank, its host, what is slow, by how much, and what the
    others lose waiting for it."""
    host = f" (host {finding.host})" if finding.host else ""
    what = "waiting for its input (data loader)" if finding.cause == "input" else "in compute (forward/backward)"
    ratio = finding.value / finding.reference if finding.reference > 0 else math.inf
    by = f"{ratio:.2f}x" if math.isfinite(ratio) else "far above"
    return (f"hvdp stragglers: rank {finding.rank}{host} is slow {what}: {_ms(finding.value)} per step, {by} the "
            f"other ranks' median ({_ms(finding.reference)}), for {finding.periods} consecutive periods (the last "
            f"of {steps} steps); the other ranks spend {finding.others_wait:.0%} of their time waiting for it in "
            f"the gradient collectives")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def period_steps(step_seconds: float, target: float = DEFAULT_SECONDS) -> int:
    """K, the steps of a reporting period after the first: about `target` seconds of steps of `step_seconds`
    (rank 0's median step in the first period), at least MIN_STEPS."""
    if not step_seconds > 0 or not math.isfinite(step_seconds):
        return MIN_STEPS
    return max(MIN_STEPS, int(target / step_seconds))


def table(summaries: list[dict]) -> dict:
    """A period's figures for the logs (result JSON, TensorBoard): per rank, ms per step of each part."""
    return {str(r): {"host": s.get("host", ""), "steps": s["steps"],
                     **{p: round(s[p] * 1e3, 3) for p in (*PARTS, "step")}} for r, s in enumerate(summaries)}


# ------------------------------------------------------------------ the rule's false alarms, measured

def synthetic_steps(rng, ranks: int, steps: int, *, input_s: float = 0.005, compute_s: float = 0.05,
                    sigma: float = 0.3, spike_p: float = 0.05, spike: float = 5.0, slow: tuple = (None, "", 1.0)):
    """Per-step (input, compute) seconds of `ranks` ranks over `steps` steps under a noise model, an array of
    shape (ranks, steps, 2): each log-normal around `input_s` / `compute_s` with relative spread `sigma`, a
    fraction `spike_p` of steps `spike` times longer (a collection, a page fault, a neighbour's burst).
    `slow` = (rank, part, factor) makes one part of one rank slower. `rng`: a numpy Generator."""
    import numpy as np
    t = np.array([input_s, compute_s]) * rng.lognormal(0.0, sigma, size=(ranks, steps, 2))
    t *= np.where(rng.random((ranks, steps, 2)) < spike_p, spike, 1.0)
    if slow[0] is not None:
        t[slow[0], :, PARTS.index(slow[1])] *= slow[2]
    return t


def summaries_of(t, hosts=None) -> list[dict]:
    """summarize() of each rank of synthetic_steps()'s array (its wait and optimizer parts 0), vectorised."""
    import numpy as np
    med = np.median(t, axis=1)
    total = t.sum(axis=2)
    step, seconds = np.median(total, axis=1), total.sum(axis=1)
    return [{"host": hosts[r] if hosts else "", "steps": t.shape[1], "input": float(med[r, 0]),
             "compute": float(med[r, 1]), "wait": 0.0, "optimizer": 0.0, "step": float(step[r]),
             "seconds": float(seconds[r]), "waited": 0.0} for r in range(t.shape[0])]


def alarm_rate(trials: int, *, ranks: int, periods: int, steps: int, seed: int = 0, **noise) -> float:
    """The fraction of `trials` runs of `periods` periods of `steps` steps in which the rule named anybody,
    the ranks' steps drawn from synthetic_steps(`noise`): with every rank alike, the false-alarm rate; with
    noise's `slow`, one minus the rate of missing that rank (it may name another: see detections())."""
    import numpy as np
    rng = np.random.default_rng(seed)
    alarms = 0
    for _ in range(trials):
        detector = Detector()
        if any(detector.update(summaries_of(synthetic_steps(rng, ranks, steps, **noise))) for _ in range(periods)):
            alarms += 1
    return alarms / trials


def detections(trials: int, *, ranks: int, periods: int, steps: int, slow: tuple, seed: int = 0, **noise):
    """(the fraction of `trials` runs in which the rule named the slow rank with its cause by the end of
    period `periods`, the fraction in which it named anything else): `slow` = (rank, part, factor)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    right = wrong = 0
    for _ in range(trials):
        detector, named = Detector(), set()
        for _ in range(periods):
            named |= {(f.rank, f.cause) for f in detector.update(
                summaries_of(synthetic_steps(rng, ranks, steps, slow=slow, **noise)))}
        right += (slow[0], slow[1]) in named
        wrong += bool(named - {(slow[0], slow[1])})
    return right / trials, wrong / trials


# ------------------------------------------------------------------ the last collectives

@dataclass(frozen=True, slots=True)
class Call:
    """One collective of a rank: its sequence number on that rank, Horovod's name, bytes (None: unknown),
    start and end (time.monotonic(); end None while it has not finished), and the error it raised."""

    seq: int
    name: str
    size: int | None
    start: float
    end: float | None = None
    error: str | None = None


def format_calls(rank: int, calls: list[Call], now: float) -> str:
    """A rank's ring of last collectives, oldest first, one per line, for stderr or a file."""
    lines = [f"hvdp: rank {rank}'s last {len(calls)} collective(s), oldest first:"]
    for c in calls:
        size = f"{c.size} B" if c.size is not None else "size unknown"
        if c.end is None:
            state = f"NOT FINISHED, in it for {now - c.start:.3f} s"
        else:
            state = f"{c.end - c.start:.4f} s, ended {now - c.end:.3f} s ago"
        error = f", raised {c.error}" if c.error else ""
        lines.append(f"  #{c.seq} {c.name} ({size}): {state}{error}")
    return "\n".join(lines)


def not_entered(current: dict[int, str | None], lacks: dict[int, set]) -> list[tuple[str, list[int], list[int]]]:
    """Which ranks had not entered the collectives the others were in.

    Args:
        current: by rank, the collective it waits in now (None: outside any).
        lacks: by rank, the names of other ranks' collectives it never submitted (what its heartbeats say;
            for this rank, the others' collectives less its own pending ones).

    Returns:
        For each collective some rank waits in that some other rank never submitted: (its name, the ranks in
        it, the ranks that had not entered it).
    """
    out = []
    for name in sorted({n for n in current.values() if n is not None}):
        inside = sorted(r for r, n in current.items() if n == name)
        missing = sorted(r for r in current if r not in inside and name in lacks.get(r, ()))
        if missing:
            out.append((name, inside, missing))
    return out


def describe_not_entered(found: list[tuple[str, list[int], list[int]]], current: dict[int, str | None]) -> str:
    """rank 0's sentence for not_entered()'s answer: each collective, who is in it, who had not entered it
    and where those are instead."""
    parts = []
    for name, inside, missing in found:
        where = "; ".join(f"rank {r} is {'in ' + current[r] if current.get(r) else 'outside any collective'}"
                          for r in missing)
        parts.append(f"{_ranks(missing)} had not entered {name}, which {_ranks(inside)} "
                     f"{'is' if len(inside) == 1 else 'are'} in ({where})")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
