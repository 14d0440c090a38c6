import os

import pytest

from hvdp.core import checkpoint as ckpt
from hvdp.core.errors import CheckpointError, ConfigError


def test_atomic_write_and_listing(tmp_path):
    for step in (3, 10, 7):
        ckpt.write_atomic(tmp_path / ckpt.checkpoint_name(step, "pt"), lambda f, s=step: f.write(b"x" * s))
    (tmp_path / ".ckpt-00000011.pt.abc.tmp").write_bytes(b"half")  # an interrupted save
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "ckpt-00000003.pt", "ckpt-00000007.pt", "ckpt-00000010.pt"]
    assert ckpt.latest_checkpoint(tmp_path).read_bytes() == b"x" * 10
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None
    assert ckpt.latest_checkpoint(None) is None


def test_failed_write_leaves_nothing_behind(tmp_path):
    target = tmp_path / ckpt.checkpoint_name(1, "pt")
    target.write_bytes(b"old")

    def explode(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.write_atomic(target, explode)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == [target.name]


def test_prune_keeps_newest(tmp_path):
    for step in range(1, 6):
        (tmp_path / ckpt.checkpoint_name(step, "npz")).write_bytes(b"")
    (tmp_path / ".ckpt-00000006.npz.x.tmp").write_bytes(b"")
    deleted = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["ckpt-00000001.npz", "ckpt-00000002.npz", "ckpt-00000003.npz"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004.npz", "ckpt-00000005.npz"]


def test_meta_check_refuses_foreign(tmp_path):
    fp = ckpt.fingerprint([("w", (3, 4)), ("b", (4,))])
    assert fp != ckpt.fingerprint([("w", (4, 3)), ("b", (4,))])
    meta = ckpt.make_meta(framework="torch", step=5, epoch=1, world_size=2, model_fingerprint=fp)
    p = tmp_path / "ckpt-00000005.pt"
    assert ckpt.check_meta(meta, p, framework="torch", model_fingerprint=fp)["step"] == 5
    with pytest.raises(CheckpointError, match="not an hvdp checkpoint"):
        ckpt.check_meta({"something": 1}, p, framework="torch", model_fingerprint=fp)
    with pytest.raises(CheckpointError, match="written by the torch adapter, not keras"):
        ckpt.check_meta(meta, p, framework="keras", model_fingerprint=fp)
    with pytest.raises(CheckpointError, match="different model"):
        ckpt.check_meta(meta, p, framework="torch", model_fingerprint="0" * 16)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3", None])
def test_keep_must_leave_the_new_checkpoint(bad):
    # prune(directory, 0) deletes every checkpoint, the one just written included: refused before saving.
    with pytest.raises(ConfigError, match="keep must be an integer >= 1"):
        ckpt.check_keep(bad)
    assert ckpt.check_keep(1) == 1
