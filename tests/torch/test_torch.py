"""hvdp.torch under real launchers: one launch per controller runs every check in worker_torch.py."""

from pathlib import Path

import pytest

from tests.launch import run_checks
from tests.torch import worker_torch_checks

WORKER = Path(__file__).with_name("worker_torch.py")


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    return request.param, run_checks(request.param, WORKER, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("name", worker_torch_checks())
def test_torch_check(results, name):
    launcher, checks = results
    assert name in checks, f"{name} did not run under {launcher}"
    failures = {rank: res for rank, res in checks[name].items() if res != "ok"}
    assert not failures, f"{name} under {launcher}:\n" + "\n".join(f"rank {r}: {t}" for r, t in failures.items())
