"""hvdp.lightning under real launchers: one launch per controller runs every check in worker_lightning.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks

WORKER = Path(__file__).with_name("worker_lightning.py")


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    return request.param, run_checks(request.param, WORKER, tmp_path_factory.mktemp(request.param), timeout=300)


@pytest.mark.parametrize("name", check_names(WORKER))
def test_lightning_check(results, name):
    assert_passed(results, name)
