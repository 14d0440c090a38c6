"""hvdp: data-parallel training over Horovod for PyTorch and TensorFlow/Keras 3.

`import hvdp` loads only the framework-free core. The adapters load their framework on use:

    import hvdp.torch as hvdp_torch        # PyTorch
    import hvdp.tensorflow as hvdp_tf      # TensorFlow custom loops
    import hvdp.keras as hvdp_keras        # Keras 3 model.fit

Here: TrainConfig (the shared training flags), World (rank and size), the error classes and
straggler_periods() and straggler_scalars() (the per-rank step times of the straggler report, for your logs). Each public
function's contract: `python -m pydoc hvdp.torch` (or hvdp.tensorflow, hvdp.keras, hvdp.core.<module>).
"""

from hvdp.core.config import TrainConfig
from hvdp.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DivergenceError,
    HvdpError,
    NonFiniteLossError,
    SetupError,
)
from hvdp.core.world import World

__version__ = "0.1.0"


def straggler_periods() -> list[dict]:
    """The straggler report's periods so far in this process (docs/troubleshooting.md "My job is slower than
    it should be"), oldest first, at most the last 100: per period {"steps", "ranks": {rank: {"host", "steps",
    and the median ms per step of "input", "compute", "wait", "optimizer", "step"}}, "stragglers": the lines
    rank 0 logged}. Every rank holds the table; only rank 0 the lines. Empty before the first report (the end
    of an epoch of shard()'s loader or of fit, or K steps), in a world of 1 and under elastic. For your logs
    (the examples put the last period in their result JSON and TensorBoard)."""
    from hvdp import _stragglers
    return _stragglers.periods()


def straggler_scalars() -> list[tuple[str, float]]:
    """The last period of straggler_periods() as (TensorBoard tag, ms per step) pairs: step_ms/<part>/rank<r>
    for each rank's median input, compute, wait and optimizer time; empty before the first period. Write them
    from rank 0 at each epoch's end (`tf.summary.scalar(tag, value, step=epoch)` or SummaryWriter.add_scalar):
    hvdp.keras.callbacks() does it for a keras.callbacks.TensorBoard given as keras_callbacks."""
    from hvdp import _stragglers
    return _stragglers.scalars()


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DivergenceError",
    "HvdpError",
    "NonFiniteLossError",
    "SetupError",
    "TrainConfig",
    "World",
    "__version__",
    "straggler_periods",
    "straggler_scalars",
]
