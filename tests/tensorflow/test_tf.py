"""hvdp.tensorflow and hvdp.keras under real launchers: one launch per controller runs every check in worker_tf.py."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks

WORKER = Path(__file__).with_name("worker_tf.py")


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    return request.param, run_checks(request.param, WORKER, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("name", check_names(WORKER))
def test_tf_check(results, name):
    assert_passed(results, name)
