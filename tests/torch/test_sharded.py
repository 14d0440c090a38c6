"""prepare(..., shard_optimizer_state=True) under real launchers: np=2 and np=3, MPI and Gloo, and checkpoints
carried across world sizes (3 -> 2 -> 1): one launch each runs the checks of worker_sharded.py."""

from pathlib import Path

import pytest

from tests.checks import assert_passed, check_names
from tests.launch import run_checks

WORKER = Path(__file__).with_name("worker_sharded.py")
# the streamed checkpoint (300+ MB of optimizer state; rank 0's write failing): once, in mpi-np2
ONCE = ["checkpoint_streams_in_bounded_memory", "streamed_save_failure_is_raised_on_every_rank"]
# bf16 and hvdp_torch.compile (each launch compiles anew: seconds): at np=3 under Gloo and np=2 under MPI
COMPOSED = ["bf16_parameters_and_compile_compose"]
EXACT = [n for n in check_names(WORKER)
         if n not in ("save_for_another_world", "resume_from_another_world", *ONCE, *COMPOSED)]
# (launcher, np, checks, resume from the checkpoints of launch #, save its own): in this order
LAUNCHES = {
    "gloo-np3": ("gloo", 3, EXACT + COMPOSED + ["save_for_another_world"], None),
    "mpi-np2": ("mpi", 2, EXACT + ONCE + COMPOSED + ["resume_from_another_world", "save_for_another_world"],
                "gloo-np3"),
    "python-np1": ("python", 1, ["resume_from_another_world"], "mpi-np2"),
    "gloo-np2": ("gloo", 2, EXACT, None),
    "mpi-np3": ("mpi", 3, EXACT, None),
}
_done: dict = {}


def _launch(name: str, base: Path) -> tuple[str, dict]:
    if name not in _done:
        launcher, np, checks, source = LAUNCHES[name]
        env = {"HVDP_CHECKS": ",".join(checks), "HVDP_SAVE_TO": str(base / name)}
        if source is not None:
            _launch(source, base)
            env["HVDP_RESUME_FROM"] = str(base / source)
        tmp = base / f"{name}-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            _done[name] = (launcher, run_checks(launcher, WORKER, tmp, np=np, extra_env=env))
        except AssertionError as e:  # no results: every check of this launch fails with why, launched once
            _done[name] = e
    if isinstance(_done[name], AssertionError):
        raise _done[name]
    return _done[name]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


@pytest.mark.parametrize("name", [(launch, check) for launch, (_, _, checks, _) in LAUNCHES.items()
                                  for check in checks], ids=lambda p: f"{p[0]}-{p[1]}")
def test_sharded_check(base, name):
    launch, check = name
    assert_passed(_launch(launch, base), check)


def test_the_state_is_rebuilt_from_rank_0s_commit_only():
    """sharded_elastic.sources: who sends each former rank's slice after a reset, from each new rank's (former
    world size, commit serial, slices it holds). A worker lost mid-commit can leave one survivor a commit ahead
    of another; the slices must all come from rank 0's commit (whose model sync() gives everyone), or none."""
    from hvdp.core.errors import CheckpointError
    from hvdp.torch.sharded_elastic import sources
    # Two of three survive, at the same commit: each slice from the lowest rank holding it.
    assert sources([(3, 5, [0, 2]), (3, 5, [0, 1])]) == (3, {0: 0, 2: 0, 1: 1})
    # A joined worker holds none; rank 0 a commit ahead of rank 1, holding every slice itself: from rank 0 only.
    assert sources([(2, 6, [0, 1]), (2, 5, [0, 1]), None]) == (2, {0: 0, 1: 0})
    # Rank 0 a commit ahead, and former rank 1's slice held only by a rank one commit behind: refused, not mixed.
    with pytest.raises(CheckpointError, match=r"former rank\(s\) \[1\] of 3 .*\(#6; others hold #5: a worker was lost"):
        sources([(3, 6, [0, 2]), (3, 5, [1])], rank=1)
    # Rank 0 joined (no commit): the newest commit the others hold.
    assert sources([None, (2, 4, [0]), (2, 5, [0, 1])]) == (2, {0: 2, 1: 2})
    with pytest.raises(CheckpointError, match=r"former rank\(s\) \[1\] of 3 was lost: each rank's slice is kept"):
        sources([(3, 5, [0, 2]), None])
    with pytest.raises(CheckpointError, match=r"different world sizes \[2, 3\]"):
        sources([(3, 5, [0, 2]), (2, 5, [0, 1])])
