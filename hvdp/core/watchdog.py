"""hvdp's watchdog: turns a hung or vanished rank into a clear error on every surviving rank, instead of a
job that waits forever inside a collective (under MPI, Horovod's stall inspector never reports a stopped
rank: its coordinator is itself blocked in MPI).

Each rank runs one daemon thread that sends a small UDP heartbeat (rank, step, phase) to every peer once
per `interval` seconds and listens for theirs. The thread does not need the GIL for long nor any
collective, so it keeps running while the main thread is blocked in MPI or Gloo. Two cases, two limits:

- a peer silent for `timeout` seconds (default 60: stopped, frozen, its host or network gone) ends the job;
- this rank waiting in the gradient all-reduce while a live peer is elsewhere (rank 0 evaluating, writing a
  large checkpoint to a slow filesystem, logging) is normal for a while: after min(`timeout`,
  `elsewhere_timeout` / 2) the watchdog warns once, naming the peer, its step and phase; only after
  `elsewhere_timeout` seconds (default 1800, like the NCCL watchdogs' 10-30 minutes) does it end the job.

Ending the job means printing which rank, at which step and in which phase, and exiting this process with
code 70 so that the launcher tears the job down.

Every heartbeat is authenticated: a 32-byte HMAC-SHA256 tag, keyed with a secret the job agreed on at init
(through Horovod, not over UDP), followed by the JSON body, which carries a per-sender sequence number so
that a recorded packet cannot be replayed. A packet that is malformed, unsigned, signed with another job's
secret, replayed or inconsistent is ignored and counted (`Watchdog.rejected`); no packet can stop the
watching of a rank or end the thread.

Framework-free (stdlib only); init() starts it for jobs of 2+ ranks (not in elastic mode, not with
HVDP_WATCHDOG=0). The PyTorch adapter reports progress around each optimizer step with
`progress(step, phase)`; the TensorFlow and Keras adapters report none, so there only silent peers are
caught.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hvdp.core.errors import ConfigError

EXIT_CODE = 70
DEFAULT_TIMEOUT = 60.0
DEFAULT_ELSEWHERE_TIMEOUT = 1800.0
WAITING = "waiting for the gradient all-reduce"
EXITED = "exited"
TAG_SIZE = 32  # HMAC-SHA256 digest
MAX_PACKET = 4096


@dataclass(slots=True)
class PeerState:
    step: int = -1
    phase: str = "starting"
    heard: float = field(default_factory=time.monotonic)
    seq: int = 0  # the last sequence number taken; a sender's first is 1, so no packet numbered 0 is ever new


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


def open_socket(bind: str = "0.0.0.0") -> socket.socket:
    """A UDP socket bound to address `bind` (default all interfaces) on a free port, for a Watchdog.

    Raises:
        OSError: `bind` is not an address of this host.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((bind, 0))
    return sock


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
        timeout: seconds of silence from a peer before the job is ended (default DEFAULT_TIMEOUT, 60).
        elsewhere_timeout: seconds this rank may wait in the gradient all-reduce while a live peer is
            elsewhere before the job is ended (default DEFAULT_ELSEWHERE_TIMEOUT, 1800); a warning comes
            first, after min(timeout, elsewhere_timeout / 2).
        interval: seconds between heartbeats (default: 1, or timeout / 5 when that is shorter).
        on_hang: called once with the message when diagnose() finds a problem; the default prints it to
            stderr and ends the process with EXIT_CODE (70). The thread stops after calling it.
        on_warning: called with the message when warning() finds a peer elsewhere, once per wait; the
            default prints it to stderr.

    Raises:
        ValueError: `secret` is not bytes of at least 16 (a programming error: init() makes it).
    """

    def __init__(self, rank: int, peers: list[list[tuple[str, int]]], sock: socket.socket, *,
                 secret: bytes, timeout: float = DEFAULT_TIMEOUT,
                 elsewhere_timeout: float = DEFAULT_ELSEWHERE_TIMEOUT, interval: float | None = None,
                 on_hang: Callable[[str], None] | None = None, on_warning: Callable[[str], None] | None = None):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("Watchdog needs the job's heartbeat secret as bytes (at least 16)")
        self.rank, self.peers, self.sock, self.timeout = rank, peers, sock, timeout
        self.elsewhere_timeout = elsewhere_timeout
        self._warned = None  # the wait (its start time) already warned about
        self._secret = secret
        self._seq = 0
        self.rejected = 0  # packets ignored: malformed, unauthenticated, foreign or replayed
        self.interval = interval if interval is not None else min(1.0, timeout / 5)
        self.on_hang = on_hang or _abort
        self.on_warning = on_warning or _warn
        self.step, self.phase, self.since = 0, "starting", time.monotonic()
        self.state = {r: PeerState() for r in range(len(peers)) if r != rank}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdp-watchdog", daemon=True)
        self.sock.settimeout(self.interval)

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

    def _run(self) -> None:
        last_sent = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_sent >= self.interval:
                self._send()
                last_sent = now
            try:
                data, _ = self.sock.recvfrom(MAX_PACKET)
            except (socket.timeout, OSError):
                data = None
            if data is not None:
                try:
                    accepted = self._accept(data)
                except Exception:  # untrusted input never ends the thread
                    accepted = False
                if not accepted:
                    self.rejected += 1
            now = time.monotonic()
            problem = self.diagnose(now)
            if problem:
                self.on_hang(problem)
                return
            if self._warned != self.since:
                warning = self.warning(now)
                if warning:
                    self._warned = self.since
                    self.on_warning(warning)

    def _sign(self, body: bytes) -> bytes:
        """The TAG_SIZE-byte tag a heartbeat carries: HMAC-SHA256 of its body under the job's secret."""
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def _accept(self, data: bytes) -> bool:
        """Apply one received packet; False (and no effect) unless it is a valid, fresh heartbeat of this job."""
        if len(data) <= TAG_SIZE:
            return False
        tag, body = data[:TAG_SIZE], data[TAG_SIZE:]
        if not hmac.compare_digest(tag, self._sign(body)):
            return False
        msg = json.loads(body)
        if not isinstance(msg, dict):
            return False
        rank, step, phase, seq = msg.get("rank"), msg.get("step"), msg.get("phase"), msg.get("seq")
        if not all(type(v) is int for v in (rank, step, seq)) or not isinstance(phase, str):
            return False
        peer = self.state.get(rank)
        if peer is None:
            return rank != self.rank and 0 <= rank < len(self.peers)  # a rank that already left: harmless
        if seq <= peer.seq:
            return False  # replayed or reordered
        if phase == EXITED:
            del self.state[rank]  # left on purpose: nothing to watch
        else:
            peer.step, peer.phase, peer.heard, peer.seq = step, phase, time.monotonic(), seq
        return True

    def _send(self) -> None:
        self._seq += 1
        body = json.dumps({"rank": self.rank, "step": self.step, "phase": self.phase, "seq": self._seq}).encode()
        msg = self._sign(body) + body
        for r, addresses in enumerate(self.peers):
            if r != self.rank:
                for address in addresses:
                    try:
                        self.sock.sendto(msg, tuple(address))
                    except OSError:
                        pass

    def diagnose(self, now: float) -> str | None:
        """The message to die with, or None while the job is healthy. A pure function of the state.

        Args:
            now: the current time.monotonic().

        Returns:
            A message naming the peers silent for longer than `timeout`, or (when this rank has been WAITING
            longer than `elsewhere_timeout`) the live peers at another step or phase; None otherwise.
        """
        silent = sorted(r for r, p in self.state.items() if now - p.heard > self.timeout)
        if silent:
            who = "; ".join(f"rank {r} (last heard {now - self.state[r].heard:.0f} s ago at step "
                            f"{self.state[r].step}, {self.state[r].phase})" for r in silent)
            return (f"hvdp watchdog: {who} stopped responding: the process is stopped, frozen, or its host or "
                    f"network is gone. {self._me(now)}. Ending the job instead of waiting forever (timeout "
                    f"{self.timeout:g} s; HVDP_WATCHDOG_TIMEOUT changes it, HVDP_WATCHDOG=0 disables it).")
        elsewhere = self._elsewhere(now, self.elsewhere_timeout)
        if elsewhere:
            return (f"hvdp watchdog: {self._me(now)}, but {elsewhere}: it never reached this collective (a "
                    f"rank-dependent code path, or a rank stuck in its own code). Ending the job (limit "
                    f"{self.elsewhere_timeout:g} s for a live peer elsewhere; HVDP_WATCHDOG_ELSEWHERE_TIMEOUT "
                    f"changes it).")
        return None

    def warning(self, now: float) -> str | None:
        """The warning for a long wait on a live peer that is elsewhere, or None. A pure function of the state.

        Args:
            now: the current time.monotonic().

        Returns:
            When this rank has been WAITING longer than min(timeout, elsewhere_timeout / 2) while live peers
            are at another step or phase: a message naming them and when the job will be ended; else None.
        """
        elsewhere = self._elsewhere(now, min(self.timeout, self.elsewhere_timeout / 2))
        if not elsewhere:
            return None
        return (f"hvdp watchdog (warning): {self._me(now)}; {elsewhere}. A peer evaluating, saving a "
                f"checkpoint or logging is normal; if it has not joined after {self.elsewhere_timeout:g} s in all, "
                f"the job is ended (HVDP_WATCHDOG_ELSEWHERE_TIMEOUT changes that limit).")

    def _elsewhere(self, now: float, limit: float) -> str:
        """The live peers at another step or phase, when this rank has been WAITING longer than `limit`."""
        if self.phase != WAITING or now - self.since <= limit:
            return ""
        return "; ".join(f"rank {r} is alive at step {p.step}, {p.phase}" for r, p in sorted(self.state.items())
                         if p.phase != WAITING or p.step != self.step)

    def _me(self, now: float) -> str:
        me = f"rank {self.rank} is at step {self.step}, {self.phase} for {now - self.since:.0f} s"
        if self.rejected:
            me += (f" ({self.rejected} heartbeat packet(s) were ignored as malformed, unauthenticated or from "
                   f"another job)")
        return me


def _abort(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["EXIT_CODE", "DEFAULT_TIMEOUT", "DEFAULT_ELSEWHERE_TIMEOUT", "WAITING", "EXITED", "settings", "open_socket", "Watchdog"]
