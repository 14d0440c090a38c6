"""hvdp.core.clusters: what hvdp.spark and hvdp.ray decide before Horovod starts, in-process."""

import textwrap

import pytest

from hvdp.core.clusters import (check_controller, check_count, elastic_bounds, nic_set, no_interface_message,
                                pick_results, shared_interface, spark_masters, split_address, unguarded)
from hvdp.core.errors import ConfigError, HvdpError

SCRIPT = textwrap.dedent('''\
    import hvdp.spark

    def train():
        return 1

    hvdp.spark.run(train)                       # line 6: unguarded

    if __name__ == "__main__":
        hvdp.spark.run(train)                   # line 9: guarded
        if True:
            hvdp.spark.run(train)               # line 11: nested, still guarded

    if "__main__" == __name__ and True:
        hvdp.spark.run(train)                   # line 14: reversed and combined, guarded

    if __name__ != "__main__":
        hvdp.spark.run(train)                   # line 17: the opposite test

    def main():
        hvdp.spark.run(train)                   # line 20: inside a function (the caller's line counts)

    main()                                      # line 22: unguarded call of it
    ''')


@pytest.mark.parametrize("line,expected", [(6, True), (9, False), (11, False), (14, False), (17, True),
                                           (20, False), (22, True), (1, True), (99, False)])
def test_unguarded_names_module_level_code_outside_a_main_guard(line, expected):
    assert unguarded(SCRIPT, line) is expected


def test_unguarded_cannot_tell_for_a_script_that_does_not_parse():
    assert unguarded("def broken(:\n", 1) is False


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_check_count_refuses_what_is_not_a_count(value):
    with pytest.raises(ConfigError, match=rf"num_proc={value!r}: must be an integer >= 1"):
        check_count("num_proc", value)


def test_check_count_returns_a_count():
    assert check_count("num_workers", 3) == 3


@pytest.mark.parametrize("given,expected", [
    ((None, None, None), (1, 1, 1)),
    ((4, None, None), (4, 1, 4)),
    ((None, 2, None), (2, 2, 2)),
    ((2, 1, 4), (2, 1, 4)),
])
def test_elastic_bounds_default_from_each_other(given, expected):
    assert elastic_bounds(*given) == expected


@pytest.mark.parametrize("given", [(2, 3, 4), (5, 1, 4), (2, 0, 4)])
def test_elastic_bounds_refuse_bounds_out_of_order(given):
    with pytest.raises(ConfigError, match="min_num_proc"):
        elastic_bounds(*given)


def test_elastic_bounds_use_the_callers_names():
    with pytest.raises(ConfigError, match=r"min_workers=3, min_workers=3, max_workers=2"):
        elastic_bounds(3, 3, 2, names=("min_workers", "min_workers", "max_workers"))


def test_controller_and_nics():
    assert check_controller("mpi") == "mpi"
    with pytest.raises(ConfigError, match="'gloo', 'mpi'"):
        check_controller("nccl")
    assert nic_set(None) is None and nic_set("eth0") == {"eth0"} and nic_set(["eth0", "ib0"]) == {"eth0", "ib0"}
    for bad in ([], [""], [3]):
        with pytest.raises(ConfigError, match="interface names"):
            nic_set(bad)


@pytest.mark.parametrize("address,expected", [("10.0.0.1:6380", ("10.0.0.1", 6380)), ("head", ("head", 6379)),
                                              ("[fd00::1]:7000", ("fd00::1", 7000)), ("[fd00::1]", ("fd00::1", 6379))])
def test_split_address(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["head:port", ":6379", "head:0", "head:70000", "a:b:c"])
def test_split_address_refuses_malformed_ones(address):
    with pytest.raises(ConfigError, match="host:port of the Ray head"):
        split_address(address)


def test_spark_masters():
    assert spark_masters("spark://head:7078,standby") == [("head", 7078), ("standby", 7077)]
    assert spark_masters("local-cluster[2,1,1024]") == [] and spark_masters("yarn") == []
    with pytest.raises(ConfigError, match="expected spark://host:port"):
        spark_masters("spark://head:x")


LO = [("127.0.0.1", "255.0.0.0")]
ETH = [("10.1.2.3", "255.255.0.0")]


def test_shared_interface_is_the_one_holding_the_drivers_address():
    assert shared_interface(["10.1.2.3", "10.1.9.9"], {"lo": LO, "eth0": ETH}, "10.1.2.3") == "eth0"
    # one node on loopback (ray start --head on a laptop), or two on loopback addresses of one machine
    assert shared_interface(["127.0.0.1"], {"lo": LO, "eth0": ETH}, "127.0.0.1") == "lo"
    assert shared_interface(["127.0.0.1", "127.0.0.2"], {"lo": LO, "eth0": ETH}, "127.0.0.1") == "lo"


def test_shared_interface_falls_back_to_the_network_holding_every_node():
    # a driver known by an address it does not hold (NAT, Ray Client): the network decides
    assert shared_interface(["10.1.2.3", "10.1.9.9"], {"lo": LO, "eth0": ETH}, "192.168.0.5") == "eth0"
    assert shared_interface(["10.1.2.3", "10.2.0.1"], {"lo": LO, "eth0": ETH}, "192.168.0.5") is None
    assert shared_interface([], {"eth0": ETH}, "192.168.0.5") is None


def test_no_interface_message_says_what_was_seen_and_the_fix():
    message = no_interface_message(["10.1.2.3", "10.2.0.1"], ["lo", "eth0"], "192.168.0.5")
    assert "192.168.0.5" in message and "10.2.0.1" in message and "eth0, lo" in message
    assert "nics=['eth0']" in message


def test_pick_results():
    assert pick_results([{"rank": 0}, {"rank": 1}], False, "x") == {"rank": 0}
    assert pick_results(({"rank": 0}, {"rank": 1}), True, "x") == [{"rank": 0}, {"rank": 1}]
    with pytest.raises(HvdpError, match="x: no rank returned a result"):
        pick_results([], False, "x")
