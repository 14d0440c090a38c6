"""Checkpoints at the limits of real storage, launched at np=2: a state over 2 GiB loads exactly with
bounded extra memory, and a failed save or load is the same error on every rank, never a wait."""

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.launch import ROOT, env, launcher_cmd

WORKER = Path(__file__).with_name("ckpt_io_worker.py")


def run(launcher, case, directory, framework="torch", timeout=240):
    proc = subprocess.run(launcher_cmd(launcher) + [str(WORKER), "--case", case, "--framework", framework,
                                                    "--dir", str(directory)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0: done" in out and "rank 1: done" in out, out[-4000:]  # nobody left waiting
    return out


def test_state_over_2_gib_loads_exactly_with_bounded_memory(tmp_path):
    """Horovod's broadcast_object sends its length as int32, so a pickled checkpoint >= 2 GiB could not be
    loaded, and every rank held the pickle and the objects at once. Streamed, each rank receives into its
    own parameters: the extra memory while loading is one 64 MiB buffer plus noise, not the state's size."""
    out = run("mpi", "big", tmp_path, timeout=400)
    size = int(re.search(r"checkpoint bytes (\d+)", out).group(1))
    assert size > 2 << 30, size
    for rank in (0, 1):
        m = re.search(rf"rank {rank}: exact (\w+) state bytes (\d+) extra anon bytes while loading (-?\d+)", out)
        assert m and m.group(1) == "True", out[-4000:]
        extra = int(m.group(3))
        print(f"rank {rank}: checkpoint {size / 2**30:.2f} GiB, extra anonymous memory while loading "
              f"{extra / 2**20:.0f} MiB")
        assert extra < 512 << 20, (rank, extra)


@pytest.fixture
def mounted(tmp_path):
    """A tmpfs of 1 MiB mounted at a fresh directory (root only); unmounted afterwards."""
    where = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)])


def assert_same_error_on_every_rank(out, *needles):
    for rank in (0, 1):
        line = next((l for l in out.splitlines() if f"rank {rank}: CheckpointError" in l), None)
        assert line is not None, out[-4000:]
        assert f"[rank {rank}]" in line, line
        for needle in needles:
            assert needle in line, (needle, line)


@pytest.mark.parametrize("launcher,framework", [("mpi", "torch"), ("gloo", "torch"), ("mpi", "tf")])
def test_save_to_a_read_only_filesystem_fails_on_every_rank(mounted, launcher, framework):
    subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True)
    out = run(launcher, "readonly", mounted / "ckpt", framework)
    assert_same_error_on_every_rank(out, f"cannot write checkpoint {mounted}/ckpt/ckpt-00000001", "Read-only file system",
                                    "on rank 0")


@pytest.mark.parametrize("launcher,framework", [("mpi", "torch"), ("mpi", "tf")])
def test_save_to_a_full_disk_fails_on_every_rank_and_leaves_no_partial_file(mounted, launcher, framework):
    with open(mounted / "filler", "wb", buffering=0) as f:  # fill it up to the last byte
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    out = run(launcher, "full", mounted, framework)
    assert_same_error_on_every_rank(out, "cannot write checkpoint", "No space left on device")
    assert sorted(p.name for p in mounted.iterdir()) == ["filler"]


@pytest.mark.parametrize("launcher,framework", [("mpi", "torch"), ("gloo", "torch"), ("mpi", "tf")])
def test_checkpoint_deleted_between_listing_and_reading_fails_on_every_rank(tmp_path, launcher, framework):
    out = run(launcher, "deleted", tmp_path, framework)
    assert_same_error_on_every_rank(out, f"cannot read checkpoint {tmp_path}/ckpt-00000001", "FileNotFoundError",
                                    "on rank 0")
