"""A Spark cluster and a Ray cluster on this machine, each with two worker nodes, for hvdp.spark and hvdp.ray.

    spark: local-cluster[2,1,1024]: a standalone master and two workers inside the driver's JVM, each worker
           starting its own executor JVM with one core, so the two ranks are tasks on two executors.
    ray:   `ray start --head` (node 127.0.0.1) and `ray start --address` (node 127.0.0.2: another loopback
           address of this machine, so Ray and Horovod count two nodes, as on two hosts), one CPU each, so
           the two ranks are actors on two raylets.

Both are real clusters on one host; the namespace hosts of tests/multihost would give each node its own
network. Every process they start is ended afterwards, even on failure: Spark's JVMs and Python workers are
descendants of the gateway JVM, Ray's are in the session of each `ray start --block`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import BIN, ROOT, env

RAY_NODES = ("127.0.0.1", "127.0.0.2")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (children, theirs, ...)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def in_session(sid: int) -> list[int]:
    """The processes whose session id is `sid` (what one start_new_session Popen and its children became)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill(pids, sig=signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    """What the Spark executors and Ray raylets (so every rank) inherit: the tests' PYTHONPATH (hvdp, tests/,
    examples/) and one intra-op thread per rank."""
    return {k: v for k, v in env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
                                                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")}


@pytest.fixture(scope="module")
def spark():
    """An active SparkSession on local-cluster[2,1,1024], stopped and its JVMs ended afterwards."""
    import hvdp.spark
    from pyspark import SparkContext

    saved = {k: os.environ.get(k) for k in _worker_env()}
    os.environ.update(_worker_env())  # the gateway JVM, and so every executor, starts with these
    session = None
    try:
        session = hvdp.spark.session("local-cluster[2,1,1024]", app_name="hvdp tests",
                                     conf={"spark.ui.enabled": "false", "spark.driver.memory": "512m",
                                           "spark.executor.memory": "768m", "spark.ui.showConsoleProgress": "false"})
        yield session
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gateway = SparkContext._gateway
        proc = getattr(gateway, "proc", None)
        below = descendants(proc.pid) if proc else []
        if session is not None:
            session.stop()
        if gateway is not None:
            gateway.shutdown()
            SparkContext._gateway = SparkContext._jvm = None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill(below)


def _ray_start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--disable-usage-stats", "--num-cpus", "1",
                             "--object-store-memory", str(80 << 20), *args],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                            env={**env(), **_worker_env()})


def _ray_stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # ray start --block then stops the processes it started
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    kill(in_session(proc.pid))
    proc.wait()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The Ray head's address, with a second node joined and this process connected as the driver."""
    import ray

    import hvdp.ray

    logs = tmp_path_factory.mktemp("ray")
    port = free_port()
    address = f"{RAY_NODES[0]}:{port}"
    nodes = []
    try:
        nodes.append(_ray_start(["--head", "--node-ip-address", RAY_NODES[0], "--port", str(port),
                                 "--include-dashboard", "false", "--temp-dir", str(logs / "tmp")], logs / "head.log"))
        deadline = time.monotonic() + 120
        while True:  # the head's GCS answers
            try:
                socket.create_connection((RAY_NODES[0], port), timeout=1).close()
                break
            except OSError:
                assert nodes[0].poll() is None, (logs / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (logs / "head.log").read_text()[-3000:]
                time.sleep(0.5)
        nodes.append(_ray_start(["--address", address, "--node-ip-address", RAY_NODES[1]], logs / "worker.log"))
        hvdp.ray.connect(address)
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert nodes[1].poll() is None, (logs / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{ray.nodes()}\n{(logs / 'worker.log').read_text()[-3000:]}"
            time.sleep(0.5)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(nodes):
            _ray_stop(node)
