"""The straggler report on Keras's fit (issue 47; hvdp/_keras_steps.py) under real launchers: a rank slow in its
input or in its compute is named with its cause within two periods, steps_per_execution 1 and 4, and a balanced
run names nobody (tests/tensorflow/worker_keras_stragglers.py, one launch per controller and backend)."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks, skip_without_mpi

WORKER = Path(__file__).with_name("worker_keras_stragglers.py")
LAUNCHES = [("mpi", 2, "tensorflow"), ("gloo", 3, "tensorflow"), ("gloo", 2, "torch")]


@pytest.fixture(scope="module", params=LAUNCHES, ids=lambda p: f"{p[0]}-np{p[1]}-{p[2]}")
def results(request, tmp_path_factory):
    launcher, np_, backend = request.param
    skip_without_mpi(launcher)
    return launcher, run_checks(launcher, WORKER, tmp_path_factory.mktemp(f"{launcher}{np_}-{backend}"), np=np_,
                                timeout=420, extra_env={"KERAS_BACKEND": backend,
                                                        "OMPI_MCA_mpi_yield_when_idle": "1"})


@pytest.mark.parametrize("name", check_names(WORKER))
def test_keras_stragglers_check(results, name):
    assert_passed(results, name)
