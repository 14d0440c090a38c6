"""hvdp's exceptions. Each message says what was wrong, the value, and the fix; distributed ones name the rank."""

from __future__ import annotations


class HvdpError(Exception):
    """Base class. `rank` is set when the error belongs to one rank of a distributed job."""

    def __init__(self, message: str, *, rank: int | None = None):
        self.rank = rank
        super().__init__(f"[rank {rank}] {message}" if rank is not None else message)


class ConfigError(HvdpError, ValueError):
    """A user-supplied value is invalid (bad flag, batch size, data shape...)."""


class SetupError(HvdpError, RuntimeError):
    """The installed stack cannot do what was asked (Horovod built without a framework or controller)."""


class CheckpointError(HvdpError):
    """A checkpoint file is corrupt, truncated, foreign, or from an incompatible run."""


class DivergenceError(HvdpError):
    """Replicas that must be identical are not: different parameters, shapes or values across ranks."""


class NonFiniteLossError(HvdpError):
    """The loss became NaN or infinite."""
