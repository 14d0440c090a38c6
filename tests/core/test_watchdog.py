"""The watchdog in-process: two real heartbeat threads on loopback UDP."""

import threading
import time

import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.watchdog import WAITING, Watchdog, open_socket, settings


def pair(timeout=0.6):
    socks = [open_socket("127.0.0.1") for _ in range(2)]
    peers = [[("127.0.0.1", s.getsockname()[1])] for s in socks]
    fired = {0: threading.Event(), 1: threading.Event()}
    messages = {}

    def catcher(rank):
        def on_hang(msg):
            messages[rank] = msg
            fired[rank].set()
        return on_hang

    dogs = [Watchdog(r, peers, socks[r], timeout=timeout, interval=0.05, on_hang=catcher(r)) for r in range(2)]
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
    dogs, fired, messages = pair()
    for d in dogs:
        d.start()
    dogs[0].progress(3, WAITING)
    dogs[1].progress(3, "computing its forward/backward pass")  # alive, heartbeating, never joins
    assert fired[0].wait(3)
    assert "rank 1 is alive at step 3, computing" in messages[0] and "never reached this collective" in messages[0]
    assert not fired[1].is_set()
    for d in dogs:
        d.stop()


@pytest.mark.parametrize("env,expected", [({}, (True, 60.0)), ({"HVDP_WATCHDOG": "0"}, (False, 60.0)),
                                          ({"HVDP_WATCHDOG_TIMEOUT": "5"}, (True, 5.0))])
def test_settings(env, expected):
    assert settings(env) == expected


@pytest.mark.parametrize("bad", ["soon", "0", "-3"])
def test_bad_timeout_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="HVDP_WATCHDOG_TIMEOUT"):
        settings({"HVDP_WATCHDOG_TIMEOUT": bad})
