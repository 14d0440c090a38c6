"""hvdp.lightning under real launchers: one launch per controller runs every check in worker_lightning.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from hvdp.core.sharding import eval_batches
from tests.checks import assert_passed, check_names
from tests.launch import result_line, run, run_checks

WORKER = Path(__file__).with_name("worker_lightning.py")


TMP = {}  # the launch's folder, by launcher: its checkpoints for test_resume_on_one_process


@pytest.fixture(scope="module", params=["mpi", "gloo"])
def results(request, tmp_path_factory):
    TMP[request.param] = tmp_path_factory.mktemp(request.param)
    return request.param, run_checks(request.param, WORKER, TMP[request.param], timeout=300)


@pytest.mark.parametrize("name", check_names(WORKER))
def test_lightning_check(results, name):
    assert_passed(results, name)


def test_resume_on_one_process_of_a_two_rank_checkpoint(results):
    # the checkpoint the gloo launch wrote (check resumes_at_another_world_size), resumed by plain python
    if results[0] != "gloo":
        pytest.skip("once, from the gloo launch's checkpoint")
    name = "resumes_at_another_world_size"
    assert_passed(results, name)
    resumed = run_checks("python", WORKER, TMP["gloo"], np=1, timeout=300, extra_env={"HVDP_CHECKS": name})
    assert_passed(("python", resumed), name)


PYTORCH_LIGHTNING_CHECKS = ["fit_sgd_equals_one_process_with_the_global_batch",
                            "strategy_by_name_accumulate_and_clip_equal_one_process",
                            "validate_and_test_metrics_count_every_sample_once", "collectives_map_onto_horovod",
                            "fabric_loop_with_clipping_equals_one_process"]


@pytest.fixture(scope="module")
def pytorch_lightning_results(tmp_path_factory):
    # the same checks with the package's other name, pytorch_lightning 2.x, imported by the script
    return "gloo", run_checks("gloo", WORKER, tmp_path_factory.mktemp("ptl"), timeout=300, extra_env={
        "TEST_LIGHTNING_PACKAGE": "pytorch_lightning", "HVDP_CHECKS": ",".join(PYTORCH_LIGHTNING_CHECKS)})


@pytest.mark.parametrize("name", PYTORCH_LIGHTNING_CHECKS)
def test_pytorch_lightning_check(pytorch_lightning_results, name):
    assert_passed(pytorch_lightning_results, name)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lightning.py"


def test_example_trains_and_scores_every_test_sample_once():
    # examples/train_lightning.py under horovodrun: one argument of the Trainer changed (strategy="hvdp")
    proc = run("gloo", EXAMPLE, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = result_line(proc.stdout)
    assert result["world_size"] == 2 and result["framework"] == "lightning", result
    assert result["test_samples"] == 359, result  # sync_dist over hvdp's unpadded slices: each sample once
    assert result["test_accuracy"] >= 0.95, result
    assert "Using `DistributedSampler`" not in proc.stderr  # Lightning's advice against padding does not apply


def test_hvdp_imports_no_lightning():
    code = "import sys, hvdp, hvdp.torch; print([m for m in ('lightning', 'pytorch_lightning') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 7, 16, 29])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_eval_batches_score_every_sample_once(n, batch_size, size):
    plans = [eval_batches(n, batch_size, rank, size) for rank in range(size)]
    # every sample exactly once, in order when read step by step and rank by rank
    steps = max(len(p) for p in plans)
    read = [i for step in range(steps) for p in plans if step < len(p) for i in p[step]]
    assert read == list(range(n))
    # the same number of batches on every rank, but where a last global batch is smaller than the world
    full = -(-n // (size * batch_size))
    short = n % (size * batch_size)
    for rank, p in enumerate(plans):
        assert len(p) == (full - 1 if 0 < short < size and rank >= short else full), (rank, p)
        assert all(len(b) >= 1 for b in p) and all(b == list(range(b[0], b[-1] + 1)) for b in p)
