"""Comparing what the ranks hold: replicas (each rank digests its parameters, the adapter all-gathers the
digests, and `divergence` names the first difference: exact bytes, so the smallest drift is caught), the data
settings every rank must share (`settings_mismatch`), and the outcomes of one operation on every rank
(`failure`: one rank's exception becomes the same error on all).

Pure functions, no collective: the adapters do the all-gather and raise the error with the message these
return.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

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


# Why a data setting must match, keyed by the setting: appended to settings_mismatch's message.
_SETTING_FIXES = {
    "seed": "the seed orders the whole data set and each rank takes its own slice of that one order, so every "
            "rank must pass the same seed (seed=rank gives overlapping slices: some samples twice, others never)",
    "samples": "every rank must read the same data set (a per-node copy with a file more or less, or a listing "
               "taken at different moments, gives overlapping or skipped samples and different step counts)",
    "fingerprint": "the ranks' data differ in content or order (another file list, another sorting, another "
                   "copy): give every rank the same files in the same order, e.g. sorted(glob(...))",
    "items": "the data set's items differ across the ranks (read at the same positions, with the global "
             "generators seeded alike): if it builds its data at random (torch.rand, np.random in __init__), "
             "seed it the same on every rank before building it (torch.manual_seed(0)); if its __getitem__ "
             "draws from an unseeded generator of its own, seed that, or pass check_items=False",
}


def fingerprint_of(parts: Sequence[bytes]) -> str:
    """A short digest of a data set's identifying pieces (sampled rows, a file list), compared across ranks.

    Args:
        parts: the pieces, in an order that is the same on every rank holding the same data.

    Returns:
        16 hex digits of the sha256 of the pieces, each length-prefixed (so that ["ab", "c"] != ["a", "bc"]).
    """
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def sample_positions(n: int, count: int = 8) -> list[int]:
    """The indices of a data set of `n` items whose rows go into its fingerprint: `count` evenly spaced ones,
    first and last included (fewer when n is smaller): the same on every rank holding the same data.

    Args:
        n: the number of items, >= 0.
        count: how many to take at most, >= 2 (default 8).
    """
    if n <= count:
        return list(range(n))
    return sorted({i * (n - 1) // (count - 1) for i in range(count)})


def settings_mismatch(gathered: Sequence[dict], *, call: str) -> str | None:
    """The message for the first setting in which a rank differs from rank 0, or None when all agree.

    Args:
        gathered: `gathered[r]` is rank r's settings, a dict of plain values (batch_size, seed, shuffle,
            drop_last, samples, fingerprint...), with the same keys on every rank.
        call: the call the settings were given to, as the message should name it (e.g. "shard()").

    Returns:
        None, or one message naming the setting, the differing ranks and values next to rank 0's, and the fix.
    """
    reference = gathered[0]
    for key in reference:
        odd = {rank: other.get(key) for rank, other in enumerate(gathered) if other.get(key) != reference[key]}
        if odd:
            values = ", ".join(f"{key}={v!r} on rank {rank}" for rank, v in sorted(odd.items()))
            fix = _SETTING_FIXES.get(key, f"pass the same {key} on every rank")
            return f"the ranks called {call} with different data settings: {values}, but {key}={reference[key]!r} on rank 0; {fix}"
    return None


def failure(gathered: Sequence[Any], *, operation: str) -> tuple[str, str] | None:
    """What to raise on every rank when the operation failed on some: (error class name, message), or None.

    Args:
        gathered: `gathered[r]` is None when the operation succeeded on rank r, else (the exception's class
            name, its message, whether it is an hvdp error class).
        operation: what every rank was doing, as the message should name it (e.g. "load_checkpoint").

    Returns:
        None when no rank failed. Otherwise the class to raise (the failed ranks' own hvdp class when they
        all raised the same one, else "RankError") and a message naming each failed rank and its exception.
    """
    failed = [(rank, f) for rank, f in enumerate(gathered) if f is not None]
    if not failed:
        return None
    kinds = {(name, is_hvdp) for _, (name, _, is_hvdp) in failed}
    name, is_hvdp = next(iter(kinds))
    cls = name if len(kinds) == 1 and is_hvdp else "RankError"
    if cls != "RankError" and len(failed) == 1:
        return cls, failed[0][1][1]
    # the class is named where it is not the one raised (RankError), else it would be said twice
    what = "; ".join(f"rank {rank}: {m}" if cls == n else f"rank {rank}: {n}: {m}" for rank, (n, m, _) in failed)
    return cls, f"{operation} failed on {len(failed)} of {len(gathered)} rank(s), so every rank stops: {what}"


__all__ = ["Digest", "digest", "divergence", "fingerprint_of", "sample_positions", "settings_mismatch",
           "failure"]
