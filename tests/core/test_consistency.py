import pytest

from hvdp.core.consistency import digest, divergence


def ranks(*models):
    return [[digest(n, s, b) for n, s, b in m] for m in models]


A = [("w", (2, 2), b"\x00" * 16), ("b", (2,), b"\x01" * 8)]


def test_identical_replicas_pass():
    assert divergence(ranks(A, A, A), fix="x") is None


def test_first_differing_entry_and_all_its_ranks_are_named():
    drift = [A[0], ("b", (2,), b"\x02" * 8)]
    msg = divergence(ranks(A, drift, A, drift), fix="Broadcast first.", labels=["dense/w", "dense/b"])
    assert msg == "replicas diverged: 'dense/b' differs from rank 0 on rank(s) [1, 3]. Broadcast first."


def test_different_architectures_are_named_by_shape():
    other = [("w", (2, 3), b"\x00" * 24), A[1]]
    assert "rank 1 holds a different model than rank 0: 'w' has shape (2, 3) on rank 1 and (2, 2)" in \
        divergence(ranks(A, other), fix="x")
    assert "'extra' has shape (1,) on rank 1 and None on rank 0" in divergence(ranks(A, A + [("extra", (1,), b"")]), fix="x")


# ------------------------------------------------------------------------- data settings across ranks

from hvdp.core.consistency import failure, fingerprint_of, settings_mismatch  # noqa: E402

SETTINGS = {"batch_size": 32, "seed": 0, "shuffle": True, "drop_last": False, "samples": 512, "fingerprint": "ab"}


def test_agreeing_settings_pass():
    assert settings_mismatch([SETTINGS, dict(SETTINGS), dict(SETTINGS)], call="shard()") is None


@pytest.mark.parametrize("key, other, fix", [
    ("seed", 1, "seed=rank gives overlapping slices"),
    ("samples", 511, "every rank must read the same data set"),
    ("fingerprint", "cd", "the same files in the same order"),
    ("batch_size", 16, "pass the same batch_size on every rank"),
])
def test_a_differing_setting_names_the_rank_the_values_and_the_fix(key, other, fix):
    odd = {**SETTINGS, key: other}
    msg = settings_mismatch([SETTINGS, dict(SETTINGS), odd, odd], call="shard()")
    assert f"{key}={other!r} on rank 2, {key}={other!r} on rank 3, but {key}={SETTINGS[key]!r} on rank 0" in msg
    assert fix in msg and "shard()" in msg


def test_the_first_differing_setting_is_reported():
    odd = {**SETTINGS, "seed": 1, "samples": 3}
    assert "seed=1 on rank 1" in settings_mismatch([SETTINGS, odd], call="shard()")


def test_fingerprints_tell_order_and_split_apart():
    assert fingerprint_of([b"a", b"b"]) == fingerprint_of([b"a", b"b"])
    assert fingerprint_of([b"a", b"b"]) != fingerprint_of([b"b", b"a"])
    assert fingerprint_of([b"ab", b"c"]) != fingerprint_of([b"a", b"bc"])


# ------------------------------------------------------------------ one rank's error becomes everyone's

def test_no_failure_gives_none():
    assert failure([None, None], operation="evaluate") is None


def test_one_ranks_hvdp_error_keeps_its_class_and_message():
    assert failure([None, ("CheckpointError", "[rank 1] bad file", True)], operation="load") == \
        ("CheckpointError", "[rank 1] bad file")


def test_a_foreign_exception_becomes_a_rank_error_naming_rank_and_exception():
    cls, msg = failure([("KeyError", "'model'", False), None, None], operation="load_checkpoint")
    assert cls == "RankError"
    assert msg == "load_checkpoint failed on 1 of 3 rank(s), so every rank stops: rank 0: KeyError: 'model'"


def test_mixed_failures_name_every_failed_rank():
    cls, msg = failure([("ConfigError", "a", True), ("MemoryError", "", False)], operation="init()")
    assert cls == "RankError" and "rank 0: ConfigError: a; rank 1: MemoryError: " in msg
    cls, msg = failure([("ConfigError", "a", True), ("ConfigError", "b", True)], operation="init()")
    assert cls == "ConfigError" and "rank 0: a; rank 1: b" in msg
