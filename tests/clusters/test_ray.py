"""hvdp.ray on a real Ray cluster (a head and a second node, one CPU each, see conftest.py): the main job run
by examples/train_on_cluster.py as a user would, an elastic job that loses a worker mid-training, and the
errors that replace Horovod's hangs and Ray's long waits.

The elastic job is launched from this pytest process (connected to the cluster as a driver); the example
is a driver process of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

import hvdp.ray
from hvdp.core.errors import SetupError
from tests.clusters.checks import CFG, check_elastic, check_replicas, run_losing_a_worker
from tests.clusters.procs import free_port
from tests.clusters.jobs import record
from tests.launch import ROOT, env, result_line

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples" / "train_on_cluster.py"


def test_example_trains_the_keras_job_on_two_ray_nodes(ray_cluster):
    """Two ranks, one per node (each node has one CPU, each rank takes one): Keras model.fit, bit-identical."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(EXAMPLE), "ray", "--address", ray_cluster, "--workers", "2",
                           "--framework", "keras", "--epochs", str(CFG.epochs)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    ranks = [json.loads(m) for m in re.findall(r"^rank \d+: (\{.*\})$", proc.stdout, re.M)]
    check_replicas(ranks, 2)
    assert result_line(proc.stdout)["framework"] == "keras"
    print(f"{ranks[0]} in {time.monotonic() - started:.1f}s")


def test_elastic_job_goes_on_when_a_worker_is_killed(ray_cluster, tmp_path):
    """min 1, max 2 ranks, no nics given (hvdp gives Horovod the interface of the cluster's addresses):
    rank 1's actor is SIGKILLed after epoch 0; its node is blacklisted (no cool-down), rank 0 trains the
    remaining epochs alone: world sizes [2, 1]."""
    started = time.monotonic()
    results, killed, progress = run_losing_a_worker(hvdp.ray.run_elastic, tmp_path, min_workers=1, max_workers=2,
                                                    elastic_timeout=120)
    sizes = check_elastic(results, killed, progress)
    assert sizes == [2, 1], sizes
    print(f"world sizes {sizes}; {results[0]} in {time.monotonic() - started:.1f}s")


def _free_cpus_back_to_two() -> None:
    import ray
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, f"CPUs not released: {ray.available_resources()}"
        time.sleep(0.2)


def test_workers_the_cluster_cannot_place_are_an_error_that_leaves_nothing_pending(ray_cluster):
    """Horovod left the placement group it gave up on pending, to be placed (and hold the CPUs for nobody)
    once the cluster grows; build_horovod.sh fix 6 removes it."""
    import ray
    started = time.monotonic()
    with pytest.raises(SetupError, match=r"hvdp.ray.run: Ray could not start 3 workers of 1 CPU\(s\) and 0 GPU\(s\) "
                                         r"in time; the cluster has .*'CPU': 2\.0"):
        hvdp.ray.run(record, num_workers=3, start_timeout=3)
    assert time.monotonic() - started < 30
    left = {k: g["state"] for k, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}
    assert not left, f"placement groups left behind: {left}"
    _free_cpus_back_to_two()


def test_elastic_start_timeout_is_an_error_and_the_executor_shuts_down(ray_cluster, capfd):
    """Horovod's ElasticAdapter.shutdown() asserted the driver had finished, so after this timeout it raised
    AssertionError (build_horovod.sh fix 6 stops the driver instead)."""
    with pytest.raises(SetupError, match=r"hvdp.ray.run_elastic: Ray could not start 3 workers .*enough resources "
                                         r"to run at least 3 Horovod processes"):
        hvdp.ray.run_elastic(record, min_workers=3, max_workers=3, elastic_timeout=3)
    out = capfd.readouterr()
    assert "shutting the Horovod executor down failed" not in out.out + out.err, out.out[-3000:] + out.err[-3000:]
    _free_cpus_back_to_two()


@pytest.mark.parametrize("address,message", [
    (None, "no Ray cluster to run on: pass address="),
    ("127.0.0.1:{port}", "cannot reach the Ray cluster at 127.0.0.1:{port} (ConnectionRefusedError"),
    ("127.0.0.1:notaport", "address='127.0.0.1:notaport': expected host:port of the Ray head"),
])
def test_no_cluster_is_refused_at_once(tmp_path, address, message):
    port = free_port()
    argv = [sys.executable, str(EXAMPLE), "ray", "--epochs", "1"]
    if address:
        argv += ["--address", address.format(port=port)]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={k: v for k, v in env().items() if k != "RAY_ADDRESS"})
    assert proc.returncode == 1 and f"error: {message.format(port=port)}" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
