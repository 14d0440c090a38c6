"""hvdp.keras on Keras's PyTorch backend (KERAS_BACKEND=torch) under real launchers: one launch per controller
runs every check in worker_keras_torch.py (model.fit on N ranks with batch b equals one process with batch N*b,
the epoch's short last step included; gradients and the initial state go through horovod.torch)."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks, skip_without_mpi

WORKER = Path(__file__).with_name("worker_keras_torch.py")


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    skip_without_mpi(request.param)
    return request.param, run_checks(request.param, WORKER, tmp_path_factory.mktemp(request.param), timeout=300,
                                     extra_env={"KERAS_BACKEND": "torch"})


@pytest.mark.parametrize("name", check_names(WORKER))
def test_keras_torch_check(results, name):
    assert_passed(results, name)
