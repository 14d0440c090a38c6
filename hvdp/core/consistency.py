"""Comparing replicas across ranks: each rank digests its parameters, the adapter all-gathers the digests,
and `divergence` names the first difference. Exact bytes, so the smallest drift is caught."""

from __future__ import annotations

import hashlib
from typing import Sequence

Digest = tuple[str, tuple[int, ...], str]  # (name, shape, sha256 of the bytes)


def digest(name: str, shape: Sequence[int], data: bytes) -> Digest:
    return name, tuple(int(s) for s in shape), hashlib.sha256(data).hexdigest()


def divergence(gathered: Sequence[Sequence[Digest]], *, fix: str, labels: Sequence[str] | None = None) -> str | None:
    """The message for the first difference between rank 0's digests and another rank's, or None.

    `gathered[r]` is rank r's list of digests; `labels` optionally names the entries for the message;
    `fix` says how to make the replicas agree.
    """
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        if [(n, s) for n, s, _ in other] != [(n, s) for n, s, _ in reference]:
            mine = {n: s for n, s, _ in other}
            name, shape = next(((n, s) for n, s, _ in reference if mine.get(n) != s),
                               (other[len(reference)][0] if len(other) > len(reference) else "?", None))
            return (f"rank {rank} holds a different model than rank 0: {name!r} has shape {mine.get(name)} on "
                    f"rank {rank} and {shape} on rank 0; every rank must build the same model")
    for i, (name, _, h) in enumerate(reference):
        ranks = [r for r, other in enumerate(gathered) if other[i][2] != h]
        if ranks:
            label = labels[i] if labels else name
            return f"replicas diverged: {label!r} differs from rank 0 on rank(s) {ranks}. {fix}"
    return None
