"""hvdp.lightning under real launchers: one launch per controller runs every check in worker_lightning.py."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hvdp.core.sharding import eval_batches
from tests.checks import assert_passed, check_names
from tests.launch import ROOT, env, launcher_cmd, result_line, run, run_checks

WORKER = Path(__file__).with_name("worker_lightning.py")


TMP = {}  # the launch's folder, by (launcher, np): its checkpoints for test_resume_on_one_process

# np=2 and np=3 (a world that splits the batches and the data otherwise: the last global batch 3+3+3, the resize
# check's 3 steps an epoch) under both controllers: ~40 s a launch
WORLDS = [("mpi", 2), ("gloo", 2), ("mpi", 3), ("gloo", 3)]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{launcher}-np{np}" for launcher, np in WORLDS])
def results(request, tmp_path_factory):
    launcher, np = request.param
    TMP[request.param] = tmp_path_factory.mktemp(f"{launcher}{np}")
    return f"{launcher} np={np}", run_checks(launcher, WORKER, TMP[request.param], np=np, timeout=300)


@pytest.mark.parametrize("name", check_names(WORKER))
def test_lightning_check(results, name):
    assert_passed(results, name)


def test_resume_on_one_process_of_a_three_rank_checkpoint(request, results):
    # the checkpoint the gloo np=3 launch wrote (check resumes_at_another_world_size), resumed by plain python
    launcher, np = request.node.callspec.params["results"]
    if (launcher, np) != ("gloo", 3):
        pytest.skip("once, from the gloo np=3 launch's checkpoint (3 ranks -> 1)")
    name = "resumes_at_another_world_size"
    assert_passed(results, name)
    resumed = run_checks("python", WORKER, TMP[(launcher, np)], np=1, timeout=300, extra_env={"HVDP_CHECKS": name})
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


KILL_WORKER = Path(__file__).with_name("kill_worker.py")
WATCHDOG = 5  # HVDP_WATCHDOG_TIMEOUT for the dead-rank test (default 60 s)


def run_until_dead(launcher: str, limit: float) -> tuple[int | None, str, float | None]:
    """Run kill_worker.py (rank 1 SIGKILLs itself at step 3) in its own session; return (exit code, output,
    seconds from rank 1's kill to the job's end). Whatever is left of the job after `limit` s is killed."""
    from hvdp.tools.rotation import descendants, kill
    proc = subprocess.Popen(launcher_cmd(launcher) + [str(KILL_WORKER)], cwd=ROOT, start_new_session=True,
                            env=env(HVDP_WATCHDOG_TIMEOUT=str(WATCHDOG), HVDP_WATCHDOG_ELSEWHERE_TIMEOUT=str(WATCHDOG)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(limit, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    lines, killed_at, ranks = [], None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and "SIGKILL at step" in line:
                killed_at = time.monotonic()
                ranks = descendants([proc.pid])  # Gloo's ranks run in sessions of their own
        proc.wait()
        ended = time.monotonic()
    finally:
        timer.cancel()
        for pid in [proc.pid, *ranks]:  # what is left (a rank still waiting), if it is still this job's
            try:
                if str(KILL_WORKER) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                    kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()
    return proc.returncode, "".join(lines), None if killed_at is None else ended - killed_at


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_a_killed_rank_ends_the_job_soon_naming_it(launcher):
    # rank 1 SIGKILLed in the middle of Trainer.fit: rank 0, waiting in the gradient all-reduce, fails and the
    # launcher ends the job naming rank 1, within seconds (the watchdog's limit is 5 s), not at a timeout
    code, out, seconds = run_until_dead(launcher, limit=180)
    assert seconds is not None, out[-3000:]  # rank 1 reached the kill
    assert code not in (0, None) and "finished without noticing" not in out, out[-3000:]
    assert seconds < 30, (seconds, out[-3000:])
    named = {"gloo": "Process name: 1\nExit code: 137", "mpi": "process rank 1 with PID"}[launcher]
    assert named in out, out[-3000:]
    print(f"{launcher}: the job ended {seconds:.1f} s after rank 1 was killed")


def test_verify_zoo_through_lightning_passes():
    # `hvdp verify --zoo --framework lightning`: the torch zoo's models, each wrapped in a LightningModule and fit
    # by the Trainer on strategy="hvdp" (both paths, accumulate's sharded one included), against one plain
    # process; one launch, np=2 under Gloo (40 s; the Lightning checks above run np=3 too)
    from hvdp.tools import zoo
    from tests.test_cli import hvdp
    proc = hvdp("verify", "--zoo", "--framework", "lightning", "--np", "2", "--gloo", timeout=600)
    out = proc.stdout + proc.stderr
    summary = result_line(out, zoo.SUMMARY)
    printed = {(c["framework"], c["path"], c["name"]) for c in summary["cases"]}
    expected = set(zoo.expected_records(framework="lightning"))
    assert printed == expected and len(expected) == 2 * len(zoo.torch_cases()), (sorted(printed), out[-3000:])
    failed = [zoo.format_line(c) for c in summary["cases"] if not c["ok"]]
    assert not failed and proc.returncode == 0 and summary["ok"], "\n".join(failed) + "\n" + out[-3000:]
    for case in summary["cases"]:
        assert case["max_abs_diff"] <= zoo.TOLERANCE and case["replicas_identical"], case
        assert zoo.format_line(case) in proc.stdout


PREEMPT_WORKER = Path(__file__).with_name("preempt_worker.py")


def test_preempted_fit_writes_lightnings_hpc_checkpoint_and_the_requeued_run_resumes_exact(tmp_path):
    # HorovodStrategy(preemption=True), rank 1 SIGTERMed at step 3: every rank stops after the same step, writes
    # Lightning's HPC checkpoint (what its SLURMEnvironment writes) and exits 75; Lightning's own SIGTERM handling
    # (rank 1 alone leaving its fit) does not run beside hvdp's. The requeued run (SLURM_NTASKS set, as under
    # sbatch) resumes from that checkpoint by Lightning's own rule (fit(ckpt_path=None) under Slurm) and ends as
    # one process with the global batch over the whole run.
    first = run("gloo", PREEMPT_WORKER, str(tmp_path), timeout=300)
    out = first.stdout + first.stderr
    assert first.returncode != 0 and "Exit code: 75" in out, out[-3000:]
    assert "hvdp: preempted (a stop signal on another rank): checkpoint written, exiting with 75" in out, out[-3000:]
    assert "Received SIGTERM" not in out, out[-3000:]  # Lightning's notifier, which ends the signalled rank alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt"], list(tmp_path.iterdir())
    requeued = run("gloo", PREEMPT_WORKER, str(tmp_path), timeout=300,
                   extra_env={"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "hvdp-requeued"})
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    result = result_line(requeued.stdout)
    assert result["requeued"] and result["ckpt_path"] == str(tmp_path / "hpc_ckpt_1.ckpt"), result
    assert result["global_step"] == 8 and result["max_dw"] < 1e-5, result
