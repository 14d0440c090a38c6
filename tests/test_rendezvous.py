"""Horovod's Gloo rendezvous server (horovod.runner.http.http_server, as hvdp builds it: fix 19 in
scripts/build_horovod.sh), in-process: after every rank has finished a rendezvous scope, that scope's keys are
gone, whatever order the ranks finish their scopes in. A key left behind is a stale address: the next init after
hvd.shutdown() under Gloo (Horovod's own test_torch.py does it after every test) connected to a port that no
longer listened, "gloo::IoException: connect [127.0.0.1]:17332: Connection refused" thrown in Horovod's
background thread, and the rank died of SIGABRT (issue 52)."""

from __future__ import annotations

import itertools
import urllib.error
import urllib.request

import pytest

from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousServer


def _request(port: int, method: str, scope: str, key: str, data: bytes | None = None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/{scope}/{key}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def server():
    s = RendezvousServer()
    port = s.start()
    # two ranks on one host, as horovodrun --gloo -np 2 plans them: scopes global, local_vm, cross_0, cross_1
    s.init([SlotInfo("vm", rank, rank, 0, 2, 2, 1) for rank in range(2)])
    yield port
    s.stop()


SCOPES = {0: ["global", "local_vm", "cross_0"], 1: ["global", "local_vm", "cross_1"]}


# Each rank finishes its scopes in Horovod's order (global, local, cross); the orders below interleave the two
# ranks every way that keeps each rank's own order. The failing one: rank 0 finishes local_vm, then cross_0
# (complete: the server cleared every scope's finished list), then rank 1 finishes local_vm, which never counted
# as complete.
ORDERS = sorted({tuple(o) for o in itertools.permutations([0, 0, 0, 1, 1, 1])})


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "".join(map(str, o)))
def test_every_finished_scope_is_cleared_whatever_the_order(server, order):
    for rank, scopes in SCOPES.items():
        for scope in scopes:
            assert _request(server, "PUT", scope, str(rank), b"address") == 200
    position = {0: 0, 1: 0}
    for rank in order:  # each rank's Finalize() of its next scope: DELETE /<scope>/<rank>
        assert _request(server, "DELETE", SCOPES[rank][position[rank]], str(rank)) == 200
        position[rank] += 1
    left = [(scope, rank) for rank, scopes in SCOPES.items() for scope in scopes
            if _request(server, "GET", scope, str(rank)) != 404]
    assert left == [], f"keys left after every rank finished its scopes (order {order}): {left}"
