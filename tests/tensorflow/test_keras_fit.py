"""hvdp.keras's model.fit as users write it (issue 50: callbacks that stop one rank, Keras's own checkpoint and
logging callbacks, SyncBatchNormalization at large input means, evaluate with loss objects, ratio metrics), under
real launchers on both Keras backends: one launch per controller and backend runs every check in
worker_keras_fit.py."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks, skip_without_mpi

WORKER = Path(__file__).with_name("worker_keras_fit.py")


@pytest.fixture(scope="module", params=[("mpi", "tensorflow"), ("gloo", "tensorflow"), ("mpi", "torch"),
                                        ("gloo", "torch")], ids=lambda p: "-".join(p))
def results(request, tmp_path_factory):
    launcher, backend = request.param
    skip_without_mpi(launcher)
    return launcher, run_checks(launcher, WORKER, tmp_path_factory.mktemp(f"{launcher}-{backend}"), timeout=420,
                                extra_env={"KERAS_BACKEND": backend})


@pytest.mark.parametrize("name", check_names(WORKER))
def test_keras_fit_check(results, name):
    assert_passed(results, name)
