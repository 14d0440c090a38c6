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
