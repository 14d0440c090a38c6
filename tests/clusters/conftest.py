"""A Spark cluster and a Ray cluster on this machine, each with two worker nodes, for hvdp.spark and hvdp.ray.

    spark: local-cluster[2,1,1024]: a standalone master and two workers inside the driver's JVM, each worker
           starting its own executor JVM with one core, so the two ranks are tasks on two executors.
    ray:   `ray start --head` (its node on this machine's address) and `ray start --address` (node 127.0.0.2,
           a loopback address of this machine: Ray and Horovod count two nodes, as on two hosts), one CPU
           each, so the two ranks are actors on two raylets.

Both are real clusters, on one host; the namespace hosts of tests/multihost would give each node its own
network. Every process they start is ended afterwards, even on failure (tests/clusters/procs.py).
"""

from __future__ import annotations

import pytest

from tests.clusters.procs import start_ray, start_spark, stop_ray, stop_spark


@pytest.fixture(scope="module")
def spark():
    """An active SparkSession on local-cluster[2,1,1024] with both executors up."""
    session = start_spark()
    try:
        yield session
    finally:
        stop_spark(session)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The Ray head's address, with a second node joined and this process connected as the driver."""
    address, nodes = start_ray(tmp_path_factory.mktemp("ray"))
    try:
        yield address
    finally:
        stop_ray(nodes)
