"""The watchdog in-process: two real heartbeat threads on loopback UDP."""

import hashlib
import hmac
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.heartbeats import job_tag, open_socket
from hvdp.core.watchdog import WAITING, Watchdog, settings


SECRET = b"s" * 32
OTHER_JOB = b"o" * 32


def make_dog(rank, peers, sock, timeout, catcher, **limits):
    return Watchdog(rank, peers, sock, secret=SECRET, timeout=timeout, interval=0.05, on_hang=catcher, **limits)


def pair(timeout=0.6, **limits):
    socks = [open_socket("127.0.0.1") for _ in range(2)]
    peers = [[("127.0.0.1", s.getsockname()[1])] for s in socks]
    fired = {0: threading.Event(), 1: threading.Event()}
    messages = {}

    def catcher(rank):
        def on_hang(msg):
            messages[rank] = msg
            fired[rank].set()
        return on_hang

    dogs = [make_dog(r, peers, socks[r], timeout, catcher(r), **limits) for r in range(2)]
    return dogs, fired, messages


def test_healthy_peers_never_fire():
    dogs, fired, _ = pair()
    for d in dogs:
        d.start()
    for step in range(8):
        for d in dogs:
            d.progress(step, "computing")
        time.sleep(0.1)
    assert not fired[0].is_set() and not fired[1].is_set()
    for d in dogs:
        d.stop()


def test_silent_peer_is_named_with_its_last_step():
    dogs, fired, messages = pair()
    for d in dogs:
        d.start()
    dogs[1].progress(7, "computing its forward/backward pass")
    time.sleep(0.2)
    dogs[1]._stop.set()  # frozen: no more heartbeats, and no goodbye
    dogs[0].progress(8, WAITING)
    assert fired[0].wait(3)
    assert "rank 1 (last heard" in messages[0] and "at step 7, computing" in messages[0]
    assert "rank 0 is at step 8, waiting for the gradient all-reduce" in messages[0]
    dogs[0].stop()


def test_peer_that_leaves_on_purpose_is_not_a_hang():
    dogs, fired, _ = pair()
    for d in dogs:
        d.start()
    time.sleep(0.1)
    dogs[1].stop()  # says goodbye
    time.sleep(1.0)
    assert not fired[0].is_set()
    dogs[0].stop()


def test_live_peer_that_never_joins_the_collective():
    warnings = []
    dogs, fired, messages = pair(elsewhere_timeout=1.5, on_warning=warnings.append)
    for d in dogs:
        d.start()
    start = time.monotonic()
    dogs[0].progress(3, WAITING)
    dogs[1].progress(3, "computing its forward/backward pass")  # alive, heartbeating, never joins
    assert fired[0].wait(4)
    waited = time.monotonic() - start
    assert "rank 1 is alive at step 3, computing" in messages[0] and "never reached this collective" in messages[0]
    assert "HVDP_WATCHDOG_ELSEWHERE_TIMEOUT" in messages[0]
    assert waited >= 1.5, waited  # the live peer's limit, not the silent peer's 0.6 s
    assert len(warnings) == 1 and "warning" in warnings[0] and "rank 1 is alive at step 3, computing" in warnings[0]
    assert not fired[1].is_set()
    for d in dogs:
        d.stop()


def test_live_peer_elsewhere_gets_a_warning_then_rejoins():
    """A peer busy for longer than the silent-peer limit (rank 0 writing a checkpoint) is warned about once
    and does not end the job; a second long wait warns again."""
    warnings = []
    dogs, fired, _ = pair(timeout=0.3, elsewhere_timeout=30, on_warning=warnings.append)
    for d in dogs:
        d.start()
    for step in (4, 5):
        dogs[1].progress(step, WAITING)
        dogs[0].progress(step, "saving a checkpoint")
        time.sleep(1.2)  # 4x the silent limit, heartbeats flowing
        assert len(warnings) == step - 3, warnings
        assert f"rank 1 is at step {step}, waiting" in warnings[-1] and f"rank 0 is alive at step {step}, saving" \
            in warnings[-1] and "30 s" in warnings[-1]
        dogs[0].progress(step, WAITING)
        time.sleep(0.2)
    assert not fired[0].is_set() and not fired[1].is_set()
    for d in dogs:
        d.stop()


@pytest.mark.parametrize("env,expected", [({}, (True, 60.0, 1800.0)), ({"HVDP_WATCHDOG": "0"}, (False, 60.0, 1800.0)),
                                          ({"HVDP_WATCHDOG_TIMEOUT": "5"}, (True, 5.0, 1800.0)),
                                          ({"HVDP_WATCHDOG_ELSEWHERE_TIMEOUT": "90"}, (True, 60.0, 90.0))])
def test_settings(env, expected):
    assert settings(env) == expected


@pytest.mark.parametrize("name", ["HVDP_WATCHDOG_TIMEOUT", "HVDP_WATCHDOG_ELSEWHERE_TIMEOUT"])
@pytest.mark.parametrize("bad", ["soon", "0", "-3", "nan", "inf"])
def test_bad_timeout_is_a_clear_error(name, bad):
    with pytest.raises(ConfigError, match=name):
        settings({name: bad})


def signed(body: bytes, key: bytes = SECRET) -> bytes:
    """A packet as a rank of the job keyed `key` sends it (hvdp.core.heartbeats.seal, written out)."""
    return job_tag(key) + hmac.new(key, body, hashlib.sha256).digest() + body


def blob(obj) -> bytes:
    return json.dumps(obj).encode()


GARBAGE = {
    "int": b"1", "list": b"[]", "null": b"null", "invalid utf-8": b"\xff\xfe\x80",
    "huge": b"{" + b"x" * 65000, "empty": b"",
    "wrong types": blob({"rank": "1", "step": None, "phase": 3}),
    "rank a list": blob({"rank": [1], "step": 1, "phase": "x"}),
    "forged exited": blob({"rank": 1, "phase": "exited"}),
    "forged heartbeat": blob({"rank": 1, "step": 99, "phase": "computing", "seq": 10**9}),
    "other job's exited": signed(blob({"rank": 1, "step": 0, "phase": "exited", "seq": 10**9}), OTHER_JOB),
    "other job's heartbeat": signed(blob({"rank": 1, "step": 99, "phase": "computing", "seq": 10**9}),
                                    OTHER_JOB),
    "signed int": signed(b"1"), "signed list": signed(b"[]"), "signed null": signed(b"null"),
    "signed invalid utf-8": signed(b"\xff\xfe"),
    "signed wrong types": signed(blob({"rank": 1, "step": "9", "phase": None, "seq": 10**9})),
    "signed bool rank": signed(blob({"rank": True, "step": 1, "phase": "computing", "seq": 10**9})),
    "signed unknown rank": signed(blob({"rank": 7, "step": 1, "phase": "computing", "seq": 10**9})),
    "signed as myself": signed(blob({"rank": 0, "step": 1, "phase": "exited", "seq": 10**9})),
    "signed but replayed": signed(blob({"rank": 1, "step": 1, "phase": "exited", "seq": 0})),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_bad_packets_do_not_hide_a_silent_peer(name):
    """Sent over and over while rank 1 is silent: rank 0 still names rank 1, and counts what it ignored."""
    dogs, fired, messages = pair(timeout=1.0)
    for d in dogs:
        d.start()
    dogs[1].progress(7, "computing its forward/backward pass")
    time.sleep(0.3)
    dogs[1]._stop.set()  # frozen: no more heartbeats, and no goodbye
    dogs[1]._thread.join()
    dogs[0].progress(8, WAITING)
    target = tuple(dogs[0].peers[0][0])
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = 0
    deadline = time.monotonic() + 15  # generous: the timeout is 1 s, the CPUs are shared
    while not fired[0].is_set() and time.monotonic() < deadline:
        try:
            attacker.sendto(GARBAGE[name], target)
            sent += 1
        except OSError:  # 'huge' may be refused by the kernel: the rest of the test still holds
            pass
        time.sleep(0.02)
    attacker.close()
    assert fired[0].is_set(), f"{name}: the watchdog never diagnosed the silent peer"
    assert "rank 1 (last heard" in messages[0] and "at step 7, computing" in messages[0]
    assert dogs[0]._thread.is_alive() or fired[0].is_set()
    if not sent:
        pass
    elif GARBAGE[name].startswith(job_tag(SECRET)):  # the job's tag: it reaches the thread, which refuses it
        assert dogs[0].rejected >= 1, f"{name}: {sent} bad packets sent, none counted"
        assert "heartbeat packet(s) were ignored" in messages[0]
    elif dogs[0].kernel_filter:  # no tag: dropped in the kernel, never read
        assert dogs[0].rejected == dogs[0].dropped == 0, (name, dogs[0].rejected, dogs[0].dropped)
    else:
        assert dogs[0].dropped >= 1 and "dropped unread" in messages[0], (name, dogs[0].dropped)
    dogs[0]._stop.set()


def test_thread_survives_garbage_and_keeps_watching():
    """Every kind of garbage at once, then a real hang: the thread is still alive to report it."""
    dogs, fired, messages = pair(timeout=1.0)
    for d in dogs:
        d.start()
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for data in GARBAGE.values():
        try:
            attacker.sendto(data, tuple(dogs[0].peers[0][0]))
        except OSError:
            pass
    for step in range(5):
        for d in dogs:
            d.progress(step, "computing")
        time.sleep(0.1)
    attacker.close()
    assert dogs[0]._thread.is_alive() and not fired[0].is_set()
    dogs[1]._stop.set()
    assert fired[0].wait(15)
    assert "rank 1 (last heard" in messages[0]
    dogs[0]._stop.set()


def test_a_replayed_goodbye_before_the_first_heartbeat_does_not_hide_a_peer():
    # Sequence numbers start at 1: a signed packet numbered 0 was never sent (a replay or a forgery), so it
    # must not count even before the peer's first heartbeat; it used to take rank 1 off the watch for good.
    dogs, fired, messages = pair(timeout=1.0)
    dogs[0].start()  # rank 1 never starts: silent from the first moment
    dogs[0].progress(1, WAITING)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.sendto(GARBAGE["signed but replayed"], tuple(dogs[0].peers[0][0]))
    attacker.close()
    assert fired[0].wait(15), "rank 1 was dropped from the watch by a packet it never sent"
    assert "rank 1 (last heard" in messages[0] and dogs[0].rejected == 1
    dogs[0]._stop.set()


def test_watchdog_needs_a_secret():
    sock = open_socket("127.0.0.1")
    with pytest.raises((TypeError, ValueError)):
        Watchdog(0, [[("127.0.0.1", 1)], [("127.0.0.1", 2)]], sock)
    sock.close()


# ------------------------------------------------ where each rank is: collectives, phases, mismatches (issue 36)

LOADING = "in its DataLoader, waiting for a batch"


def blocked_in(dog, *names, wait=0):
    """Make `dog`'s rank submit collectives `names` (handles 0, 1, ...) and wait on names[wait]."""
    for handle, name in enumerate(names):
        dog.collectives.submitted(handle, name)
    dog.collectives.wait(wait)


def test_ranks_blocked_in_different_collectives_end_within_the_silent_peer_limit():
    """issue 29: rank 0 in broadcast_object while rank 1 is in prepare()'s check: no waiting resolves it, so
    the job ends after the silent-peer limit, not the 30-minute one, naming each rank's collective."""
    dogs, fired, messages = pair(timeout=0.6, elsewhere_timeout=60)
    for d in dogs:
        d.start()
    start = time.monotonic()
    blocked_in(dogs[0], "broadcast.config.sz")
    blocked_in(dogs[1], "allgather.hvdp.model_shapes.sz")
    assert fired[0].wait(10) and fired[1].wait(10)
    assert time.monotonic() - start < 10  # the silent-peer limit (0.6 s) and a few heartbeats, not 60 s
    for msg in messages.values():
        assert "every rank is blocked in a collective that another rank never submitted" in msg, msg
        assert "rank 0 waits for broadcast.config.sz" in msg and "which rank 1 never submitted" in msg, msg
        assert "rank 1 waits for allgather.hvdp.model_shapes.sz" in msg and "which rank 0 never submitted" in msg
        assert "HVDP_WATCHDOG_TIMEOUT" in msg


def test_collectives_in_another_order_but_all_submitted_are_not_a_deadlock():
    """Each rank waits on a different collective, but both submitted both: Horovod completes them."""
    dogs, fired, _ = pair(timeout=0.3, elsewhere_timeout=60)
    for d in dogs:
        d.start()
    blocked_in(dogs[0], "allreduce.a", "allreduce.b", wait=0)
    blocked_in(dogs[1], "allreduce.a", "allreduce.b", wait=1)
    time.sleep(2.0)
    assert not fired[0].is_set() and not fired[1].is_set()
    for d in dogs:
        d.stop()


def test_a_peer_not_heard_from_is_named_so_not_placed_by_its_last_heartbeat():
    """A host whose link is cut (CI, tests/multihost): rank 1's last heartbeat, sent at start-up, said it was in
    the settings all-gather; 10 s later rank 0's record of the failure said "rank 0 had not entered
    allgather.hvdp.settings.sz, which rank 1 is in". A heartbeat older than a few intervals says where a rank
    was: it is named as not heard from, and no mismatch is concluded from it; fresh, it places the rank."""
    from hvdp.core.watchdog import PeerState
    dogs, _, _ = pair(timeout=60, elsewhere_timeout=60)
    blocked_in(dogs[0], "allreduce.fc.weight")
    now = time.monotonic() + 10  # rank 0 has waited 10 s
    for heard, expected in ((now - 10, "rank 1 not heard from for 10 s"), (now - 0.01, "had not entered")):
        dogs[0].state[1] = PeerState(step=0, heard=heard, op="allgather.hvdp.settings.sz", op_since=heard - 5,
                                     lacks=("allreduce.fc.weight",))
        text = dogs[0].not_entered(now)
        assert expected in text, text
        assert ("allgather.hvdp.settings.sz" in text) == (expected == "had not entered"), text
        assert bool(dogs[0]._deadlock(now)) == (expected == "had not entered")  # a deadlock only when fresh
    for d in dogs:
        d.sock.close()


def test_peer_outside_any_collective_keeps_the_long_limit_and_is_named_with_its_phase():
    """issue 36: rank 0 waits in allgather_object while rank 1 is stuck in its DataLoader: a warning after
    the silent-peer limit, the end after the elsewhere limit, each naming where both ranks are."""
    warnings = []
    dogs, fired, messages = pair(timeout=0.3, elsewhere_timeout=2.5, on_warning=warnings.append)
    for d in dogs:
        d.start()
    start = time.monotonic()
    blocked_in(dogs[0], "allgather.bench.rate.sz")
    dogs[1].enter(LOADING)
    assert fired[0].wait(10)
    assert time.monotonic() - start >= 2.5  # the elsewhere limit, not the silent peer's 0.3 s
    msg = messages[0]
    assert "rank 0 is at step 0, in the collective allgather.bench.rate.sz for" in msg, msg
    assert f"rank 1 is alive at step 0, {LOADING}, for " in msg and "never reached this collective" in msg, msg
    assert len(warnings) == 1 and f"rank 1 is alive at step 0, {LOADING}" in warnings[0], warnings
    assert not fired[1].is_set()  # a rank outside any collective waits for nobody
    for d in dogs:
        d.stop()


def test_peer_that_exits_while_this_rank_waits_for_it_ends_the_job():
    """A rank that leaves (finished, or returned early) while its peer waits in a collective it never
    submitted: that collective can never complete."""
    dogs, fired, messages = pair(timeout=0.5, elsewhere_timeout=60)
    for d in dogs:
        d.start()
    blocked_in(dogs[0], "allgather.final.sz")
    dogs[1].stop()
    assert fired[0].wait(10)
    assert "rank 1 exited" in messages[0] and "allgather.final.sz" in messages[0], messages[0]


def test_where_a_rank_is_reads_as_its_phase_and_collective():
    from hvdp.core.watchdog import COMPUTING, STARTING, _doing
    assert _doing(COMPUTING, None) == COMPUTING
    assert _doing(WAITING, "allreduce.fc.weight") == "waiting for the gradient all-reduce (allreduce.fc.weight)"
    assert _doing(STARTING, "allgather.hvdp.cpus.sz") == "in the collective allgather.hvdp.cpus.sz"
    assert _doing(COMPUTING, "barrier") == "in the collective barrier"
    assert (_doing("evaluating (hvdp.torch.evaluate)", "allgather.hvdp.evaluate.sz")
            == "evaluating (hvdp.torch.evaluate), in the collective allgather.hvdp.evaluate.sz")


def test_collectives_registry_tracks_pending_and_the_wait():
    from hvdp.core.watchdog import Collectives
    c = Collectives()
    c.submitted(7, "allreduce.a")
    c.submitted(8, "allreduce.b")
    assert c.waiting() == (None, 0.0) and c.names() == {"allreduce.a", "allreduce.b"}
    c.wait(8)
    name, since = c.waiting()
    assert name == "allreduce.b" and 0 < since <= time.monotonic()
    c.finished(7)  # another one finishing does not end this wait
    assert c.waiting()[0] == "allreduce.b" and c.names() == {"allreduce.b"}
    c.finished(8)
    assert c.waiting() == (None, 0.0) and c.names() == set()
    c.wait(99)  # an unknown handle (submitted before tracking began): nothing to report
    assert c.waiting() == (None, 0.0)
    with c.blocking("HorovodBroadcast_x_0"):
        assert c.waiting()[0] == "HorovodBroadcast_x_0" and c.names() == {"HorovodBroadcast_x_0"}
    assert c.waiting() == (None, 0.0) and c.names() == set()


def test_heartbeats_with_malformed_collective_fields_are_ignored():
    dogs, _, _ = pair(timeout=5)
    me = dogs[0]
    for bad in ({"op": 3}, {"lacks": "x"}, {"lacks": [1]}, {"for": -1}, {"waited": "1"}, {"for": float("inf")}):
        body = {"rank": 1, "step": 1, "phase": "computing", "seq": 5, **bad}
        assert not me._accept(signed(json.dumps(body).encode())), bad
    assert me._accept(signed(blob({"rank": 1, "step": 1, "phase": "x", "seq": 6, "op": "allreduce.a", "for": 2.5,
                                   "waited": 1.0, "lacks": ["broadcast.b"]})))
    peer = me.state[1]
    assert peer.op == "allreduce.a" and peer.lacks == ("broadcast.b",) and time.monotonic() - peer.op_since >= 1.0


class JumpingClock:
    """time.monotonic() for the watchdog module, plus an offset a test raises: a pause of the whole process
    (every thread in it stopped, SIGSTOP), as its own clock sees it after SIGCONT."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self):
        return time.monotonic() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_pause_of_the_whole_process_is_not_its_peers_silence(monkeypatch):
    """Both watchdogs see their clock jump by 30x the limit at once, as after `scontrol suspend`/`resume`:
    neither ends the job (each gives its peer a fresh window), and a peer that then goes silent is still
    named within the limit. The old loop ended the job at the first look after the jump."""
    import hvdp.core.watchdog as wd

    clock = JumpingClock()
    monkeypatch.setattr(wd, "time", clock)
    pauses = []
    dogs, fired, messages = pair(timeout=1.0)
    for d in dogs:
        d.on_pause = pauses.append
        d.start()
    for step in range(4):
        for d in dogs:
            d.progress(step, "computing")
        time.sleep(0.1)
    clock.offset += 30.0  # the pause: 30 s gone by, in no time for the threads
    for step in range(4, 12):
        for d in dogs:
            d.progress(step, "computing")
        time.sleep(0.1)
    assert not fired[0].is_set() and not fired[1].is_set(), messages
    assert len(pauses) == 2 and all("was paused for 30 s" in p for p in pauses), pauses
    assert all(len(d.pauses) == 1 for d in dogs)
    dogs[1]._stop.set()  # now rank 1 goes silent for real
    assert fired[0].wait(15) and "rank 1 (last heard" in messages[0], messages
    dogs[0]._stop.set()


def test_paused_time_counts_in_no_limit():
    sock = open_socket("127.0.0.1")
    dog = make_dog(0, [[("127.0.0.1", 1)], [("127.0.0.1", 2)]], sock, 5.0, lambda m: None)
    dog.pauses = [(10.0, 20.0), (40.0, 45.0)]
    assert dog.elapsed(5.0, 30.0) == 15.0    # 10 s of the 25 paused
    assert dog.elapsed(15.0, 50.0) == 25.0   # half of the first pause, all of the second
    assert dog.elapsed(50.0, 60.0) == 10.0
    dog.collectives.submitted("k", "allreduce.g")
    dog.collectives.wait("k")
    name, since = dog.collectives.waiting()
    dog.pauses = [(since + 0.001, since + 100.0)]  # waited ~100 s on the clock, ~0 of it awake
    del dog.state[1]  # rank 1 left on purpose (its goodbye)
    dog.exited.add(1)
    assert dog.diagnose(since + 100.5) is None   # the exited-peer limit (5 s) is not reached ...
    assert "exited" in dog.diagnose(since + 106.0)  # ... until 5 s awake
    sock.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["bpf-filter", "no-filter"])
def test_datagrams_from_outside_the_job_are_dropped_before_any_cryptography(kernel, monkeypatch):
    """A datagram without the job's tag is dropped by the socket's BPF filter, unread (or, where no filter
    can be attached, by the thread, counted in `dropped`); the job's own heartbeats from an address it does
    not list are dropped by the thread, before any cryptography: a rank only hears its sources."""
    import hvdp.core.watchdog as wd

    if not kernel:
        monkeypatch.setattr(wd, "drop_strangers", lambda sock, tag: False)
    socks = [open_socket("127.0.0.1") for _ in range(2)]
    peers = [[("127.0.0.1", s.getsockname()[1])] for s in socks]
    fired, messages = threading.Event(), {}

    def on_hang(message):
        messages[0] = message
        fired.set()

    deaf = Watchdog(0, peers, socks[0], secret=SECRET, timeout=1.0, interval=0.05, on_hang=on_hang,
                    sources={"10.1.2.3"}).start()
    talker = make_dog(1, peers, socks[1], 1.0, lambda m: None).start()
    assert deaf.kernel_filter == kernel
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(1000):
        attacker.sendto(b"x" * 100, tuple(peers[0][0]))
    assert fired.wait(15), "a heartbeat from an address outside `sources` was taken"
    heard = talker._seq  # heartbeats rank 1 sent, every one dropped for its source
    assert deaf.rejected == 0 and "dropped unread" in messages[0]
    assert deaf.dropped >= (1000 if not kernel else 1), deaf.dropped
    assert deaf.dropped <= heard + (1000 if not kernel else 0), (deaf.dropped, heard)
    talker._stop.set()
    attacker.close()


@pytest.mark.parametrize("binds", [("::1", "::1"), ("::", "127.0.0.1")], ids=["ipv6", "dual-stack-and-ipv4"])
def test_heartbeats_over_ipv6_and_between_families(binds):
    """Two watchdogs on IPv6 loopback, and one on a dual-stack socket ("::") with an IPv4 peer: healthy, they
    never fire; silenced, rank 1 is named."""
    try:
        socks = [open_socket(b) for b in binds]
    except OSError as e:
        pytest.skip(f"no IPv6 on this host: {e}")
    peers = [[("::1" if b == "::1" else "127.0.0.1", s.getsockname()[1])] for b, s in zip(binds, socks)]
    fired, messages = {0: threading.Event(), 1: threading.Event()}, {}

    def catcher(rank):
        def on_hang(message):
            messages[rank] = message
            fired[rank].set()
        return on_hang

    dogs = [make_dog(r, peers, socks[r], 0.6, catcher(r)).start() for r in range(2)]
    for step in range(10):
        for d in dogs:
            d.progress(step, "computing")
        time.sleep(0.1)
    assert not fired[0].is_set() and not fired[1].is_set(), messages
    assert all(d.dropped == 0 for d in dogs)
    dogs[1]._stop.set()
    assert fired[0].wait(15) and "rank 1 (last heard" in messages[0]
    dogs[0]._stop.set()


def test_addresses_as_a_peer_list_names_them():
    from hvdp.core.heartbeats import plain_address
    assert plain_address("::ffff:10.0.0.2") == "10.0.0.2"
    assert plain_address("fe80::1%eth0") == "fe80::1"
    assert plain_address("fd77::2") == "fd77::2" and plain_address("10.0.0.2") == "10.0.0.2"


def test_the_watchdog_listens_on_ipv6_where_the_interface_has_no_ipv4(monkeypatch):
    import psutil

    from hvdp import _horovod
    from hvdp.core.errors import SetupError

    def addr(family, address):  # the fields of psutil's snicaddr that the watchdog reads
        return SimpleNamespace(family=family, address=address, netmask=None, broadcast=None, ptp=None)

    interfaces = {"lo": [addr(socket.AF_INET, "127.0.0.1"), addr(socket.AF_INET6, "::1")],
                  "ib0": [addr(socket.AF_INET6, "fe80::5%ib0"), addr(socket.AF_INET6, "fd00::5")],
                  "eth0": [addr(socket.AF_INET, "10.0.0.5"), addr(socket.AF_INET6, "2001:db8::5")],
                  "ll0": [addr(socket.AF_INET6, "fe80::7%ll0")]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    assert _horovod._interface_addresses("ib0") == ["fd00::5"]  # not link-local: no peer can name its scope
    assert _horovod._interface_addresses("eth0") == ["10.0.0.5", "2001:db8::5"]
    assert _horovod._interface_addresses(None) == ["10.0.0.5", "fd00::5", "2001:db8::5"]
    assert "fe80::7" in _horovod._interface_addresses(None, every=True)
    for iface in ("ll0", "nope"):
        with pytest.raises(SetupError, match="HVDP_WATCHDOG_IFACE"):
            _horovod._interface_addresses(iface)
