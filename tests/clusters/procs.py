"""Processes the cluster tests (and tests/clusters/startup.py) start and must end: Spark's JVMs, Ray's nodes.

Spark's JVMs and Python workers are descendants of the gateway JVM; Ray's processes are in the session of
each `ray start --block` (started with start_new_session). Only those are ever signalled.
"""

from __future__ import annotations

import builtins
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.launch import BIN, ROOT, env

_PRINT = builtins.print  # the interpreter's own, restored by stop_ray
SPARK_MASTER = "local-cluster[2,1,1024]"  # two workers with one core and 1 GiB each: two executors

# The head's GCS is reached on 127.0.0.1; the head node itself takes the address Ray picks (this machine's
# own, or 127.0.0.1 without a network), the second node 127.0.0.2: two addresses, so two hosts to Horovod.
RAY_HEAD, RAY_NODE = "127.0.0.1", "127.0.0.2"


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
    """Send `sig` to each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """What the Spark executors and Ray raylets (so every rank) inherit: the tests' PYTHONPATH (hvdp, tests/,
    examples/) and one intra-op thread per rank."""
    return {k: v for k, v in env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
                                                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")}


def ray_start(args: list[str], log: Path) -> subprocess.Popen:
    """`ray start --block` with one CPU and `args`, in a session of its own, its output in `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--disable-usage-stats", "--num-cpus", "1",
                                 "--object-store-memory", str(80 << 20), *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                env={**env(), **worker_env()})


def ray_stop(proc: subprocess.Popen) -> None:
    """SIGTERM the `ray start --block` (it stops what it started), then SIGKILL anything left in its session."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # ray start --block then stops what it started, after
        try:                                 # draining the node (up to 30 s on a head): not waited for
            proc.wait(3)
        except subprocess.TimeoutExpired:
            pass
    kill(in_session(proc.pid))
    proc.wait()


def _wait(what: str, ready, deadline: float, log: Path | None = None) -> None:
    while not ready():
        tail = log.read_text()[-3000:] if log and log.exists() else ""
        assert time.monotonic() < deadline, f"no {what} in time\n{tail}"
        time.sleep(0.5)


def start_ray(logs: Path) -> tuple[str, list[subprocess.Popen]]:
    """`ray start --head` and `ray start --address` (node RAY_NODE), one CPU each;
    this process connected as a driver (hvdp.ray.connect) once both nodes are alive. Returns the head's
    address and the two `ray start` processes (for stop_ray), all stopped again if this fails."""
    import ray

    import hvdp.ray

    port, nodes = free_port(), []
    address = f"{RAY_HEAD}:{port}"
    deadline = time.monotonic() + 120

    def head_answers() -> bool:
        assert nodes[0].poll() is None, (logs / "head.log").read_text()[-3000:]
        try:
            socket.create_connection((RAY_HEAD, port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        nodes.append(ray_start(["--head", "--port", str(port),
                                "--include-dashboard", "false", "--temp-dir", str(logs / "tmp")], logs / "head.log"))
        _wait("Ray head", head_answers, deadline, logs / "head.log")
        nodes.append(ray_start(["--address", address, "--node-ip-address", RAY_NODE], logs / "worker.log"))
        hvdp.ray.connect(address)
        _wait("second Ray node", lambda: sum(n["Alive"] for n in ray.nodes()) >= 2, deadline, logs / "worker.log")
    except BaseException:
        stop_ray(nodes)
        raise
    return address, nodes


def stop_ray(nodes: list[subprocess.Popen]) -> None:
    """Disconnect this driver, then end each node's processes (start_ray's). Ray, once this process is its
    driver, replaces builtins.print (ray.train's print redirection), and ray.shutdown() does not put it back:
    it is restored here, or a later test of this pytest process that pickles `print` would fail."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    builtins.print = _PRINT
    for node in reversed(nodes):
        ray_stop(node)


def start_spark():
    """An active SparkSession on SPARK_MASTER whose executors (so every rank) inherit worker_env(), with
    both executors registered. Stopped, and its JVMs ended, by stop_spark."""
    import hvdp.spark

    saved = {k: os.environ.get(k) for k in worker_env()}
    os.environ.update(worker_env())  # the gateway JVM, and so every executor, starts with these
    try:
        session = hvdp.spark.session(SPARK_MASTER, app_name="hvdp tests",
                                     conf={"spark.ui.enabled": "false", "spark.driver.memory": "512m",
                                           "spark.executor.memory": "768m", "spark.ui.showConsoleProgress": "false"})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        jvm = session.sparkContext._jsc.sc()
        _wait("two Spark executors", lambda: jvm.getExecutorMemoryStatus().size() >= 3, time.monotonic() + 120)
    except BaseException:
        stop_spark(session)
        raise
    return session


def stop_spark(session) -> None:
    """Stop the session and the gateway JVM, then kill whatever of its process tree is left (executor JVMs,
    Python workers, ranks)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    below = descendants(proc.pid) if proc else []
    try:
        session.stop()
    finally:
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
