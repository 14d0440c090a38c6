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


def run(launcher, cases, framework="torch", timeout=240):
    """Runs {case: directory} one after another in one launch."""
    proc = subprocess.run(launcher_cmd(launcher) + [str(WORKER), "--framework", framework]
                          + [f"--case={case}:{directory}" for case, directory in cases.items()],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0: done" in out and "rank 1: done" in out, out[-4000:]  # nobody left waiting
    return out


def test_state_over_2_gib_loads_exactly_with_bounded_memory(tmp_path):
    """Horovod's broadcast_object sends its length as int32, so a pickled checkpoint >= 2 GiB could not be
    loaded, and every rank held the pickle and the objects at once. Streamed, each rank receives into its
    own parameters: the extra memory while loading is one 64 MiB buffer plus noise, not the state's size."""
    out = run("mpi", {"big": tmp_path}, timeout=400)
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
def tmpfs(tmp_path):
    """mount(name) mounts a tmpfs of 1 MiB at a fresh directory (root only); all unmounted afterwards."""
    mounted = []

    def mount(name):
        where = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                                                           capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(where)
        return where
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)])


def assert_same_error_on_every_rank(out, case, *needles):
    for rank in (0, 1):
        line = next((l for l in out.splitlines() if f"[{case}] rank {rank}: CheckpointError" in l), None)
        assert line is not None, (case, out[-4000:])
        assert f"[rank {rank}]" in line, line
        for needle in needles:
            assert needle in line, (needle, line)


@pytest.mark.parametrize("launcher,framework", [("mpi", "torch"), ("gloo", "torch"), ("mpi", "tf")])
def test_a_failed_save_or_load_is_the_same_error_on_every_rank(tmpfs, tmp_path, launcher, framework):
    """Three failures in one launch, each followed by a collective: a save to a read-only filesystem, a save
    to a full disk (no partial file left behind), and a checkpoint deleted between listing and reading."""
    readonly, full, deleted = tmpfs("ro"), tmpfs("full"), tmp_path / "deleted"
    subprocess.run(["mount", "-o", "remount,ro", str(readonly)], check=True)
    with open(full / "filler", "wb", buffering=0) as f:  # fill it up to the last byte
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    out = run(launcher, {"readonly": readonly / "ckpt", "full": full, "deleted": deleted}, framework)
    assert_same_error_on_every_rank(out, "readonly", f"cannot write checkpoint {readonly}/ckpt/ckpt-00000001",
                                    "Read-only file system", "on rank 0")
    assert_same_error_on_every_rank(out, "full", "cannot write checkpoint", "No space left on device")
    assert sorted(p.name for p in full.iterdir()) == ["filler"]
    assert_same_error_on_every_rank(out, "deleted", f"cannot read checkpoint {deleted}/ckpt-00000001",
                                    "FileNotFoundError", "on rank 0")
