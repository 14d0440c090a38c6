"""hvdp.tensorflow and hvdp.keras under real launchers: one launch per controller runs every check in worker_tf.py."""

from pathlib import Path

import pytest

from tests.launch import run_checks
from tests.tensorflow import worker_tf_checks

WORKER = Path(__file__).with_name("worker_tf.py")


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    return request.param, run_checks(request.param, WORKER, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("name", worker_tf_checks())
def test_tf_check(results, name):
    launcher, checks = results
    assert name in checks, f"{name} did not run under {launcher}"
    failures = {rank: res for rank, res in checks[name].items() if res != "ok"}
    assert not failures, f"{name} under {launcher}:\n" + "\n".join(f"rank {r}: {t}" for r, t in failures.items())
