"""Run an hvdp training function on a Ray cluster, one Horovod rank per Ray actor, over horovod.ray.

    import hvdp.ray

    if __name__ == "__main__":
        result = hvdp.ray.run("train_torch:train", num_workers=4, args=(cfg,), address="auto")  # rank 0's

The training function is what you would run under horovodrun: it calls hvdp_torch.init() (or hvdp_keras's)
and trains; run() returns rank 0's return value (all_ranks=True: every rank's, in rank order, as
RayExecutor.run does). It is a function (pickled to the workers) or "module:function", imported only on
the workers. Each rank is an actor holding cpus_per_worker CPUs (and gpus_per_worker GPUs). run_elastic()
is Horovod's elastic mode on Ray (RayExecutor with min_workers/max_workers; PyTorch: hvdp_torch.ElasticState
and elastic_run): the job goes on when a node or an actor is lost and grows when the cluster does.

hvdp connects to the cluster (`address`, RAY_ADDRESS, or the ray.init() you made), refusing an address
nobody answers at within 5 s instead of waiting on it; names the resources the cluster lacks when Ray
cannot place the workers within start_timeout; and gives an elastic job the interface the cluster runs on
(Horovod's elastic driver otherwise waits for a second host to probe one, forever on a one-node cluster).
Importing this module imports neither ray nor Horovod.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

from hvdp._launch import require, training_function
from hvdp.core.clusters import (check_count, elastic_bounds, nic_set, no_interface_message, pick_results,
                                shared_interface, split_address)
from hvdp.core.errors import ConfigError, SetupError

RAY = "pip install ray (the version in constraints.txt; `make setup` installs it)"
HOROVOD = "run `make setup`, which builds Horovod with the Ray launcher's fixes"
CONNECT_TIMEOUT = 5.0  # seconds for the cluster's head to accept a TCP connection


def connect(address: str | None = None):
    """Connect this driver to a Ray cluster, once: the ray module, initialised.

    Args:
        address: the head's "host:port" (its GCS, 6379 by default), "auto" (the cluster this node belongs
            to), "local" (start a one-node Ray here), or "ray://host:10001" (Ray Client); default None:
            RAY_ADDRESS. Ignored when ray.init() was already called.

    Returns:
        The ray module.

    Raises:
        ConfigError: no address anywhere, or a malformed one.
        SetupError: nothing answers at the address, Ray found no cluster there, or ray is not installed.
    """
    ray = require("ray", RAY)
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError("no Ray cluster to run on: pass address='head-host:6379' ('auto' on a node of a "
                          "running cluster, 'local' to start one here), set RAY_ADDRESS, or call ray.init() first")
    if address not in ("auto", "local") and "://" not in address:
        host, port = split_address(address)
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
        except OSError as e:
            raise SetupError(f"cannot reach the Ray cluster at {address} ({type(e).__name__}: {e}): start its head "
                             f"there (`ray start --head --port {port}`) or fix the address") from e
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise SetupError(f"cannot connect to a Ray cluster at address={address!r}: {e}. Start one (`ray start "
                         f"--head`), or pass the head's host:port") from e
    return ray


def _interface(ray) -> str:
    import psutil  # a Horovod dependency

    nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive", n.get("alive")))
    here = ray.util.get_node_ip_address()
    interfaces = {name: [(a.address, a.netmask) for a in addrs if a.family == socket.AF_INET]
                  for name, addrs in psutil.net_if_addrs().items()}
    name = shared_interface(nodes, interfaces, here)
    if name is None:
        raise ConfigError(no_interface_message(nodes, interfaces, here))
    return name


def _execute(ray, executor, fn, args, kwargs, env, launcher: str, wanted: str) -> list:
    """Start the executor, run fn on every worker, always shut it down (a pending placement group left
    behind would hold the cluster's CPUs); a start that times out is a SetupError naming the resources."""
    try:
        try:
            executor.start(extra_env_vars=dict(env or {}))
        except Exception as e:  # noqa: BLE001 - Horovod's TimeoutError, or its TimeoutException (elastic)
            if not isinstance(e, TimeoutError) and type(e).__name__ != "TimeoutException":
                raise
            raise SetupError(f"{launcher}: Ray could not start {wanted} in time; the cluster has "
                             f"{ray.cluster_resources()} in all, {ray.available_resources()} free ({e}). Add "
                             f"nodes, ask for fewer workers or CPUs per worker, or a longer timeout") from e
        return executor.run(fn, args=list(args), kwargs=dict(kwargs or {}))
    finally:
        try:
            executor.shutdown()
        except Exception as e:  # noqa: BLE001 - never hide the error that brought us here
            print(f"hvdp: {launcher}: shutting the Horovod executor down failed: {type(e).__name__}: {e}",
                  file=sys.stderr)


def run(train_fn: Callable | str, *, num_workers: int, args: Sequence = (), kwargs: Mapping[str, Any] | None = None,
        address: str | None = None, cpus_per_worker: int = 1, gpus_per_worker: int = 0,
        nics: str | Iterable[str] | None = None, env: Mapping[str, str] | None = None, start_timeout: int = 100,
        all_ranks: bool = False) -> Any:
    """Run `train_fn(*args, **kwargs)` as `num_workers` Horovod ranks on Ray actors (horovod.ray.RayExecutor,
    Gloo), placed by one placement group; returns when every rank has.

    Args:
        train_fn: the training function, or "module:function" (imported on the workers only); it calls
            hvdp_torch.init() (or hvdp_keras.init()) and returns a picklable value.
        num_workers: the number of ranks.
        args: positional arguments for train_fn (default none).
        kwargs: keyword arguments for train_fn (default None: none).
        address: the cluster to connect to, as connect() takes it (default None: RAY_ADDRESS, or the
            ray.init() already made).
        cpus_per_worker: CPUs each rank's actor holds (default 1).
        gpus_per_worker: GPUs each holds (default 0: CPU training).
        nics: the network interface(s) the ranks talk over (default None: Horovod probes them).
        env: environment variables set in the workers before train_fn runs (default None).
        start_timeout: seconds for Ray to place every worker (default 100, Horovod's).
        all_ranks: return every rank's result, in rank order, instead of rank 0's (default False).

    Returns:
        Rank 0's return value, or with all_ranks the list of every rank's.

    Raises:
        ConfigError: a bad argument, or no cluster address.
        SetupError: the cluster cannot be reached, or could not place the workers within start_timeout
            (naming its total and free resources), or ray or Horovod's Ray support is missing.
    """
    n = check_count("num_workers", num_workers)
    fn = training_function(train_fn, "hvdp.ray.run")
    ray = connect(address)
    horovod_ray = require("horovod.ray", HOROVOD)
    settings = horovod_ray.RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=start_timeout,
                                                       nics=nic_set(nics))
    executor = horovod_ray.RayExecutor(settings, num_workers=n, cpus_per_worker=cpus_per_worker,
                                       use_gpu=gpus_per_worker > 0, gpus_per_worker=gpus_per_worker or None)
    results = _execute(ray, executor, fn, args, kwargs, env, "hvdp.ray.run",
                       f"{n} workers of {cpus_per_worker} CPU(s) and {gpus_per_worker} GPU(s)")
    return pick_results(results, all_ranks, "hvdp.ray.run")


def run_elastic(train_fn: Callable | str, *, max_workers: int, min_workers: int = 1, args: Sequence = (),
                kwargs: Mapping[str, Any] | None = None, address: str | None = None, cpus_per_worker: int = 1,
                gpus_per_worker: int = 0, nics: str | Iterable[str] | None = None,
                env: Mapping[str, str] | None = None, elastic_timeout: int = 600, reset_limit: int | None = None,
                cooldown_range: tuple[int, int] | None = None, all_ranks: bool = False) -> Any:
    """Run an elastic `train_fn(*args, **kwargs)` on Ray (RayExecutor with min_workers/max_workers): it starts
    on min_workers ranks, grows to max_workers as the cluster has room, and goes on when an actor or a
    node is lost.

    train_fn is the whole job, called as train_fn(*args, **kwargs) on every worker: it calls init(), builds the
    model, the ElasticState and an @hvdp_torch.elastic_run loop, and calls that loop. Horovod counts a
    Ray node (its address) as a host: a worker that dies gets its node blacklisted, for good unless
    cooldown_range lets it back.

    Args:
        train_fn: the training function, or "module:function" (imported on the workers only).
        max_workers: most ranks.
        min_workers: fewest ranks training goes on with, and how many it starts with (default 1).
        args: positional arguments for train_fn (default none).
        kwargs: keyword arguments for train_fn (default None: none).
        address: the cluster, as connect() takes it (default None).
        cpus_per_worker: CPUs each rank's actor holds; a node offers CPUs // this many slots (default 1).
        gpus_per_worker: GPUs each holds (default 0).
        nics: the network interface(s) the ranks talk over (default None: the interface holding this
            driver's cluster address, assumed to be named alike on every node).
        env: environment variables set in the workers (default None).
        elastic_timeout: seconds to wait for min_workers slots, at the start and after a reset (default 600).
        reset_limit: end the job after this many resets (default None: no limit).
        cooldown_range: (min, max) seconds a failed node stays blacklisted (default None: for good).
        all_ranks: return the final ranks' results, in rank order, instead of rank 0's (default False).

    Returns:
        The final world's rank 0 result, or with all_ranks every final rank's.

    Raises:
        ConfigError: a bad argument (1 <= min_workers <= max_workers), no cluster address, or no interface
            that the nodes share could be found (pass nics then).
        SetupError: the cluster cannot be reached or never offered min_workers slots within elastic_timeout,
            or ray or Horovod's Ray support is missing.
    """
    _, low, high = elastic_bounds(min_workers, min_workers, max_workers,
                                  names=("min_workers", "min_workers", "max_workers"))
    fn = training_function(train_fn, "hvdp.ray.run_elastic")
    ray = connect(address)
    horovod_ray = require("horovod.ray", HOROVOD)
    settings = horovod_ray.RayExecutor.create_settings(timeout_s=30, nics=nic_set(nics) or {_interface(ray)})
    executor = horovod_ray.RayExecutor(settings, min_workers=low, max_workers=high, cpus_per_worker=cpus_per_worker,
                                       use_gpu=gpus_per_worker > 0, gpus_per_worker=gpus_per_worker or None,
                                       reset_limit=reset_limit, cooldown_range=cooldown_range,
                                       elastic_timeout=elastic_timeout)
    results = _execute(ray, executor, fn, args, kwargs, env, "hvdp.ray.run_elastic",
                       f"{low} workers of {cpus_per_worker} CPU(s) and {gpus_per_worker} GPU(s)")
    return pick_results(results, all_ranks, "hvdp.ray.run_elastic")


__all__ = ["connect", "run", "run_elastic"]
