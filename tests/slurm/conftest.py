"""A real Slurm cluster for the tests in this directory: munged, slurmctld and two slurmd (nodes n1 and n2) on
this host, started once for the session and stopped by PID afterwards (tests/slurm/cluster.py). Without the
Slurm packages or root the tests are skipped, saying why."""

from __future__ import annotations

import shutil

import pytest

from tests.slurm import cluster as slurm_cluster


@pytest.fixture(scope="session")
def slurm():
    """The running Cluster: its env() and run() talk to it; both nodes idle."""
    reason = slurm_cluster.why_not()
    if reason:
        pytest.skip(reason)
    cluster = slurm_cluster.start(slurm_cluster.make_workdir())
    print(f"\nslurm: munged, slurmctld and 2 slurmd up, nodes idle, in {cluster.started_in:.2f} s")
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)
        shutil.rmtree(cluster.workdir, ignore_errors=True)
