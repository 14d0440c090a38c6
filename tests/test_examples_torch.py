"""examples/train_torch.py end to end, under every launcher a user has, on the bundled digits data."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.launch import HOROVODRUN, ROOT, env, launcher_cmd, result_line, run

SCRIPT = ROOT / "examples" / "train_torch.py"


@pytest.mark.parametrize("launcher,np_", [("mpi", 2), ("gloo", 2), ("mpirun", 2), ("python", 1)])
def test_main_job_reaches_accuracy(launcher, np_):
    proc = run(launcher, SCRIPT, np=np_, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = result_line(proc.stdout)
    assert result["world_size"] == np_
    assert result["test_accuracy"] >= 0.97, result
    assert result["test_samples"] == 359  # every test sample counted once, whatever the world size
    assert {"epochs", "samples_per_sec", "seconds"} <= result.keys()
    # the straggler report's last period (issue 47): every rank's step times, in ms, and the lines rank 0 logged
    # (not asserted empty: on a machine shared with other work one rank may really be slower; the balanced
    # runs of tests/torch/test_stragglers.py check that nobody is named when nobody is slow)
    times = result["step_times_ms"]
    assert set(times) == ({str(r) for r in range(np_)} if np_ > 1 else set()), result
    assert isinstance(result["stragglers"], list) and all(line.startswith("hvdp stragglers: rank ")
                                                          for line in result["stragglers"]), result
    assert all(row["compute"] > 0 and row["step"] >= row["compute"] for row in times.values()), times
    if launcher == "python":
        assert proc.stdout.rstrip().splitlines()[-1].startswith("result: ")


def _result(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return result_line(proc.stdout)


def test_killed_job_resumes_to_the_uninterrupted_result(tmp_path):
    """kill -9 the whole job once its first checkpoint exists; the rerun resumes and ends bit-identical."""
    straight = _result(run("mpi", SCRIPT, "--epochs", "4", timeout=300))
    args = [*launcher_cmd("mpi"), str(SCRIPT), "--epochs", "4", "--checkpoint-dir", str(tmp_path)]
    job = subprocess.Popen(args, cwd=ROOT, env=env(), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("ckpt-*.pt")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert list(tmp_path.glob("ckpt-*.pt")), "the job never wrote a checkpoint"
    resumed = run("mpi", SCRIPT, "--epochs", "4", "--checkpoint-dir", str(tmp_path), timeout=300)
    assert "resumed from epoch" in resumed.stdout
    assert _result(resumed)["test_loss"] == straight["test_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000046.pt", "ckpt-00000069.pt", "ckpt-00000092.pt"]  # keep 3, 23 steps/epoch


def test_user_data_logdir_and_saved_model(tmp_path):
    from sklearn.datasets import load_digits
    digits = load_digits()
    np.savez(tmp_path / "mine.npz", x=digits.data[:600], y=digits.target[:600])  # tabular (600, 64)
    model_path, logdir = tmp_path / "model.pt", tmp_path / "tb"
    proc = run("gloo", SCRIPT, "--data", str(tmp_path / "mine.npz"), "--epochs", "2", "--batch-size", "16",
               "--save-model", str(model_path), "--logdir", str(logdir), timeout=300)
    result = _result(proc)
    assert result["test_samples"] == 120 and result["world_size"] == 2
    import torch
    state = torch.load(model_path, weights_only=True)
    assert state["head.2.weight"].shape == (10, 128)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(logdir)).Reload()
    assert {"loss/train", "accuracy/test", "lr", "samples_per_sec"} <= set(events.Tags()["scalars"])
    assert {f"step_ms/{p}/rank{r}" for p in ("input", "compute", "wait", "optimizer") for r in (0, 1)} <= \
        set(events.Tags()["scalars"])  # each rank's step times (issue 47), written by rank 0
    assert len(events.Scalars("loss/train")) == 2


def test_training_from_files_is_the_in_memory_run(tmp_path):
    """--files: one .npy per sample read by 2 DataLoader workers per rank; the same samples in the same order."""
    in_memory = _result(run("mpi", SCRIPT, "--epochs", "2", timeout=300))
    files = _result(run("mpi", SCRIPT, "--epochs", "2", "--files", str(tmp_path), timeout=300))
    assert len(list((tmp_path / "samples").glob("*.npy"))) == 1438 and (tmp_path / "labels.npy").exists()
    assert (files["test_loss"], files["test_accuracy"]) == (in_memory["test_loss"], in_memory["test_accuracy"])
    (tmp_path / "samples" / "000007.npy").unlink()  # a directory that no longer matches its labels
    proc = run("mpi", SCRIPT, "--epochs", "1", "--files", str(tmp_path), timeout=300)
    assert proc.returncode != 0 and "1437 samples/*.npy files for 1438 labels" in proc.stdout + proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--data", "/nonexistent.npz"], "no such file"),
    (["--batch-size", "5000"], "batch_size (5000) is larger than each rank's shard"),
])
def test_bad_input_is_a_clear_error(args, message):
    proc = run("mpi", SCRIPT, *args, "--epochs", "1", timeout=300)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_bad_flag_value_is_rejected_before_launching_work():
    proc = run("python", SCRIPT, "--lr-scaling", "cubic", timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'cubic'" in proc.stderr


ELASTIC = ROOT / "examples" / "train_torch_elastic.py"


def test_elastic_example_refuses_files_instead_of_ignoring_them():
    proc = run("python", ELASTIC, "--files", "/tmp/anywhere", timeout=120)
    assert proc.returncode == 1 and "--files is for train_torch.py" in proc.stderr


@pytest.mark.elastic
def test_elastic_example_trains_under_horovod_elastic_and_alone(tmp_path):
    """The elastic example as a user first runs it: horovodrun in elastic mode on one host (a discovery
    script, --network-interface lo as Horovod's elastic driver needs here), and plain python. The fault
    itself (a worker killed, its host re-admitted) is tests/multihost/test_elastic.py."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    elastic = subprocess.run(
        [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2",
         "--host-discovery-script", str(discover), "--network-interface", "lo",
         sys.executable, str(ELASTIC), "--epochs", "6"],
        capture_output=True, text=True, cwd=ROOT, env=env(), timeout=300)
    result = _result(elastic)
    assert result["world_size"] == 2 and result["test_accuracy"] >= 0.95, result
    assert result["test_samples"] == 359, result  # the evaluation gathers both ranks' halves under elastic too
    assert "training on 2 rank(s) from epoch 0" in elastic.stdout
    alone = _result(run("python", ELASTIC, "--epochs", "6", timeout=300))
    assert alone["world_size"] == 1 and alone["test_accuracy"] >= 0.95 and alone["test_samples"] == 359, alone
