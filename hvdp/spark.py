"""Run an hvdp training function on a Spark cluster, one Horovod rank per Spark task, over horovod.spark.

    import hvdp.spark

    if __name__ == "__main__":
        hvdp.spark.session("spark://head:7077")                  # or the session your platform gives you
        result = hvdp.spark.run("train_torch:train", num_proc=4, args=(cfg,))   # rank 0's return value

The training function is what you would run under horovodrun: it calls hvdp_torch.init() (or hvdp_keras's)
and trains; run() returns rank 0's return value (all_ranks=True: every rank's, in rank order, as
horovod.spark.run does). It is either a function (pickled to the executors with cloudpickle) or the name
"module:function", imported only on the executors, so the driver never loads the framework. run_elastic()
is Horovod's elastic mode (PyTorch: hvdp_torch.ElasticState and elastic_run); each Spark task attempt is
a host of its own there: the others go on when one fails, and Spark runs it again as a new host.

Before Horovod starts, hvdp checks what otherwise fails late or hangs: no Java (session()), no active
SparkSession, a spark:// master nobody answers at (session(); Spark would try for a minute), fewer task
slots than processes (Horovod would wait start_timeout, 600 s, in silence; hvdp says what it waits for
every 10 s and then names the slots it got), a stopped SparkContext, and a launch from a driver script's top level without an
`if __name__ == "__main__":` guard under MPI. Importing this module imports neither pyspark nor Horovod.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from hvdp._launch import check_main_guard, require, training_function, wait_for
from hvdp.core.clusters import (check_controller, check_count, elastic_bounds, nic_set, pick_results,
                                slots_message, spark_masters)
from hvdp.core.errors import ConfigError, SetupError

PYSPARK = "pip install pyspark (the version in constraints.txt; `make setup` installs it)"
HOROVOD = "run `make setup`, which builds Horovod with the Spark launcher's fixes"
NO_JAVA = ("Spark needs Java 17 or newer, and none was found ({why}): install it (Debian/Ubuntu: "
           "`apt-get install openjdk-17-jre-headless`; `make setup` does) or set JAVA_HOME to a JDK/JRE")
WHY_MPI = ("Under MPI, horovod.spark starts helper processes with multiprocessing's spawn method, and each "
           "re-runs the script's top level: a second Spark session and launch, which then fails with "
           "\"horovod does not find an installed MPI\".")


def java(environ: Mapping[str, str] | None = None) -> str | None:
    """The java executable Spark will start: $JAVA_HOME/bin/java when JAVA_HOME is set, else `java` on PATH.

    Args:
        environ: the variables to read (default None: os.environ).

    Returns:
        Its path, or None when there is none.
    """
    env = os.environ if environ is None else environ
    if env.get("JAVA_HOME"):
        path = Path(env["JAVA_HOME"]) / "bin" / "java"
        return str(path) if path.is_file() else None
    return shutil.which("java", path=env.get("PATH", ""))


def session(master: str | None = None, *, app_name: str = "hvdp", conf: Mapping[str, Any] | None = None):
    """Get the active SparkSession, or create one for `master`, after checking that Java is there.

    With a local master ("local[4]", "local-cluster[2,1,1024]") the executors run this Python: PYSPARK_PYTHON
    is set to sys.executable unless it is set already (pyspark reads that variable, not the
    spark.pyspark.python setting, for the executors' Python; without it they run `python3`). On a real
    cluster the executors' Python is the cluster's (it must have hvdp, Horovod and your framework).

    Args:
        master: the Spark master URL ("spark://head:7077", "yarn", "k8s://...", "local-cluster[2,1,1024]");
            default None: the one spark-submit or spark-defaults.conf gives.
        app_name: the application's name in the Spark UI (default "hvdp").
        conf: more Spark settings, {"spark.executor.cores": "4", ...} (default None).

    Returns:
        The pyspark.sql.SparkSession.

    Raises:
        ConfigError: a malformed spark:// master URL.
        SetupError: no Java (JAVA_HOME unset or wrong, no java on PATH), Java could not start Spark, no
            standalone master of a spark:// URL accepts a connection within 5 s (Spark would try for a
            minute before failing), or pyspark is not installed.
    """
    masters = spark_masters(master or "")
    if masters and not any(_answers(host, port) for host, port in masters):
        raise SetupError(f"cannot reach the Spark master at {master}: nothing accepts a connection there. Start it "
                         f"(`$SPARK_HOME/sbin/start-master.sh`) or fix the URL")
    found = java()
    if found is None:
        why = (f"JAVA_HOME={os.environ['JAVA_HOME']} has no bin/java" if os.environ.get("JAVA_HOME")
               else "JAVA_HOME is unset and there is no java on PATH")
        raise SetupError(NO_JAVA.format(why=why))
    require("pyspark", PYSPARK)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    settings = {str(k): str(v) for k, v in (conf or {}).items()}
    if master:
        builder = builder.master(master)
        if master.startswith("local"):
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate()
    except Exception as e:  # pyspark's PySparkRuntimeError [JAVA_GATEWAY_EXITED], or py4j's
        if "JAVA_GATEWAY_EXITED" in str(e) or "Java gateway process exited" in str(e):
            raise SetupError(f"{found} could not start Spark ({e}); its error is printed above. Spark 4 needs "
                             f"Java 17 or newer: {NO_JAVA.split(': ', 1)[1]}") from e
        raise


def _answers(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _context():
    pyspark = require("pyspark", PYSPARK)
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise ConfigError("no active SparkSession: create one before launching (hvdp.spark.session(master), or "
                          "SparkSession.builder.master(...).getOrCreate()); on a Spark platform use its session")
    return sc


def _slots(sc) -> int | None:
    """Tasks Spark can run at once now (executors x cores / spark.task.cpus), or None if it cannot tell."""
    jvm = sc._jsc.sc()
    try:
        return int(jvm.maxNumConcurrentTasks(jvm.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - another Spark's private API: let Horovod wait as it does
        return None


def _wait_for_slots(sc, needed: int, timeout: float, launcher: str) -> None:
    jvm = sc._jsc.sc()

    def ready() -> bool:
        if jvm.isStopped():
            raise SetupError(f"{launcher}: the SparkContext (master {sc.master}) has stopped: its master could "
                             f"not be reached, or the application was killed; the Spark driver log above says "
                             f"which. Fix the master URL or the cluster and create a new session")
        slots = _slots(sc)
        return slots is None or slots >= needed

    def fail(waited: float) -> Exception:
        detail = (f"Spark runs one task per executor core (spark.executor.cores / spark.task.cpus) and every "
                  f"Horovod rank is a task that must run at the same time as the others; master {sc.master}. "
                  f"Give the application more executors or cores, or a longer start_timeout while they start.")
        return SetupError(slots_message(launcher, needed, _slots(sc) or 0, waited, detail))

    wait_for(f"{needed} Spark task slots (master {sc.master})", ready, timeout, fail)


def _start_timeout(start_timeout: float | None) -> float:
    value = start_timeout if start_timeout is not None else os.environ.get("HOROVOD_SPARK_START_TIMEOUT", "600")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"start_timeout={value!r} (or HOROVOD_SPARK_START_TIMEOUT): must be a number of seconds > 0")
    return seconds


def run(train_fn: Callable | str, *, num_proc: int | None = None, args: Sequence = (),
        kwargs: Mapping[str, Any] | None = None, controller: str = "gloo", nics: str | Iterable[str] | None = None,
        env: Mapping[str, str] | None = None, start_timeout: float | None = None, all_ranks: bool = False,
        verbose: int = 1) -> Any:
    """Run `train_fn(*args, **kwargs)` as `num_proc` Horovod ranks, one per Spark task (horovod.spark.run).

    Call it on the Spark driver, with a session active (session()). It returns when every rank has
    returned; an exception on any rank ends the Spark job and is raised here.

    Args:
        train_fn: the training function, or "module:function" (imported on the executors only). It runs in
            a process of its own per rank, started by the executor; it calls hvdp_torch.init() (or
            hvdp_keras.init()) and returns a picklable value.
        num_proc: the number of ranks (default None: spark.default.parallelism).
        args: positional arguments for train_fn (picklable; default none).
        kwargs: keyword arguments for train_fn (default None: none).
        controller: "gloo" (default: nothing but Python needed on the executors) or "mpi" (OpenMPI on the
            driver and every executor host, as for mpirun; the call must then sit under a main guard).
        nics: the network interface(s) the ranks talk over, e.g. "eth0" (default None: Horovod probes the
            ones the tasks share).
        env: environment variables added to the ranks' (default None: the executors' own).
        start_timeout: seconds to wait for the task slots and for the tasks to start (default None:
            HOROVOD_SPARK_START_TIMEOUT, else 600).
        all_ranks: return every rank's result, in rank order, instead of rank 0's (default False).
        verbose: Horovod's verbosity, 0-2 (default 1).

    Returns:
        Rank 0's return value, or with all_ranks the list of every rank's.

    Raises:
        ConfigError: a bad argument, no active SparkSession, or (controller="mpi") a launch from a script's
            top level without an `if __name__ == "__main__":` guard.
        SetupError: the cluster never offered num_proc task slots within start_timeout, the SparkContext
            stopped, or pyspark or Horovod's Spark support is missing.
    """
    check_controller(controller)
    check_main_guard("hvdp.spark.run", WHY_MPI, always=controller == "mpi")
    fn = training_function(train_fn, "hvdp.spark.run")
    sc = _context()
    num_proc = check_count("num_proc", sc.defaultParallelism if num_proc is None else num_proc)
    timeout, started = _start_timeout(start_timeout), time.monotonic()
    _wait_for_slots(sc, num_proc, timeout, "hvdp.spark.run")
    horovod_spark = require("horovod.spark", HOROVOD)
    results = horovod_spark.run(
        fn, args=tuple(args), kwargs=dict(kwargs or {}), num_proc=num_proc, use_gloo=controller == "gloo",
        use_mpi=controller == "mpi", env=dict(env) if env else None, nics=nic_set(nics), verbose=verbose,
        start_timeout=max(1, round(timeout - (time.monotonic() - started))))
    return pick_results(results, all_ranks, "hvdp.spark.run")


def run_elastic(train_fn: Callable | str, *, num_proc: int | None = None, min_num_proc: int | None = None,
                max_num_proc: int | None = None, args: Sequence = (), kwargs: Mapping[str, Any] | None = None,
                nics: str | Iterable[str] | None = None, env: Mapping[str, str] | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, all_ranks: bool = False, verbose: int = 1) -> Any:
    """Run an elastic `train_fn(*args, **kwargs)` on Spark (horovod.spark.run_elastic, Gloo): the job goes on
    with fewer ranks when a task is lost, and grows again (up to max_num_proc) when Spark restarts it.

    train_fn is the whole job, called as train_fn(*args, **kwargs) on every worker: it calls init(), builds the
    model, the ElasticState and an @hvdp_torch.elastic_run loop, and calls that loop (the loop itself, which
    takes the state, is not a train_fn; Keras has no elastic mode). Spark restarts a failed task up to spark.task.maxFailures times (4 by default); each
    attempt joins as a new host.

    Args:
        train_fn: the training function, or "module:function" (imported on the executors only).
        num_proc: ranks to start with (default None: spark.default.parallelism).
        min_num_proc: fewest ranks training goes on with (default None: num_proc, as Horovod: then a lost
            task stops training until Spark has restarted it).
        max_num_proc: most ranks (default None: num_proc); Spark runs this many tasks.
        args: positional arguments for train_fn (default none).
        kwargs: keyword arguments for train_fn (default None: none).
        nics: the network interface(s) the ranks talk over (default None: probed).
        env: environment variables added to the ranks' (default None).
        start_timeout: seconds to wait for the first num_proc task slots and tasks (default None:
            HOROVOD_SPARK_START_TIMEOUT, else 600).
        elastic_timeout: seconds to wait for min_num_proc ranks after a reset (default None:
            HOROVOD_ELASTIC_TIMEOUT, else 600).
        reset_limit: end the job after this many resets (default None: no limit).
        all_ranks: return the final ranks' results, in rank order, instead of rank 0's (default False).
        verbose: Horovod's verbosity, 0-2 (default 1).

    Returns:
        The final world's rank 0 result, or with all_ranks every final rank's.

    Raises:
        ConfigError: a bad argument (min_num_proc <= num_proc <= max_num_proc), or no active SparkSession.
        SetupError: the cluster never offered num_proc task slots within start_timeout, the SparkContext
            stopped, or pyspark or Horovod's Spark support is missing.
    """
    check_main_guard("hvdp.spark.run_elastic", WHY_MPI, always=False)
    fn = training_function(train_fn, "hvdp.spark.run_elastic")
    sc = _context()
    num = sc.defaultParallelism if num_proc is None else num_proc
    num, low, high = elastic_bounds(num, num if min_num_proc is None else min_num_proc, max_num_proc)
    timeout, started = _start_timeout(start_timeout), time.monotonic()
    _wait_for_slots(sc, num, timeout, "hvdp.spark.run_elastic")
    horovod_spark = require("horovod.spark", HOROVOD)
    results = horovod_spark.run_elastic(
        fn, args=tuple(args), kwargs=dict(kwargs or {}), num_proc=num, min_num_proc=low, max_num_proc=high,
        start_timeout=max(1, round(timeout - (time.monotonic() - started))), elastic_timeout=elastic_timeout,
        reset_limit=reset_limit, env=dict(env) if env else None, nics=nic_set(nics), verbose=verbose)
    return pick_results(results, all_ranks, "hvdp.spark.run_elastic")


__all__ = ["java", "run", "run_elastic", "session"]
