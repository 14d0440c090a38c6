"""Bad input a user can give: each is an error naming the value and the fix, a non-zero exit, no hang, and
nothing overwritten. (More cases live beside the code they guard: tests/core, tests/torch/worker_torch.py,
tests/test_examples_torch.py.)"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import ROOT, env, launcher_cmd, run

SCRIPT = ROOT / "examples" / "train_torch.py"
CKPT_WORKER = Path(__file__).with_name("ckpt_worker.py")


def failed(proc, message):
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert message in out, f"{message!r} not in:\n{out[-3000:]}"


@pytest.fixture
def npz(tmp_path):
    def write(**arrays):
        path = tmp_path / "data.npz"
        np.savez(path, **arrays)
        return str(path)
    return write


def test_data_without_labels(npz):
    failed(run("python", SCRIPT, "--data", npz(x=np.zeros((50, 4))), timeout=120), "missing array(s) ['y']")


def test_data_of_mismatched_lengths(npz):
    failed(run("python", SCRIPT, "--data", npz(x=np.zeros((50, 4)), y=np.zeros(49, dtype=int)), timeout=120),
           "x must be (samples, ...) and y (samples,)")


def test_data_with_float_labels(npz):
    failed(run("python", SCRIPT, "--data", npz(x=np.zeros((50, 4)), y=np.zeros(50)), timeout=120),
           "y must hold integer class labels")


def test_dataset_smaller_than_the_world(npz):
    proc = run("mpi", SCRIPT, "--data", npz(x=np.zeros((1, 4)), y=np.zeros(1, dtype=int)), "--batch-size", "1",
               timeout=180)
    failed(proc, "the dataset has 1 samples but the job has 2 ranks")


@pytest.mark.parametrize("flag,value,message", [("--batch-size", "0", "batch_size must be an integer >= 1, got 0"),
                                                ("--epochs", "-1", "epochs must be an integer >= 1"),
                                                ("--compression", "zip", "invalid choice: 'zip'")])
def test_bad_flags_exit_2_before_any_work(flag, value, message):
    proc = run("python", SCRIPT, flag, value, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_nan_loss_stops_every_rank_naming_the_step():
    proc = run("gloo", SCRIPT, "--lr", "1e12", "--epochs", "2", "--warmup-epochs", "0", timeout=180)
    failed(proc, "loss is not finite at step")
    assert "on rank(s) [0, 1]" in proc.stdout + proc.stderr


def test_corrupt_checkpoint_in_the_job_is_refused_and_kept(tmp_path):
    bad = tmp_path / "ckpt-00000005.pt"
    bad.write_bytes(b"\x00" * 1000)
    proc = run("mpi", SCRIPT, "--checkpoint-dir", str(tmp_path), "--epochs", "1", timeout=180)
    failed(proc, f"cannot read checkpoint {bad}")
    assert bad.read_bytes() == b"\x00" * 1000 and sorted(p.name for p in tmp_path.iterdir()) == [bad.name]


def test_checkpoint_from_another_world_size(tmp_path):
    # End of epoch: the data order depends only on (seed, epoch), so 2 ranks -> 1 process resumes exactly.
    first = run("mpi", SCRIPT, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "a"), timeout=180)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    resumed = run("python", SCRIPT, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"), timeout=180)
    assert resumed.returncode == 0 and "resumed from epoch 1 step 0" in resumed.stdout, resumed.stderr[-2000:]
    # Mid-epoch: the position cannot be resharded exactly, so it is refused with the reason.
    mid = subprocess.run([*launcher_cmd("mpi"), str(CKPT_WORKER), "--dir", str(tmp_path / "b"), "--out",
                          str(tmp_path / "b.pt"), "--steps", "3"], capture_output=True, text=True, cwd=ROOT,
                         env=env(), timeout=180)
    assert mid.returncode == 0, mid.stdout[-2000:] + mid.stderr[-2000:]
    refused = subprocess.run([sys.executable, str(CKPT_WORKER), "--dir", str(tmp_path / "b"), "--out",
                              str(tmp_path / "c.pt")], capture_output=True, text=True, cwd=ROOT, env=env(), timeout=180)
    failed(refused, "taken mid-epoch with 2 ranks and this job has 1")


def test_horovod_without_the_framework_says_how_to_fix():
    code = "import sys; sys.modules['horovod.torch'] = None; import hvdp.torch"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT)
    failed(proc, "was not built with PyTorch: run `make setup`")


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_mpi_launch_of_a_horovod_built_without_mpi_says_how_to_fix(launcher):
    """Real mpirun / horovodrun (MPI mode) launches; Horovod's answer to mpi_built() is replaced by the one a
    Gloo-only build gives (building a second Horovod here would take 8 minutes)."""
    code = ("import horovod.torch as hvd; hvd.mpi_built = lambda: False; import hvdp.torch as ht; ht.init(); "
            "print('initialised')")
    prefix = (["mpirun", "--allow-run-as-root", "-np", "1"] if launcher == "mpirun"
              else [str(Path(sys.executable).with_name("horovodrun")), "--mpi", "-np", "1"])
    proc = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT,
                          timeout=120)
    failed(proc, "this Horovod was built without MPI: rebuild it with HOROVOD_WITH_MPI=1")
    assert "initialised" not in proc.stdout
