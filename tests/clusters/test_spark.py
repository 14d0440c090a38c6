"""hvdp.spark on a real Spark cluster (local-cluster[2,1,1024]: two executors of one core, see conftest.py):
the main job's model trained by two ranks in two Spark tasks, an elastic job that loses a task mid-training,
and the errors that replace Horovod's late failures and silent waits.

The driver is this pytest process; the training functions go by name ("train_torch:train") and are
imported by the ranks, which the executors start with the tests' PYTHONPATH.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import hvdp.spark
from hvdp.core.errors import SetupError
from tests.clusters.checks import CFG, check_elastic, check_replicas, run_losing_a_worker
from tests.clusters.jobs import record
from tests.clusters.procs import free_port
from tests.launch import env

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_main_job_trains_as_two_spark_tasks(spark, framework):
    started = time.monotonic()
    results = hvdp.spark.run(f"train_{framework}:train", num_proc=2, args=(CFG,), all_ranks=True)
    print(f"{framework}: {results[0]} in {time.monotonic() - started:.1f}s")
    check_replicas(results, 2)


def test_elastic_job_goes_on_when_a_task_is_killed(spark, tmp_path):
    """min 1, max 2 ranks: rank 1's process is SIGKILLed after epoch 0; its Spark task fails (Spark runs it
    again, as a new host to Horovod), the job goes on and ends all 12 epochs with every final rank's weights
    equal."""
    started = time.monotonic()
    results, killed, progress = run_losing_a_worker(
        hvdp.spark.run_elastic, tmp_path, num_proc=2, min_num_proc=1, max_num_proc=2, start_timeout=120,
        elastic_timeout=120)
    sizes = check_elastic(results, killed, progress)
    print(f"world sizes {sizes}; {results[0]} in {time.monotonic() - started:.1f}s")


def test_fewer_task_slots_than_ranks_is_an_error_not_a_silent_wait(spark):
    started = time.monotonic()
    with pytest.raises(SetupError, match=r"needs 3 training processes running at once, and the cluster offered "
                                         r"2 slot\(s\) after [34]s\. .*master local-cluster\[2,1,1024\]"):
        hvdp.spark.run(record, num_proc=3, start_timeout=3)
    assert time.monotonic() - started < 30


def test_an_unreachable_master_is_refused_at_once(tmp_path):
    port = free_port()
    started = time.monotonic()
    proc = _python(["-c", f"import hvdp.spark; hvdp.spark.session('spark://127.0.0.1:{port}')"], tmp_path)
    assert proc.returncode == 1
    assert f"SetupError: cannot reach the Spark master at spark://127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - started < 30


def _python(argv: list, tmp_path, environ: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=environ or env())


LAUNCH = 'import hvdp.spark\n\ndef train():\n    return 0\n\n'


@pytest.mark.parametrize("guarded", [False, True])
def test_an_mpi_launch_outside_a_main_guard_is_refused_before_anything_starts(tmp_path, guarded):
    """Without the guard, horovod.spark's MPI launcher re-runs the script in spawned helpers (a second
    Spark session, then "horovod does not find an installed MPI"); hvdp names the line. With the guard the
    check passes, and the next one (no SparkSession in that fresh process) speaks."""
    script = tmp_path / "driver.py"
    call = 'hvdp.spark.run(train, num_proc=2, controller="mpi")\n'
    script.write_text(LAUNCH + ('if __name__ == "__main__":\n    ' + call if guarded else call))
    proc = _python([script], tmp_path)
    assert proc.returncode == 1
    if guarded:
        assert "ConfigError: no active SparkSession" in proc.stderr, proc.stderr[-3000:]
    else:
        assert f"hvdp.spark.run was called at {script}:6, outside an `if __name__ == \"__main__\":` block" \
            in proc.stderr, proc.stderr[-3000:]
        assert "multiprocessing's spawn" in proc.stderr


@pytest.mark.parametrize("java_home,why", [(None, "JAVA_HOME is unset and there is no java on PATH"),
                                           ("/nonexistent", "JAVA_HOME=/nonexistent has no bin/java")])
def test_no_java_says_how_to_install_it(tmp_path, java_home, why):
    environ = {k: v for k, v in env().items() if k != "JAVA_HOME"} | {"PATH": str(tmp_path)}
    if java_home:
        environ["JAVA_HOME"] = java_home
    proc = _python(["-c", "import hvdp.spark; hvdp.spark.session('local[1]')"], tmp_path, environ)
    assert proc.returncode == 1
    assert f"SetupError: Spark needs Java 17 or newer, and none was found ({why})" in proc.stderr, proc.stderr[-2000:]
    assert "apt-get install openjdk-17-jre-headless" in proc.stderr
