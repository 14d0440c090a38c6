"""What hvdp.spark and hvdp.ray decide before they hand a training function to Horovod, as pure functions.

Argument checks (how many workers, elastic bounds), the `if __name__ == "__main__":` guard test for a driver
script, the network interface an elastic Ray job runs on, how a Ray address splits into host and port, which
result of which rank a run returns, and the messages that name what is wrong and the fix. No pyspark, ray,
horovod or framework import: the launchers call these with plain values, and tests/core checks them.
"""

from __future__ import annotations

import ast
import ipaddress
from typing import Any, Iterable, Mapping, Sequence

from hvdp.core.errors import ConfigError, HvdpError

CONTROLLERS = ("gloo", "mpi")


def check_count(name: str, value: Any, *, minimum: int = 1) -> int:
    """`value` as a worker count: an int (not a bool) >= `minimum`.

    Args:
        name: the argument's name, quoted in the message (e.g. "num_proc").
        value: what the caller passed.
        minimum: the smallest allowed value (default 1).

    Returns:
        The value.

    Raises:
        ConfigError: it is not an integer, or below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum} (the number of training processes)")
    return value


def elastic_bounds(num: int | None, minimum: int | None, maximum: int | None, *,
                   names: tuple[str, str, str] = ("num_proc", "min_num_proc", "max_num_proc")) -> tuple[int, int, int]:
    """The (start, min, max) worker counts of an elastic job, each defaulting from the others.

    `num` (the workers to start with) defaults to `minimum`, `minimum` to 1, `maximum` to `num`.

    Args:
        num: workers to start with, or None.
        minimum: fewest workers training may go on with, or None.
        maximum: most workers the job grows to, or None.
        names: the caller's names for the three, quoted in messages (default Spark's).

    Returns:
        (num, minimum, maximum) with minimum <= num <= maximum.

    Raises:
        ConfigError: one is not an integer >= 1, or they are out of order.
    """
    n_name, min_name, max_name = names
    minimum = check_count(min_name, 1 if minimum is None else minimum)
    num = check_count(n_name, minimum if num is None else num)
    maximum = check_count(max_name, num if maximum is None else maximum)
    if not minimum <= num <= maximum:
        raise ConfigError(f"{min_name}={minimum}, {n_name}={num}, {max_name}={maximum}: need "
                          f"{min_name} <= {n_name} <= {max_name}")
    return num, minimum, maximum


def check_controller(controller: str) -> str:
    """`controller` if it is one of CONTROLLERS ("gloo", "mpi").

    Args:
        controller: what the caller passed.

    Raises:
        ConfigError: any other value.
    """
    if controller not in CONTROLLERS:
        raise ConfigError(f"controller={controller!r}: choose one of {', '.join(map(repr, CONTROLLERS))}")
    return controller


def nic_set(nics: str | Iterable[str] | None) -> set[str] | None:
    """Network interface names as the set Horovod wants (None stays None; one name may be a plain string).

    Args:
        nics: None, "eth0", or an iterable of names.

    Raises:
        ConfigError: an empty collection, or a name that is not a non-empty string.
    """
    if nics is None:
        return None
    names = [nics] if isinstance(nics, str) else list(nics)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"nics={nics!r}: give interface names such as ['eth0'] (or None to detect them)")
    return set(names)


def _is_main_test(test: ast.expr) -> bool:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def unguarded(source: str, line: int) -> bool:
    """Whether `line` of a script runs when the script is imported rather than run: module-level code that
    is not inside an `if __name__ == "__main__":` block.

    A launcher that starts helper processes with multiprocessing's "spawn" method re-imports the driver
    script in each of them, so a launch at such a line launches again from every helper.

    Args:
        source: the script's text.
        line: a 1-based line number in it (the line the module-level code is executing).

    Returns:
        True when the top-level statement holding `line` runs at import and is not the body of a main guard;
        False when it is in such a body or in a function's (which does not run at import), or when the source
        does not parse or no statement holds the line (nothing can be said).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return False
            return not (isinstance(node, ast.If) and _is_main_test(node.test)
                        and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line))
    return False


def main_guard_message(launcher: str, where: str, why: str) -> str:
    """The error for a launch made from a driver script's top level without a main guard.

    Args:
        launcher: the function called, e.g. "hvdp.spark.run".
        where: "file:line" of the call.
        why: what goes wrong without the guard, in a sentence.
    """
    return (f"{launcher} was called at {where}, outside an `if __name__ == \"__main__\":` block. {why} "
            f"Put the launch (and the session it needs) under `if __name__ == \"__main__\":`")


def split_address(address: str, default_port: int = 6379) -> tuple[str, int]:
    """A Ray GCS address "host[:port]" as (host, port); "[v6]:port" too.

    Args:
        address: what the user gave (not "auto", "local" or a "ray://" client address).
        default_port: the port when none is given (Ray's 6379).

    Raises:
        ConfigError: the port is not an integer in 1..65535, or the host is empty.
    """
    host, port = address, str(default_port)
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else port
    elif address.count(":") == 1:
        host, port = address.split(":")
    elif ":" in address:  # an IPv6 address needs brackets to tell it from its port
        host = ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"address={address!r}: expected host:port of the Ray head (e.g. '10.0.0.1:6379'), "
                          f"'auto' on a node of a running cluster, or 'local' to start one here")
    return host, int(port)


def spark_masters(master: str) -> list[tuple[str, int]]:
    """The (host, port) of each standalone master a "spark://h1:7077[,h2:7077]" URL names; [] for any other
    master (local, yarn, k8s://...), whose reachability Spark itself decides.

    Args:
        master: the Spark master URL.

    Raises:
        ConfigError: a spark:// URL whose host:port is malformed.
    """
    if not master.startswith("spark://"):
        return []
    found = []
    for part in master[len("spark://"):].split(","):
        try:
            found.append(split_address(part, default_port=7077))
        except ConfigError:
            raise ConfigError(f"master={master!r}: expected spark://host:port[,host:port] (7077 by default)") from None
    return found


def shared_interface(node_ips: Sequence[str], interfaces: Mapping[str, Sequence[tuple[str, str]]],
                     driver_ip: str) -> str | None:
    """The network interface an elastic job's workers should talk over, judged from the driver's host.

    Horovod's elastic driver needs the interface up front (it cannot probe hosts that join later). The
    interface that holds the driver's own cluster address is the one the cluster runs on; when the driver's
    address is on none (a Ray client, a NAT), the interface whose network holds every node's address.
    Nodes are assumed to name it alike (eth0 on every Kubernetes pod); where they do not, pass nics.

    Args:
        node_ips: the IPv4 addresses the cluster's nodes are known by (Ray's NodeManagerAddress).
        interfaces: this host's interfaces: name -> [(address, netmask), ...] (IPv4).
        driver_ip: the address this host is known by in the cluster.

    Returns:
        The interface name, or None when none qualifies.
    """
    for name, addrs in sorted(interfaces.items()):
        if any(addr == driver_ip for addr, _ in addrs):
            return name
    for name, addrs in sorted(interfaces.items()):
        nets = [ipaddress.ip_network(f"{a}/{m}", strict=False) for a, m in addrs if m]
        if node_ips and all(any(ipaddress.ip_address(ip) in net for net in nets) for ip in node_ips):
            return name
    return None


def no_interface_message(node_ips: Sequence[str], interfaces: Iterable[str], driver_ip: str) -> str:
    """The error when shared_interface finds none: the addresses seen, the interfaces here, the fix.

    Args:
        node_ips: the nodes' addresses.
        interfaces: this host's interface names.
        driver_ip: this host's cluster address.
    """
    return (f"cannot tell which network interface the elastic job's workers share: this host's cluster "
            f"address {driver_ip} is on none of its interfaces ({', '.join(sorted(interfaces)) or 'none'}), "
            f"and no interface's network holds every node ({', '.join(node_ips)}). Pass nics=['eth0'] (the "
            f"interface the nodes reach each other on); Horovod's elastic mode cannot probe for it")


def slots_message(launcher: str, needed: int, slots: int, seconds: float, detail: str) -> str:
    """The error when a cluster never offers the task slots a job needs at once.

    Args:
        launcher: e.g. "hvdp.spark.run".
        needed: processes that must run at the same time.
        slots: slots the cluster had at the end.
        seconds: how long it was waited for.
        detail: how slots are counted there and what to change, in a sentence.
    """
    return (f"{launcher} needs {needed} training processes running at once, and the cluster offered {slots} "
            f"slot(s) after {seconds:.0f}s. {detail} Or ask for fewer processes")


def pick_results(results: Sequence[Any], all_ranks: bool, launcher: str) -> Any:
    """What a launch returns: rank 0's result, or every rank's in rank order.

    Args:
        results: every rank's return value, in rank order.
        all_ranks: return them all (a list) instead of rank 0's.
        launcher: named in the error.

    Raises:
        HvdpError: there are no results (no rank finished), which Horovod should have raised for.
    """
    if not results:
        raise HvdpError(f"{launcher}: no rank returned a result (no training process finished)")
    return list(results) if all_ranks else results[0]


__all__ = ["CONTROLLERS", "check_count", "check_controller", "elastic_bounds", "main_guard_message", "nic_set",
           "no_interface_message", "pick_results", "shared_interface", "slots_message", "spark_masters", "split_address",
           "unguarded"]
