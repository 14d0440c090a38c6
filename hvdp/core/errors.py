"""hvdp's exceptions: one base class, HvdpError, and one subclass per kind of failure.

Each message says what was wrong, the value, and the fix; an error that belongs to one rank of a distributed
job starts with "[rank R]" and carries `rank`. ConfigError is also a ValueError and SetupError a
RuntimeError, so code that already catches those keeps working. The collective checks of the adapters
(check_consistency, check_finite, load_checkpoint) raise theirs on every rank at once, so no rank is left
waiting for another. docs/troubleshooting.md lists every message and its fix.
"""

from __future__ import annotations


class HvdpError(Exception):
    """Base class of every error hvdp raises: catch it to handle them all.

    Args:
        message: what was wrong, the value, and the fix.
        rank: the rank the error belongs to, or None (the default) when it is not rank-specific. When set,
            the message is prefixed with "[rank R] " and kept in the `rank` attribute.
    """

    def __init__(self, message: str, *, rank: int | None = None):
        self.rank = rank
        super().__init__(f"[rank {rank}] {message}" if rank is not None else message)


class ConfigError(HvdpError, ValueError):
    """A user-supplied value is invalid: a flag, batch size, data shape, argument or environment variable.

    Also a ValueError. The message quotes the value and names the allowed ones.
    """


class SetupError(HvdpError, RuntimeError):
    """The installed stack cannot do what was asked: Horovod missing, or built without the framework or
    controller (MPI) the job needs. Also a RuntimeError; the message names the fix (usually `make setup`)."""


class CheckpointError(HvdpError):
    """A checkpoint file is corrupt, truncated, foreign (another framework, another model, not hvdp's), or
    cannot be resumed by this job (taken mid-epoch with another number of ranks). The message names the file."""


class DataError(HvdpError):
    """The training data cannot be split exactly: a stream that is empty, that ends early or differs on some
    rank, or that cannot be read again from its start to resume. Raised on every rank at once, naming the
    ranks, the epoch and step, and the fix."""


class DivergenceError(HvdpError):
    """Replicas that must be identical are not: different parameters, shapes or values across ranks.

    Raised on every rank by check_consistency() and by prepare()'s model-shape check, naming the first
    tensor that differs and the ranks that hold another value than rank 0.
    """


class RankError(HvdpError):
    """An unexpected exception on some rank inside an operation every rank was in (a checkpoint's read or
    write, evaluate, init's checks, verify): raised on every rank at once instead of leaving the others
    waiting, naming each failed rank, the operation and the original exception (chained on that rank)."""


class NonFiniteLossError(HvdpError):
    """The loss became NaN or infinite: raised on every rank by check_finite(), naming the step and the
    ranks whose loss was not finite."""


__all__ = ["HvdpError", "ConfigError", "SetupError", "CheckpointError", "DataError", "DivergenceError",
           "NonFiniteLossError", "RankError"]
