"""Comparing replicas across ranks: each rank digests its parameters, the adapter all-gathers the digests,
and `divergence` names the first difference. Exact bytes, so the smallest drift is caught.

Pure functions, no collective: the adapters' check_consistency() does the all-gather and raises
DivergenceError with the message `divergence` returns.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

Digest = tuple[str, tuple[int, ...], str]  # (name, shape, sha256 of the bytes)


def digest(name: str, shape: Sequence[int], data: bytes) -> Digest:
    """One tensor's digest: (name, shape as a tuple of ints, sha256 hex digest of its raw bytes).

    Args:
        name: the tensor's name, as the message should show it (e.g. a state_dict key).
        shape: its shape; compared exactly across ranks.
        data: its raw bytes (b"" to compare names and shapes only).

    Returns:
        A `Digest` tuple, small enough to all-gather.
    """
    return name, tuple(int(s) for s in shape), hashlib.sha256(data).hexdigest()


def divergence(gathered: Sequence[Sequence[Digest]], *, fix: str, labels: Sequence[str] | None = None) -> str | None:
    """The message for the first difference between rank 0's digests and another rank's, or None.

    A different list of names or shapes (another model) is reported before different bytes.

    Args:
        gathered: `gathered[r]` is rank r's list of digests, in the same order on every rank.
        fix: appended to a value-difference message: how to make the replicas agree.
        labels: optional names to show for the entries, one per digest; default: the digests' names.

    Returns:
        None when every rank's digests equal rank 0's; otherwise one message naming the first tensor
        that differs and the ranks that differ from rank 0.
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


__all__ = ["Digest", "digest", "divergence"]
