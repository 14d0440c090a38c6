"""What the adapters share of the straggler report (hvdp.core.stragglers): this rank's step account, fed by
the adapters' hooks (the loader's wait, the end of the backward pass, the gradient collectives, the
optimizer's update), and the report at points every rank reaches at the same step: every K optimizer steps
(K agreed at the first report, chosen by rank 0 so that a period lasts about HVDP_STRAGGLER_SECONDS,
default 180) and at the end of an epoch of shard()'s loader in which the optimizer stepped. Never a collective
decided by a rank's own clock.

The report is one small all-gather (every rank's period summary, through gather_or_raise: a rank that fails
there fails every rank); rank 0 applies the rule and logs one line per straggler to stderr. The figures of
every period are kept in `history` (on rank 0, with the findings) for the logs (the result JSON, TensorBoard).

Settings: HVDP_STEP_ACCOUNTING=0 turns the accounting and the report off (to measure their cost);
HVDP_STRAGGLER_STEPS=K fixes the period (the first one included) instead of choosing it;
HVDP_STRAGGLER_SECONDS the period's target length (default 180). No report in a world of 1 or under elastic
(ranks come and go there).
"""

from __future__ import annotations

import os
import socket
import sys
from time import perf_counter

from hvdp.core import stragglers as _core
from hvdp.core.errors import ConfigError
from hvdp.core.world import elastic

ON = os.environ.get("HVDP_STEP_ACCOUNTING", "1") not in ("0", "false", "off")
ACCOUNT = _core.StepAccount()
REPORTING = "in hvdp's straggler report (an all-gather of each rank's step times)"

steps = 0             # optimizer steps ended in this process (the same count on every rank)
_since = 0            # ... since the last report
_period: int | None = None   # K, once agreed
_detector = _core.Detector()
history: list[dict] = []     # per period: {"steps", "ranks": table, "stragglers": [lines]} (rank 0 holds lines)
record: list | None = None   # when a list, every closed step's (input, compute, wait, optimizer, total) is kept here


def periods() -> list[dict]:
    """The straggler report's periods so far in this process, oldest first (at most the last 100): per period
    {"steps": its steps, "ranks": {rank: {"host", "steps", and the median ms per step of "input", "compute",
    "wait", "optimizer" and "step"}}, "stragglers": the lines rank 0 logged (empty on other ranks)}. Empty
    before the first report, in a world of 1 and under elastic. For the logs: the result JSON, TensorBoard."""
    return [{"steps": h["steps"], "ranks": {r: dict(v) for r, v in h["ranks"].items()},
             "stragglers": list(h["stragglers"])} for h in history]


def scalars() -> list[tuple[str, float]]:
    """(TensorBoard tag, ms per step) of the last period: step_ms/<part>/rank<r> for each rank's median input,
    compute, wait and optimizer time; empty before the first period."""
    last = history[-1:]
    return [(f"step_ms/{part}/rank{rank}", row[part]) for rank, row in (last[0]["ranks"].items() if last else ())
            for part in ("input", "compute", "wait", "optimizer")]


def reset() -> None:
    """Forget the periods so far (a new training run in the same process)."""
    global steps, _since, _period, _detector
    ACCOUNT.take()
    ACCOUNT.__init__()
    steps, _since, _period, _detector = 0, 0, None, _core.Detector()
    history.clear()


def _setting(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {raw!r}; unset it for the default ({default:g})")
    return value


# ---------------------------------------------------------------- the hooks (a few perf_counter calls each)

def loader_wait(start: float, end: float) -> None:
    if ON:
        ACCOUNT.input(start, end)


def epoch_start() -> None:
    """A loader starts an epoch: what came before (evaluation, checkpoints) belongs to no step."""
    if ON:
        ACCOUNT.restart(perf_counter())


def backward_done() -> None:
    if ON:
        ACCOUNT.ready(perf_counter())


def collective_wait(start: float) -> None:
    """The gradient collectives ran from `start` until now."""
    if ON:
        ACCOUNT.waited(start, perf_counter())


def step_begin() -> tuple[float, float]:
    """(now, the wait so far), for step_end()."""
    return perf_counter(), ACCOUNT.wait_s


def step_end(hvd, began: tuple[float, float]) -> None:
    """An optimizer step that began at `began` (step_begin()) ended: close the step; report when a period is
    over. Every rank calls it at the same optimizer steps."""
    if not ON:
        return
    now = perf_counter()
    ACCOUNT.ended(now, (now - began[0]) - (ACCOUNT.wait_s - began[1]) if ACCOUNT.wait_s >= began[1]
                  else now - began[0])
    _count(hvd)


def closed(hvd, step: tuple[float, float, float, float, float]) -> None:
    """A step the adapter measured whole, (input, compute, wait, optimizer, total) seconds (Keras's fit, whose
    compiled step marks its own parts: hvdp/_keras_steps.py); report when a period is over. Every rank calls it
    at the same steps."""
    if ON:
        ACCOUNT.steps.append(tuple(max(0.0, float(v)) for v in step))
        _count(hvd)


def _count(hvd) -> None:
    global steps, _since
    steps += 1
    _since += 1
    if _since >= (_period or int(_setting("HVDP_STRAGGLER_STEPS", _core.FIRST_STEPS))):
        report(hvd)


def epoch_end(hvd, steps_before: int) -> None:
    """shard()'s loader finished an epoch (every rank after the same batches); report when the optimizer
    stepped during it (`steps_before`: `steps` when the epoch began), so a loader iterated outside training
    (or on one rank) runs no collective."""
    if ON and steps > steps_before and _since > 0:
        report(hvd)


# ---------------------------------------------------------------- the report

def report(hvd) -> list[str]:
    """End a period: gather every rank's summary, let rank 0 apply the rule and log; returns rank 0's lines."""
    global _since, _period
    taken = ACCOUNT.take()
    if record is not None:
        record.extend(taken)
    _since = 0
    if hvd.size() == 1 or elastic():
        return []
    from hvdp import _horovod

    mine = _core.summarize(taken, socket.gethostname())

    def proposal():
        fixed = os.environ.get("HVDP_STRAGGLER_STEPS")
        if fixed is not None:
            return int(_setting("HVDP_STRAGGLER_STEPS", _core.FIRST_STEPS))
        return _core.period_steps(mine["step"], _setting("HVDP_STRAGGLER_SECONDS", _core.DEFAULT_SECONDS))

    before = _horovod.enter(REPORTING)
    try:
        gathered = _horovod.gather_or_raise(hvd, lambda: (mine, proposal()), name="hvdp.stragglers",
                                            operation="the straggler report")
    finally:
        _horovod.leave(before)
    if _period is None:
        _period = gathered[0][1]  # rank 0's choice, the same on every rank
    summaries = [s for s, _ in gathered]
    lines = []
    if hvd.rank() == 0:
        lines = [_core.report_line(f, mine["steps"]) for f in _detector.update(summaries)]
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    history.append({"steps": mine["steps"], "ranks": _core.table(summaries), "stragglers": lines})
    del history[:-100]
    ACCOUNT.restart(perf_counter())
    return lines
