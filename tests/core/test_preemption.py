"""The preemption policy in-process: the settings, and the agreement simulated over several ranks at once."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.preemption import DEFAULT_SIGNALS, REQUEUE_EXIT_CODE, Agreement, parse_signals, settings


def test_the_defaults_are_off_sigterm_and_sigusr1_and_ex_tempfail():
    found = settings({})
    assert (found.enabled, found.signals, found.exit_code) == (False, ("SIGTERM", "SIGUSR1"), 75)
    assert DEFAULT_SIGNALS == ("SIGTERM", "SIGUSR1") and REQUEUE_EXIT_CODE == 75


@pytest.mark.parametrize("text,names", [
    ("SIGTERM,SIGUSR1", ("SIGTERM", "SIGUSR1")),
    ("term, usr2", ("SIGTERM", "SIGUSR2")),
    (f"{int(signal.SIGUSR1)},SIGUSR1", ("SIGUSR1",)),  # a number, and a repeat kept once
    ("SIGINT", ("SIGINT",)),
])
def test_signal_lists_are_read_as_names(text, names):
    assert parse_signals(text) == names


@pytest.mark.parametrize("text,message", [
    ("SIGKILL", "SIGKILL cannot be caught"),
    ("STOP", "SIGSTOP cannot be caught"),
    ("SIGNOPE", "'SIGNOPE' is not a signal name"),
    (" , ", "names no signal"),
])
def test_bad_signal_lists_say_why(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_signals(text)


@pytest.mark.parametrize("env,message", [
    ({"HVDP_PREEMPTION": "yes"}, "HVDP_PREEMPTION must be 1 .* got 'yes'"),
    ({"HVDP_REQUEUE_EXIT_CODE": "0"}, "HVDP_REQUEUE_EXIT_CODE must be a whole number from 1 to 255 .* got '0'"),
    ({"HVDP_REQUEUE_EXIT_CODE": "256"}, "got '256'"),
    ({"HVDP_REQUEUE_EXIT_CODE": "-3"}, "got '-3'"),
])
def test_bad_settings_name_the_variable_and_value(env, message):
    with pytest.raises(ConfigError, match=message):
        settings(env)


def test_settings_are_read_from_the_environment():
    found = settings({"HVDP_PREEMPTION": "1", "HVDP_PREEMPT_SIGNALS": "USR2", "HVDP_REQUEUE_EXIT_CODE": "99"})
    assert (found.enabled, found.signals, found.exit_code) == (True, ("SIGUSR2",), 99)


class World:
    """Simulated ranks, one thread each, that call their Agreements the same number of times, each sum a real
    collective: wait() returns only when every rank has submitted that sum (what Horovod's allreduce does)."""

    def __init__(self, size: int, every: int = 1, pipelined: bool = True):
        self.size = size
        self.sums: dict[int, list[int]] = {}  # collective index -> flags submitted so far
        self.agreements = [Agreement(self._submit_for(r), self._wait, size, every=every, pipelined=pipelined)
                           for r in range(size)]
        self.counters = [0] * size
        self._changed = threading.Condition()

    def _submit_for(self, rank: int):
        def submit(flag: int):
            with self._changed:
                index = self.counters[rank]
                self.counters[rank] += 1
                self.sums.setdefault(index, []).append(flag)
                self._changed.notify_all()
            return index
        return submit

    def _wait(self, index: int) -> int:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.sums[index]) == self.size, timeout=10), \
                f"sum {index} never completed: a rank did not submit it"
            return sum(self.sums[index])

    def run(self, calls: int, requested) -> list:
        """Every rank calls its Agreement `calls` times, requested(rank, call) saying whether it has a signal;
        the call at which each rank first got True (None: never)."""
        stopped_at = [None] * self.size
        rng = random.Random(calls)

        def rank_loop(rank):
            for call in range(calls):
                if rng.random() < 0.3:
                    time.sleep(0.0005)  # the ranks drift apart within a call
                if self.agreements[rank](requested(rank, call)) and stopped_at[rank] is None:
                    stopped_at[rank] = call

        threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return stopped_at


def expected_stop(first: int, size: int, every: int, pipelined: bool) -> int:
    """The call (0-based) at which the ranks stop when the first signal arrived before call `first`, worked out
    step by step: the checking calls are those numbered every, 2 * every, ... (1-based)."""
    if size == 1:
        return first
    checks = [c for c in range(first, first + 3 * every) if (c + 1) % every == 0]
    return checks[1] if pipelined else checks[0]


@pytest.mark.parametrize("size", [1, 2, 3, 8])
@pytest.mark.parametrize("every,pipelined", [(1, True), (3, True), (1, False), (4, False)])
@pytest.mark.parametrize("seed", range(4))
def test_every_rank_stops_at_the_same_call_soon_after_the_first_signal(size, every, pipelined, seed):
    rng = random.Random(seed * 100 + size)
    world = World(size, every, pipelined)
    calls = 60
    # the call before which each rank got its signal (None: never), at least one rank signalled
    arrival = [rng.choice([None, rng.randrange(calls // 2)]) for _ in range(size)]
    arrival[rng.randrange(size)] = rng.randrange(calls // 2)
    first = min(a for a in arrival if a is not None)
    stopped_at = world.run(calls, lambda rank, call: arrival[rank] is not None and call >= arrival[rank])
    assert len(set(stopped_at)) == 1, f"ranks stopped at different calls: {stopped_at} (signals {arrival})"
    expected = expected_stop(first, size, every, pipelined)
    assert stopped_at[0] == expected, f"stopped at {stopped_at[0]}, first signal before call {first}"
    assert all(a.stopped and a.calls == expected + 1 for a in world.agreements)
    assert len(world.sums) == (0 if size == 1 else (expected + 1) // every - (1 if pipelined else 0))


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_a_bad_check_interval_is_refused(every):
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        Agreement(None, None, 2, every=every)


def test_no_signal_never_stops_and_each_call_is_one_sum():
    world = World(3)
    assert world.run(25, lambda rank, call: False) == [None] * 3
    assert len(world.sums) == 25 and all(sum(v) == 0 for v in world.sums.values())  # the 25th still in flight


def test_after_the_stop_nothing_is_left_in_flight():
    world = World(2)
    stopped = world.run(10, lambda rank, call: call >= 3)
    submitted, read = len(world.sums), world.agreements[0].calls - 1
    assert stopped == [4, 4] and submitted == read, f"{submitted} sums submitted, {read} read: one left in flight"
    assert world.agreements[0](False) and len(world.sums) == submitted  # stays stopped, submits nothing
