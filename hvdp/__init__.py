"""hvdp: data-parallel training over Horovod for PyTorch and TensorFlow/Keras 3.

`import hvdp` loads only the framework-free core. The adapters load their framework on use:

    import hvdp.torch as hvdp_torch        # PyTorch
    import hvdp.tensorflow as hvdp_tf      # TensorFlow custom loops
    import hvdp.keras as hvdp_keras        # Keras 3 model.fit

Here: TrainConfig (the shared training flags), World (rank and size) and the error classes. Each public
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
]
