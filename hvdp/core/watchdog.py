"""hvdp's watchdog: turns a hung or vanished rank into a clear error on every surviving rank, instead of a
job that waits forever inside a collective (under MPI, Horovod's stall inspector never reports a stopped
rank: its coordinator is itself blocked in MPI).

Each rank runs one daemon thread that sends a small UDP heartbeat (rank, step, phase) to every peer once
per `interval` seconds and listens for theirs. The thread does not need the GIL for long nor any
collective, so it keeps running while the main thread is blocked in MPI or Gloo. Two cases, two limits:

- a peer silent for `timeout` seconds (default 60: stopped, frozen, its host or network gone) ends the job;
- every rank blocked in a collective that another rank has not submitted (rank 0 in broadcast_object while
  rank 1 is in prepare()'s broadcast): no amount of waiting resolves that, so it ends the job as soon as every
  rank's heartbeats have said so for MISMATCH_CONFIRM seconds (3, or `timeout` when shorter), naming each
  rank's pending collective and which ranks had not entered it;
- this rank waiting in a collective (the gradient all-reduce, or any other: allgather_object, broadcast,
  barrier, evaluate) while a live peer is elsewhere, outside any collective (rank 0 evaluating, writing a
  large checkpoint to a slow filesystem, logging, or a rank stuck in its DataLoader) is normal for a while:
  after min(`timeout`, `elsewhere_timeout` / 2) the watchdog warns once, naming where each rank is; only
  after `elsewhere_timeout` seconds (default 1800, like the NCCL watchdogs' 10-30 minutes) does it end the job.

Ending the job means printing which rank, at which step and in which phase, and exiting this process with
code 70 so that the launcher tears the job down.

Every heartbeat is authenticated: an 8-byte job tag and a 32-byte HMAC-SHA256 tag, both keyed with a secret
the job agreed on at init (through Horovod, not over UDP), followed by the JSON body, which carries a
per-sender sequence number so that a recorded packet cannot be replayed. A packet that is malformed,
unsigned, signed with another job's secret, replayed or inconsistent is ignored and counted
(`Watchdog.rejected`); no packet can stop the watching of a rank or end the thread.

Floods, by design: a datagram whose first 8 bytes are not the job's tag never reaches the process: a
classic BPF filter on the socket (SO_ATTACH_FILTER, Linux) drops it in the kernel, so strangers' datagrams
neither wake the thread nor take room in the socket's receive buffer (RECEIVE_BUFFER bytes asked for), where
only the job's heartbeats queue. Where no filter can be attached, the thread does the same check itself.
It drains the socket in batches (up to BATCH datagrams per wake-up) and drops a datagram whose source is not
an address of one of the job's hosts, or without the job's tag, before any cryptography or parsing
(`Watchdog.dropped`).

A pause is not silence: when the whole process was stopped (SIGSTOP, Slurm's `scontrol suspend`, gang
scheduling, a VM paused, Ctrl-Z), its own loop's clock jumps by far more than one heartbeat interval. The
watchdog then gives every peer a fresh `timeout` window (their heartbeats could not be read while this
process was stopped) and leaves the pause out of every duration it measures. A peer stopped alone still
goes silent for the others, whose clocks did not jump, and is named within `timeout`.

Where a rank is comes from two sources: `progress(step, phase)` and `enter(phase)` from the adapters (the
optimizer step, a rank's DataLoader, evaluate), and a `Collectives` registry that the adapters keep by
wrapping Horovod's submit and wait functions: the names of the collectives this rank submitted and has not
finished waiting for, and the one its main thread waits on now. Each heartbeat carries the collective this
rank waits on and, while it waits, which of its peers' pending collectives it never submitted ("lacks").

Framework-free (stdlib only); init() starts it for jobs of 2+ ranks (not in elastic mode, not with
HVDP_WATCHDOG=0).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import select
import socket
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from hvdp.core.errors import ConfigError
from hvdp.core.stragglers import RING, Call, describe_not_entered, not_entered
from hvdp.core.heartbeats import (JOB_TAG_SIZE, MAX_PACKET, TAG_SIZE, drop_strangers, heartbeat_targets,
                                   job_tag, plain_address, seal)

EXIT_CODE = 70
DEFAULT_TIMEOUT = 60.0
DEFAULT_ELSEWHERE_TIMEOUT = 1800.0
WAITING = "waiting for the gradient all-reduce"
STARTING = "starting"
COMPUTING = "computing its forward/backward pass"
EXITED = "exited"
BATCH = 256  # datagrams read per wake-up before the thread looks at the clock again
PAUSE_SLACK = 2.0  # seconds by which the loop may overrun its interval before it counts as a pause
MAX_NAME = 200  # characters of a collective's name a heartbeat carries
MAX_LACKS = 8   # names of peers' collectives a heartbeat says this rank lacks
STALE_BEATS = 3  # heartbeat intervals after which a peer's last heartbeat no longer says where it is
MISMATCH_CONFIRM = 3.0  # seconds every rank must be seen blocked in collectives the others lack (or `timeout`)


@dataclass(slots=True)
class PeerState:
    step: int = -1
    phase: str = STARTING
    heard: float = field(default_factory=time.monotonic)
    seq: int = 0  # the last sequence number taken; a sender's first is 1, so no packet numbered 0 is ever new
    since: float = field(default_factory=time.monotonic)  # when it entered its phase (this host's clock)
    op: str | None = None   # the collective it waits on, or None
    op_since: float = 0.0   # since when (this host's clock)
    lacks: tuple = ()       # names of other ranks' pending collectives it has not submitted, while it waits


class Collectives:
    """This rank's Horovod collectives in flight, as an adapter reports them: each submitted one's name by its
    key (a Horovod handle) until its wait ends, and the one the main thread waits on now, since when; and a
    ring of the last RING collectives (sequence number, name, bytes, start, end, error) for the record
    written when the job ends or a collective raises (hvdp.core.stragglers.format_calls).

    Written by the thread that calls Horovod, read by the watchdog's thread: every update is one assignment
    or one dict operation, and the reader copies.
    """

    def __init__(self):
        self._pending: dict = {}
        self._wait: tuple = (None, 0.0, None)  # (name, since, key), replaced whole
        self._seq = 0
        self._ring: deque = deque(maxlen=RING)  # [seq, name, size, start, end, error] lists, oldest first
        self._open: dict = {}  # key -> its ring entry, until finished

    def submitted(self, key, name: str, size: int | None = None) -> None:
        """Collective `name` (`size` bytes, when known) was submitted; `key` (its handle) identifies it until
        finished(key)."""
        self._pending[key] = name[:MAX_NAME]
        self._seq += 1
        entry = [self._seq, name[:MAX_NAME], size, time.monotonic(), None, None]
        self._ring.append(entry)
        self._open[key] = entry

    def wait(self, key) -> None:
        """The main thread starts waiting for the collective submitted under `key` (unknown keys: no-op)."""
        name = self._pending.get(key)
        if name is not None:
            self._wait = (name, time.monotonic(), key)

    def finished(self, key, error: str | None = None) -> None:
        """The wait for `key` ended (done, or failed with `error`): it is no longer pending."""
        self._pending.pop(key, None)
        entry = self._open.pop(key, None)
        if entry is not None:
            entry[4], entry[5] = time.monotonic(), error
        if self._wait[2] is key or self._wait[2] == key:
            self._wait = (None, 0.0, None)

    def recent(self) -> list[Call]:
        """The ring: this rank's last collectives, oldest first."""
        for _ in range(10):
            try:
                return [Call(*entry) for entry in list(self._ring)]
            except RuntimeError:  # mutated while copied (another thread): try again
                continue
        return []

    @contextmanager
    def blocking(self, name: str) -> Iterator[None]:
        """A collective that submits and waits in one call (TensorFlow's eager ops): pending while inside.

        Args:
            name: the collective's name, as Horovod knows it.
        """
        key = object()
        self.submitted(key, name)
        self.wait(key)
        try:
            yield
        except BaseException as e:
            self.finished(key, f"{type(e).__name__}: {str(e)[:200]}")
            raise
        else:
            self.finished(key)

    def waiting(self) -> tuple[str | None, float]:
        """(name, since) of the collective the main thread waits on, or (None, 0.0)."""
        name, since, _ = self._wait
        return name, since

    def names(self) -> set[str]:
        """The names of every collective submitted and not finished."""
        for _ in range(10):
            try:
                return set(self._pending.values())
            except RuntimeError:  # changed size while copied (another thread): try again
                continue
        return set()


def settings(environ=None) -> tuple[bool, float, float]:
    """(enabled, timeout, elsewhere_timeout) from HVDP_WATCHDOG, HVDP_WATCHDOG_TIMEOUT and
    HVDP_WATCHDOG_ELSEWHERE_TIMEOUT.

    Args:
        environ: the variables to read; default None means os.environ. HVDP_WATCHDOG "0", "false" or "off"
            disables the watchdog (anything else, or unset, enables it); HVDP_WATCHDOG_TIMEOUT is the
            seconds a peer may be silent (default DEFAULT_TIMEOUT, 60); HVDP_WATCHDOG_ELSEWHERE_TIMEOUT the
            seconds this rank may wait in the all-reduce while a live peer is elsewhere (default
            DEFAULT_ELSEWHERE_TIMEOUT, 1800).

    Raises:
        ConfigError: either timeout is not a number, or is <= 0, inf or nan.
    """
    env = os.environ if environ is None else environ
    enabled = env.get("HVDP_WATCHDOG", "1") not in ("0", "false", "off")
    return (enabled, _seconds(env, "HVDP_WATCHDOG_TIMEOUT", DEFAULT_TIMEOUT),
            _seconds(env, "HVDP_WATCHDOG_ELSEWHERE_TIMEOUT", DEFAULT_ELSEWHERE_TIMEOUT))


def _seconds(env, name: str, default: float) -> float:
    try:
        value = float(env.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {env[name]!r}")
    if not 0 < value < math.inf:  # also refuses nan, which compares false to everything
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value}")
    return value


class Watchdog:
    """One rank's heartbeat thread; created stopped, start() starts it.

    Args:
        rank: this rank.
        peers: `peers[r]` lists the (address, port) pairs to reach rank r; len(peers) is the world size,
            and this rank's own entry is not used.
        sock: the bound UDP socket (open_socket) whose port the peers were given; the watchdog closes it
            in stop().
        secret: the job's heartbeat key (bytes, at least 16; every rank the same): every packet sent is
            signed with it, and a packet not signed with it is ignored and counted in `rejected`.
        timeout: seconds of silence from a peer before the job is ended (default DEFAULT_TIMEOUT, 60); also
            how long every rank may be blocked in collectives that another rank never submitted.
        elsewhere_timeout: seconds this rank may wait in a collective while a live peer is elsewhere
            before the job is ended (default DEFAULT_ELSEWHERE_TIMEOUT, 1800); a warning comes first, after
            min(timeout, elsewhere_timeout / 2).
        interval: seconds between heartbeats (default: 1, or timeout / 5 when that is shorter).
        on_hang: called once with the message when diagnose() finds a problem; the default prints it to
            stderr and ends the process with EXIT_CODE (70). The thread stops after calling it.
        on_warning: called with the message when warning() finds a peer elsewhere, once per wait; the
            default prints it to stderr.
        collectives: this rank's Collectives registry, kept by the adapter (default None: none is known,
            and only a WAITING phase marks a wait in a collective).
        sources: the addresses the job's heartbeats may come from (every address of every host of the job);
            a datagram from any other is dropped unread. Default None: the peers' addresses.
        on_pause: called with the message when this process finds it was paused (default: printed to stderr
            by rank 0 only).

    Raises:
        ValueError: `secret` is not bytes of at least 16 (a programming error: init() makes it).
    """

    def __init__(self, rank: int, peers: list[list[tuple[str, int]]], sock: socket.socket, *,
                 secret: bytes, timeout: float = DEFAULT_TIMEOUT,
                 elsewhere_timeout: float = DEFAULT_ELSEWHERE_TIMEOUT, interval: float | None = None,
                 on_hang: Callable[[str], None] | None = None, on_warning: Callable[[str], None] | None = None,
                 collectives: Collectives | None = None, sources: set[str] | None = None,
                 on_pause: Callable[[str], None] | None = None):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("Watchdog needs the job's heartbeat secret as bytes (at least 16)")
        self.rank, self.peers, self.sock, self.timeout = rank, peers, sock, timeout
        self.elsewhere_timeout = elsewhere_timeout
        self.collectives = collectives if collectives is not None else Collectives()
        self._warned = None  # the wait (its start time) already warned about
        self._secret = secret
        self._job = job_tag(secret)
        self._seq = 0
        self.rejected = 0  # packets ignored: malformed, unauthenticated, foreign or replayed
        self.dropped = 0  # datagrams dropped unread: from an address outside the job, or without the job's tag
        self.interval = interval if interval is not None else min(1.0, timeout / 5)
        # every rank blocked in a collective another never submitted: certain once their heartbeats say so
        self.mismatch_limit = min(timeout, max(MISMATCH_CONFIRM, 3 * self.interval))
        self.on_hang = on_hang or _abort
        self.on_warning = on_warning or _warn
        self.on_pause = on_pause or (_warn if rank == 0 else (lambda message: None))
        self.kernel_filter = sys.platform.startswith("linux") and drop_strangers(sock, self._job)
        self._targets = heartbeat_targets(peers, rank, sock.family)
        self._sources = {plain_address(a) for a in (sources if sources is not None else
                                                    [a for addresses in peers for a, _ in addresses])}
        self.pauses: list[tuple[float, float]] = []  # (start, end) of each pause of this process, newest last
        self._tick = time.monotonic()  # when the loop last looked at the clock
        self.step, self.phase, self.since = 0, STARTING, time.monotonic()
        self.state = {r: PeerState() for r in range(len(peers)) if r != rank}
        self.exited: set[int] = set()  # peers that left on purpose
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdp-watchdog", daemon=True)
        self.sock.setblocking(True)  # the loop waits in poll() and reads with MSG_DONTWAIT

    def start(self) -> "Watchdog":
        """Start the daemon thread (once) and return this watchdog."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Tell the peers this rank is leaving on purpose (so they stop watching it), then stop."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.phase = EXITED
        self._send()
        self.sock.close()

    def progress(self, step: int, phase: str) -> None:
        """Called by the training loop's hooks: where this rank is now; sent with the next heartbeat.

        Args:
            step: the optimizer step this rank is at.
            phase: what it is doing, for the messages; WAITING marks a wait in the gradient all-reduce.
        """
        self.step, self.phase, self.since = step, phase, time.monotonic()

    def enter(self, phase: str) -> str:
        """This rank starts doing `phase` (reading its DataLoader, evaluating) at the same step; returns the
        phase it leaves, for leave().

        Args:
            phase: what it is doing now, for the messages ("in its DataLoader, waiting for a batch").
        """
        before = self.phase
        self.phase, self.since = phase, time.monotonic()
        return before

    def leave(self, before: str) -> None:
        """This rank is done with the phase entered, and back to `before` (what enter() returned)."""
        self.phase, self.since = before, time.monotonic()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        last_sent = -math.inf
        self._tick = time.monotonic()
        while not self._stop.is_set():
            now = self._now()
            if now - last_sent >= self.interval:
                self._send()
                last_sent = now
            try:
                ready = poller.poll(max(0.0, last_sent + self.interval - now) * 1000)
            except (OSError, ValueError):  # the socket closed under us: stop() is under way
                ready = []
            if ready:
                self._drain()
            now = self._now()
            problem = self.diagnose(now)
            if problem:
                self.on_hang(problem)
                return
            blocked = self._blocked()
            if blocked is not None and self._warned != blocked[1]:
                warning = self.warning(now)
                if warning:
                    self._warned = blocked[1]
                    self.on_warning(warning)

    def _drain(self) -> None:
        """Read up to BATCH waiting datagrams; apply the job's, drop and count the rest."""
        for _ in range(BATCH):
            try:
                data, source = self.sock.recvfrom(MAX_PACKET, socket.MSG_DONTWAIT)
            except OSError:  # nothing more waiting (BlockingIOError), or the socket is closing
                return
            if data[:JOB_TAG_SIZE] != self._job or plain_address(source[0]) not in self._sources:
                self.dropped += 1  # a stranger's: no cryptography, no parsing
                continue
            try:
                accepted = self._accept(data)
            except Exception:  # untrusted input never ends the thread
                accepted = False
            if not accepted:
                self.rejected += 1

    def _now(self) -> float:
        """time.monotonic(), after noting a pause of this process: a jump of the clock since the loop last
        looked at it by more than its interval plus PAUSE_SLACK. After one, every peer has a fresh window."""
        now = time.monotonic()
        last, self._tick = self._tick, now
        if now - last > self.interval + PAUSE_SLACK:
            self.pauses = self.pauses[-31:] + [(last, now)]
            for peer in self.state.values():
                peer.heard = max(peer.heard, now)
            self.on_pause(f"hvdp watchdog: rank {self.rank}'s process was paused for {now - last:.0f} s (stopped "
                          f"with SIGSTOP or Ctrl-Z, a suspended job, a paused VM; or its watchdog thread could not "
                          f"run): every peer gets a fresh {self.timeout:g} s to be heard from, and the pause counts "
                          f"in no limit.")
        return now

    def elapsed(self, since: float, now: float) -> float:
        """Seconds from `since` to `now`, less the time this process was paused in between."""
        paused = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.pauses)
        return max(0.0, now - since - paused)

    def _sign(self, body: bytes) -> bytes:
        """The TAG_SIZE-byte tag a heartbeat carries: HMAC-SHA256 of its body under the job's secret."""
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def _accept(self, data: bytes) -> bool:
        """Apply one received packet; False (and no effect) unless it is a valid, fresh heartbeat of this job."""
        if len(data) <= JOB_TAG_SIZE + TAG_SIZE or data[:JOB_TAG_SIZE] != self._job:
            return False
        tag, body = data[JOB_TAG_SIZE:JOB_TAG_SIZE + TAG_SIZE], data[JOB_TAG_SIZE + TAG_SIZE:]
        if not hmac.compare_digest(tag, self._sign(body)):
            return False
        msg = json.loads(body)
        if not isinstance(msg, dict):
            return False
        rank, step, phase, seq = msg.get("rank"), msg.get("step"), msg.get("phase"), msg.get("seq")
        if not all(type(v) is int for v in (rank, step, seq)) or not isinstance(phase, str):
            return False
        elapsed, op, waited, lacks = msg.get("for", 0.0), msg.get("op"), msg.get("waited", 0.0), msg.get("lacks", [])
        if (not all(type(v) in (int, float) and 0 <= v < math.inf for v in (elapsed, waited))
                or not (op is None or isinstance(op, str)) or not isinstance(lacks, list)
                or not all(isinstance(n, str) for n in lacks)):
            return False
        peer = self.state.get(rank)
        if peer is None:
            return rank != self.rank and 0 <= rank < len(self.peers)  # a rank that already left: harmless
        if seq <= peer.seq:
            return False  # replayed or reordered
        if phase == EXITED:
            del self.state[rank]  # left on purpose: nothing to watch, unless this rank waits for it
            self.exited.add(rank)
        else:
            now = time.monotonic()
            peer.step, peer.phase, peer.heard, peer.seq = step, phase, now, seq
            peer.since, peer.op, peer.op_since, peer.lacks = now - elapsed, op, now - waited, tuple(lacks)
        return True

    def _send(self) -> None:
        self._seq += 1
        now = time.monotonic()
        op, since = self.collectives.waiting()
        body = json.dumps({"rank": self.rank, "step": self.step, "phase": self.phase, "seq": self._seq,
                           "for": round(self.elapsed(self.since, now), 3), "op": op,
                           "waited": round(self.elapsed(since, now), 3) if op is not None else 0.0,
                           "lacks": self._lacks(op)}).encode()
        msg = seal(self._secret, body, self._job)
        for target in self._targets:
            try:
                self.sock.sendto(msg, target)
            except OSError:
                pass

    def _lacks(self, op: str | None) -> list[str]:
        """While this rank waits in a collective: the collectives its peers wait on that it never submitted
        (so they can only finish when this rank submits them, which a blocked rank does not)."""
        if op is None:
            return []
        mine = self.collectives.names()
        theirs = sorted({p.op for p in self.state.values() if p.op is not None} - mine)
        return theirs[:MAX_LACKS]

    def _blocked(self) -> tuple[str | None, float] | None:
        """(the collective, since when) this rank is blocked in; (None, since) in the gradient all-reduce
        when no collective is known; None outside any collective."""
        op, since = self.collectives.waiting()
        if op is not None:
            return op, since
        if self.phase == WAITING:
            return None, self.since
        return None

    def diagnose(self, now: float) -> str | None:
        """The message to die with, or None while the job is healthy. A pure function of the state.

        Args:
            now: the current time.monotonic().

        Returns:
            A message naming the peers silent for longer than `timeout`; or, when this rank has waited in a
            collective for longer than `timeout` after a peer exited, that peer; or, when every rank has been
            blocked for longer than `timeout` in a collective that some other rank never submitted, each rank
            and the collective it waits on; or, when this rank has waited in a collective for longer than
            `elsewhere_timeout` while a live peer is elsewhere, where each rank is; None otherwise.
        """
        silent = sorted(r for r, p in self.state.items() if now - p.heard > self.timeout)
        if silent:
            who = "; ".join(f"rank {r} (last heard {now - self.state[r].heard:.0f} s ago at step "
                            f"{self.state[r].step}, {self.state[r].phase})" for r in silent)
            return (f"hvdp watchdog: {who} stopped responding: the process is stopped, frozen, or its host or "
                    f"network is gone. {self._me(now)}. Ending the job instead of waiting forever (timeout "
                    f"{self.timeout:g} s; HVDP_WATCHDOG_TIMEOUT changes it, HVDP_WATCHDOG=0 disables it).")
        blocked = self._blocked()
        if blocked is not None and self.exited and self.elapsed(blocked[1], now) > self.timeout:
            return (f"hvdp watchdog: {self._me(now)}, but {_ranks(sorted(self.exited))} exited (finished, or "
                    f"returned early) without it, so it can never complete: a rank-dependent code path (a "
                    f"collective called on some ranks only, or a rank that leaves its loop early). Ending the job "
                    f"(limit {self.timeout:g} s; HVDP_WATCHDOG_TIMEOUT changes it).")
        deadlock = self._deadlock(now)
        if deadlock:
            return (f"hvdp watchdog: every rank is blocked in a collective that another rank never submitted, "
                    f"which no waiting resolves: {deadlock}. {_sentence(self.not_entered())} The ranks called "
                    f"different collectives, or the same ones in another order (a rank-dependent code path): every "
                    f"rank must call the same collectives in the same order. Ending the job (after "
                    f"{self.mismatch_limit:g} s of every rank blocked so, confirmed by their heartbeats; "
                    f"HVDP_WATCHDOG_TIMEOUT bounds it).")
        elsewhere = self._elsewhere(now, self.elsewhere_timeout)
        if elsewhere:
            return (f"hvdp watchdog: {self._me(now)}, but {elsewhere}: it never reached this collective (a "
                    f"rank-dependent code path, or a rank stuck in its own code: its data loading, I/O, a lock). "
                    f"Ending the job (limit "
                    f"{self.elsewhere_timeout:g} s for a live peer elsewhere; HVDP_WATCHDOG_ELSEWHERE_TIMEOUT "
                    f"changes it).")
        return None

    def warning(self, now: float) -> str | None:
        """The warning for a long wait on a live peer that is elsewhere, or None. A pure function of the state.

        Args:
            now: the current time.monotonic().

        Returns:
            When this rank has waited in a collective longer than min(timeout, elsewhere_timeout / 2) while
            live peers are elsewhere: a message naming where each rank is and when the job will be ended;
            else None.
        """
        elsewhere = self._elsewhere(now, min(self.timeout, self.elsewhere_timeout / 2))
        if not elsewhere or self._elsewhere(now, 0.0, outside_only=True) == "":
            return None  # the peers elsewhere are all blocked in other collectives: diagnose() decides
        return (f"hvdp watchdog (warning): {self._me(now)}; {elsewhere}. A peer evaluating, saving a "
                f"checkpoint or logging is normal; if it has not joined after {self.elsewhere_timeout:g} s in all, "
                f"the job is ended (HVDP_WATCHDOG_ELSEWHERE_TIMEOUT changes that limit).")

    def _deadlock(self, now: float) -> str:
        """Each rank and its collective, when every rank has been blocked longer than `mismatch_limit` in a
        collective that another rank lacks (reported by that rank while it waits); "" otherwise."""
        op, since = self.collectives.waiting()
        if op is None or self.elapsed(since, now) <= self.mismatch_limit or len(self.state) != len(self.peers) - 1:
            return ""
        if any(not self._fresh(p, now) for p in self.state.values()):
            return ""  # a peer's state is old news: the silent-peer limit decides
        ranks = {self.rank: (op, since, tuple(self._lacks(op)))}
        ranks.update((r, (p.op, p.op_since, p.lacks)) for r, p in self.state.items())
        if any(o is None or self.elapsed(s, now) <= self.mismatch_limit for o, s, _ in ranks.values()):
            return ""
        missing = {}
        for r, (o, _, _) in ranks.items():
            missing[r] = sorted(q for q, (_, _, lacks) in ranks.items() if q != r and o in lacks)
            if not missing[r]:
                return ""  # every other rank has submitted it: it can still complete
        return "; ".join(f"rank {r} waits for {o} ({self.elapsed(s, now):.0f} s), which {_ranks(missing[r])} never submitted"
                         for r, (o, s, _) in sorted(ranks.items()))

    def _fresh(self, peer: PeerState, now: float) -> bool:
        """Whether `peer`'s last heartbeat still says where it is (heard within STALE_BEATS intervals)."""
        return now - peer.heard <= self.interval * STALE_BEATS

    def not_entered(self, now: float | None = None) -> str:
        """Which ranks had not entered the collective the others were in, by name, from this rank's own state
        and its peers' last heartbeats ("" when every rank in a collective has the others' submitted). A peer
        not heard from for longer than STALE_BEATS heartbeat intervals is left out of that (its last heartbeat
        says where it was, not where it is: a host whose network is gone) and named as not heard from.

        Args:
            now: the current time.monotonic(); default None reads the clock.
        """
        now = time.monotonic() if now is None else now
        fresh = {r: p for r, p in self.state.items() if self._fresh(p, now)}
        op, _ = self.collectives.waiting()
        current = {self.rank: op, **{r: p.op for r, p in fresh.items()}}
        lacks = {self.rank: set(self._lacks(op)) if op is not None else
                 {p.op for p in fresh.values() if p.op is not None} - self.collectives.names(),
                 **{r: set(p.lacks) for r, p in fresh.items()}}
        unheard = "; ".join(f"rank {r} not heard from for {now - p.heard:.0f} s (its host or network may be gone)"
                            for r, p in sorted(self.state.items()) if r not in fresh)
        return "; ".join(filter(None, [describe_not_entered(not_entered(current, lacks), current), unheard]))

    def _elsewhere(self, now: float, limit: float, outside_only: bool = False) -> str:
        """Where the live peers that are not in this rank's collective are, when this rank has been blocked
        in a collective longer than `limit`: outside any collective, or in another one that lacks this
        rank's (with `outside_only`, the former only)."""
        blocked = self._blocked()
        if blocked is None or self.elapsed(blocked[1], now) <= limit:
            return ""
        op = blocked[0]

        def with_me(p: PeerState) -> bool:
            if p.op is not None:
                return p.op == op or op is None or op not in p.lacks
            return p.phase == WAITING and p.step == self.step and op is None

        return "; ".join(f"rank {r} is alive at step {p.step}, {_doing(p.phase, p.op)}, for "
                         f"{self.elapsed(p.op_since if p.op is not None else p.since, now):.0f} s"
                         for r, p in sorted(self.state.items())
                         if not with_me(p) and not (outside_only and p.op is not None))

    def _me(self, now: float) -> str:
        op, since = self.collectives.waiting()
        seconds = self.elapsed(since if op is not None else self.since, now)
        me = f"rank {self.rank} is at step {self.step}, {_doing(self.phase, op)} for {seconds:.0f} s"
        if self.rejected:
            me += (f" ({self.rejected} heartbeat packet(s) were ignored as malformed, unauthenticated or from "
                   f"another job)")
        if self.dropped:
            me += (f" ({self.dropped} datagram(s) from addresses outside the job, or without its tag, were "
                   f"dropped unread)")
        return me


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _doing(phase: str, op: str | None) -> str:
    """What a rank is doing, for the messages: its phase, and the collective it waits on."""
    if op is None:
        return phase
    if phase == WAITING:
        return f"{WAITING} ({op})"
    if phase in (STARTING, COMPUTING):
        return f"in the collective {op}"
    return f"{phase}, in the collective {op}"


def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def _abort(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["EXIT_CODE", "DEFAULT_TIMEOUT", "DEFAULT_ELSEWHERE_TIMEOUT", "WAITING", "STARTING", "COMPUTING", "EXITED",
           "settings", "Collectives", "Watchdog"]
