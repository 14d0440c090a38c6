"""The signal side of preemption, shared by the adapters: the handlers init(preemption=True) installs, the
agreement every rank runs after each optimizer step (hvdp.core.preemption, with the adapter's collective), and
the exit that asks for a requeue. Imports no framework.

A handler only records the signal: the training loop acts on it at a step boundary that every rank agrees on.
Until the loop first asks (the first preempted() call), a signal keeps the action it had before init()
(SIGTERM and SIGUSR1 end the process): a job stopped while it starts has nothing to save, and a loop that never
asks is never left running after a SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, NoReturn

from hvdp.core import preemption as policy
from hvdp.core.errors import ConfigError
from hvdp.core.world import World, elastic

_settings: policy.PreemptionSettings | None = None  # set while preemption is on
_rank = 0
_previous: dict[int, object] = {}  # the handlers ours replaced, restored by disable()
_received: list[str] = []          # the stop signals this rank got, in order
_armed = False                     # the loop has asked once: from now on a signal waits for the loop
_agreement: policy.Agreement | None = None
_now: list[Callable[[], None]] = []  # run from hvdp's thread as soon as a stop signal arrives (on_signal_now)
_wakeup: tuple[int, int] | None = None  # the pipe signal.set_wakeup_fd writes each signal's number into


def enable(preemption: bool | None, world: World) -> None:
    """Install the stop-signal handlers when `preemption` is True (None: HVDP_PREEMPTION decides); False
    removes them. Called by each adapter's init(), on every rank.

    Raises:
        ConfigError: a malformed HVDP_PREEMPT_SIGNALS / HVDP_REQUEUE_EXIT_CODE / HVDP_PREEMPTION; preemption
            asked for in elastic mode, or from a thread other than the main one (Python runs signal handlers
            only there).
    """
    global _settings, _rank, _agreement
    found = policy.settings()
    wanted = found.enabled if preemption is None else bool(preemption)
    if not wanted:
        if preemption is False:
            disable()
        return
    if elastic():
        raise ConfigError("preemption=True is not supported in elastic mode: Horovod's elastic driver already "
                          "restarts lost workers, and ranks that join mid-epoch would not agree on the step to "
                          "stop at; use elastic_run's state commits instead", rank=world.rank)
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError("preemption=True installs signal handlers, which Python allows only in the main "
                          "thread; call init() there, or pass preemption=False", rank=world.rank)
    if _settings is not None and (_settings.signals != found.signals or _rank != world.rank):
        disable()
    if _settings is None:
        for name in found.signals:
            sig = signal.Signals[name]
            _previous[sig] = signal.signal(sig, _handle)
            signal.siginterrupt(sig, False)  # restart the system calls a signal interrupts (sockets, waits)
    _settings, _rank, _agreement = found, world.rank, None


def disable() -> None:
    """Restore the handlers enable() replaced and forget any signal received (a no-op when off)."""
    global _settings, _armed, _agreement
    for sig, previous in _previous.items():
        signal.signal(sig, previous)
    _previous.clear()
    _received.clear()
    _now.clear()
    _settings, _armed, _agreement = None, False, None


def reinstall() -> None:
    """Put hvdp's handlers back on its stop signals, as enable() set them (after a library replaced them:
    Lightning's signal connector composes its own over them while fit runs); a no-op when off."""
    if _settings is None:
        return
    for name in _settings.signals:
        sig = signal.Signals[name]
        signal.signal(sig, _handle)
        signal.siginterrupt(sig, False)


def enabled() -> bool:
    """Whether preemption handling is on in this process."""
    return _settings is not None


def worker_ignores() -> tuple[str, ...]:
    """The signals a rank's data-loading workers ignore while preemption handling is on: the stop signals and
    SIGINT (a scheduler's preemption or `scontrol requeue` signals every process of the job step, workers
    included; a worker killed by it fails the rank's next batch, and no checkpoint is written). The workers
    follow their rank's life and are stopped by it. () when preemption is off."""
    return tuple(dict.fromkeys((*_settings.signals, "SIGINT"))) if _settings is not None else ()


def received() -> str | None:
    """The first stop signal this rank got ("SIGTERM"...), or None."""
    return _received[0] if _received else None


def _handle(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if not _armed:
        previous = _previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process as if hvdp were not there
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return
    if not _received:  # os.write: safe however the main thread was interrupted (print may be mid-write)
        os.write(2, f"hvdp: rank {_rank} got {name}: every rank will stop after the step they agree on, write a "
                    f"checkpoint and exit with {_settings.exit_code} (requeue)\n".encode())
    _received.append(name)


def arm() -> None:
    """From now on a stop signal waits for the loop (a loop that agrees without check(): hvdp.keras's fit)."""
    global _armed
    _armed = _settings is not None


def on_signal_now(callback: Callable[[], None]) -> bool:
    """Run `callback` on a thread of hvdp's as soon as a stop signal reaches this process once armed, even
    while the main thread is inside a compiled step (Python runs a signal's handler only when the main thread
    is between two bytecodes: after a whole steps_per_execution loop of a compiled Keras step). The C-level
    handler writes each signal's number into signal.set_wakeup_fd's pipe; the thread reads it there. A signal
    already received runs `callback` now.

    Returns:
        Whether the thread is in place. False when preemption is off (nothing registered), outside the main
        thread, or when another wakeup fd is set (an asyncio loop's; it is kept): the caller then acts on
        received() between its steps.
    """
    global _wakeup
    if _settings is None:
        return False
    if callback not in _now:
        _now.append(callback)
    if _received:
        callback()
    if _wakeup is None and threading.current_thread() is threading.main_thread():
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)  # someone else's: give it back
            os.close(read)
            os.close(write)
            return False
        _wakeup = (read, write)
        threading.Thread(target=_watch, args=(read,), name="hvdp-preemption", daemon=True).start()
    return _wakeup is not None


def forget_signal_now(callback: Callable[[], None]) -> None:
    """Stop running `callback` on a stop signal (the loop that registered it has ended)."""
    if callback in _now:
        _now.remove(callback)


def _watch(read: int) -> None:
    """hvdp's preemption thread: each stop signal's number from the wakeup pipe runs the on_signal_now callbacks."""
    while True:
        try:
            data = os.read(read, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        names = {signal.Signals(b).name for b in data if b in signal.valid_signals()}
        if _armed and _settings is not None and names & set(_settings.signals):
            for callback in list(_now):
                try:
                    callback()
                except Exception as e:  # noqa: BLE001 - the thread must live on; the loop's own check remains
                    os.write(2, f"hvdp: rank {_rank}: acting on the stop signal at once failed ({e!r}); the "
                                f"ranks stop at the next step boundary instead\n".encode())


def check(make_agreement: Callable[[], policy.Agreement]) -> bool:
    """Whether the ranks stop now: the adapter's preempted(). Every rank calls it at the same points; False
    without a collective when preemption is off. `make_agreement` builds the Agreement with the adapter's sum
    over the ranks, once."""
    global _armed, _agreement
    if _settings is None:
        return False
    _armed = True
    if _agreement is None:
        _agreement = make_agreement()
    return _agreement(bool(_received))


def exit_for_requeue(log: Callable[[str], None]) -> NoReturn:
    """End this rank with the requeue exit code (75 unless HVDP_REQUEUE_EXIT_CODE), after `log` says so."""
    code = _settings.exit_code if _settings is not None else policy.REQUEUE_EXIT_CODE
    why = received() or "a stop signal on another rank"
    log(f"hvdp: preempted ({why}): checkpoint written, exiting with {code} to be requeued")
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
