"""The straggler report (issue 47) under real launchers: np=2 and np=3, MPI and Gloo, one launch each
(tests/torch/worker_stragglers.py): a rank slow in its input, in its compute, or on a host made slow by a CPU
hog is named with its cause within two periods; a balanced run names nobody, and its recorded per-step times,
re-cut into periods 20 ways, name nobody either. Open MPI yields while it waits
(OMPI_MCA_mpi_yield_when_idle=1), or at np=3 the ranks sharing the other CPU slow each other in their waits."""

import json
from pathlib import Path

import numpy as np
import pytest

from hvdp.core.stragglers import Detector, summarize
from tests.checks import assert_passed, check_names
from tests.launch import run_checks


WORKER = Path(__file__).with_name("worker_stragglers.py")
LAUNCHES = [("mpi", 2), ("gloo", 2), ("mpi", 3), ("gloo", 3)]


@pytest.fixture(scope="module", params=LAUNCHES, ids=[f"{launcher}-np{np_}" for launcher, np_ in LAUNCHES])
def results(request, tmp_path_factory):
    launcher, np_ = request.param
    tmp = tmp_path_factory.mktemp(f"{launcher}{np_}")
    return launcher, run_checks(launcher, WORKER, tmp, np=np_, timeout=300,
                                        extra_env={"OMPI_MCA_mpi_yield_when_idle": "1"}), tmp, np_


@pytest.mark.parametrize("name", check_names(WORKER))
def test_stragglers_check(results, name):
    launcher, checks, _, _ = results
    assert_passed((launcher, checks), name)


def recut(run: dict, repetitions: int = 20, seed: int = 0) -> int:
    """Findings of the rule over `repetitions` re-cuts of a balanced run's recorded steps: a random start
    and the ranks in a random order each time."""
    rng = np.random.default_rng(seed)
    ranks = [np.asarray(r) for r in run["steps"]]
    n, period = min(len(r) for r in ranks), run["period"]
    found = 0
    for _ in range(repetitions):
        start, order, detector = int(rng.integers(0, period)), rng.permutation(len(ranks)), Detector()
        for p in range(start, n - period + 1, period):
            found += len(detector.update([summarize([tuple(s) for s in ranks[r][p:p + period]]) for r in order]))
    return found


def test_balanced_recorded_steps_name_nobody_in_20_recuts(results):
    launcher, checks, tmp, np_ = results
    assert_passed((launcher, checks), "balanced_run_names_nobody")
    run = json.loads((tmp / f"balanced-{np_}.json").read_text())
    assert recut(run) == 0
