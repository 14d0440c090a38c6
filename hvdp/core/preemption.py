"""Preemption policy: which signals ask a job to stop and come back, when its ranks act on one, and the exit
code that asks the scheduler to run it again. Pure (stdlib only): the adapters install the handlers
(hvdp/_preemption.py) and run the agreement's collective.

A scheduler that takes a job's nodes away sends a signal first: Slurm sends SIGTERM on preemption, `scancel`,
`scontrol requeue` and at the time limit, then SIGKILL `KillWait` seconds later (30 by default); with
`--signal=USR1@120` it sends SIGUSR1 two minutes before the time limit. Kubernetes sends SIGTERM and kills
after the pod's grace period. The signal reaches the ranks at different moments, or only some of them (a
launcher that forwards it to the ranks it started on one node), so a rank must not act on its own: every
rank reports whether it has seen one at each step boundary, the reports are summed over the ranks, and all
ranks stop at the same step when the sum is not 0. Then one checkpoint is written and every rank exits with
REQUEUE_EXIT_CODE.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

from hvdp.core.errors import ConfigError

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: "a temporary failure; the user is invited to retry"
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionSettings:
    """What preemption handling does, from the environment (settings()).

    Attributes:
        enabled: whether init() installs the handlers when its `preemption` argument is None (HVDP_PREEMPTION).
        signals: the signal names that request a stop, e.g. ("SIGTERM", "SIGUSR1") (HVDP_PREEMPT_SIGNALS).
        exit_code: what every rank exits with after the checkpoint, 1-255 (HVDP_REQUEUE_EXIT_CODE).
    """

    enabled: bool = False
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    exit_code: int = REQUEUE_EXIT_CODE


def parse_signals(text: str) -> tuple[str, ...]:
    """The signal names in `text`, a comma-separated list ("SIGTERM,SIGUSR1", "TERM,usr1" or numbers), as SIG*
    names, each once.

    Raises:
        ConfigError: a name is not a signal of this system, or is SIGKILL or SIGSTOP (which cannot be caught),
            or the list is empty.
    """
    names = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            sig = signal.Signals(int(item)) if item.isdigit() else signal.Signals[
                item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()]
        except (KeyError, ValueError):
            raise ConfigError(f"HVDP_PREEMPT_SIGNALS: {item!r} is not a signal name or number on this system "
                              f"(e.g. SIGTERM,SIGUSR1)")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"HVDP_PREEMPT_SIGNALS: {sig.name} cannot be caught by any process; use SIGTERM, "
                              f"SIGUSR1 or SIGUSR2")
        names.append(sig.name)
    if not names:
        raise ConfigError(f"HVDP_PREEMPT_SIGNALS names no signal ({text!r}); e.g. SIGTERM,SIGUSR1")
    return tuple(dict.fromkeys(names))


def settings(environ=None) -> PreemptionSettings:
    """PreemptionSettings from HVDP_PREEMPTION ("1"/"0", default 0), HVDP_PREEMPT_SIGNALS (default
    "SIGTERM,SIGUSR1") and HVDP_REQUEUE_EXIT_CODE (default 75).

    Args:
        environ: the variables to read; default None means os.environ.

    Raises:
        ConfigError: a value is malformed (the message names the variable and the value).
    """
    env = os.environ if environ is None else environ
    flag = env.get("HVDP_PREEMPTION", "0").strip().lower()
    if flag not in ("0", "1", "false", "true", "off", "on", ""):
        raise ConfigError(f"HVDP_PREEMPTION must be 1 (on) or 0 (off), got {env['HVDP_PREEMPTION']!r}")
    code = env.get("HVDP_REQUEUE_EXIT_CODE", str(REQUEUE_EXIT_CODE)).strip()
    if not code.isdigit() or not 1 <= int(code) <= 255:
        raise ConfigError(f"HVDP_REQUEUE_EXIT_CODE must be a whole number from 1 to 255 (0 means success), got "
                          f"{env['HVDP_REQUEUE_EXIT_CODE']!r}")
    return PreemptionSettings(enabled=flag in ("1", "true", "on"),
                              signals=parse_signals(env.get("HVDP_PREEMPT_SIGNALS", ",".join(DEFAULT_SIGNALS))),
                              exit_code=int(code))


class Agreement:
    """Decides, the same way on every rank, at which call the job stops.

    Every rank calls the Agreement at the same points (after each optimizer step) with whether it has seen a
    stop signal; every `every`-th call sums the flags over the ranks, and all ranks stop at the call whose sum
    is not 0. Pipelined (the default), a checking call submits this rank's flag and returns the sum submitted
    at the previous checking call, which has arrived meanwhile: the collective overlaps the steps in between
    instead of adding its latency, and a signal is acted on at the second checking call after it reached any
    rank. Not pipelined, a checking call sums and waits at once (for a framework whose collectives block).
    Every rank reads the same sum at the same call, so all stop after the same step; once it returns True it
    submits nothing more (nothing is left in flight when the ranks exit).

    Args:
        submit: start the sum over the ranks of an int (this rank's 0 or 1); returns a handle.
        wait: the sum for a handle submit returned (blocks until every rank has submitted).
        size: the number of ranks; with 1 nothing is submitted and a signal is acted on at the next call.
        every: sum at every `every`-th call only, an integer >= 1 (default 1: every call).
        pipelined: read each sum at the next checking call (default True), or at once (False).

    Raises:
        ConfigError: `every` is not an integer >= 1.
    """

    def __init__(self, submit: Callable[[int], Any], wait: Callable[[Any], int], size: int, *, every: int = 1,
                 pipelined: bool = True):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"the preemption check interval must be an integer >= 1 (steps), got {every!r}")
        self._submit, self._wait, self._size = submit, wait, size
        self._every, self._pipelined = every, pipelined
        self._pending: Any = None
        self.calls = 0        # how many times the ranks have asked
        self.stopped = False  # a stop was agreed (at call `calls`)

    def __call__(self, requested: bool) -> bool:
        if self.stopped:
            return True
        self.calls += 1
        if self._size == 1:
            self.stopped = bool(requested)
            return self.stopped
        if self.calls % self._every:
            return False
        flag = 1 if requested else 0
        if not self._pipelined:
            self.stopped = self._wait(self._submit(flag)) > 0
            return self.stopped
        agreed = self._pending is not None and self._wait(self._pending) > 0
        self._pending = None
        if agreed:
            self.stopped = True
            return True
        self._pending = self._submit(flag)
        return False


__all__ = ["REQUEUE_EXIT_CODE", "DEFAULT_SIGNALS", "PreemptionSettings", "parse_signals", "settings", "Agreement"]
