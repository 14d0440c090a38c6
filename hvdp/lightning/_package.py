"""Which Lightning this process uses: lightning.pytorch (and lightning.fabric), else pytorch_lightning (and
lightning_fabric): the one the script imported first when both are installed."""

from __future__ import annotations

import importlib
import sys

from hvdp.core.errors import SetupError

def _lightning():
    """(the Lightning package, its name): the one the script imported, else lightning.pytorch, else
    pytorch_lightning."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning as pl
        return pl, "pytorch_lightning"
    try:
        import lightning.pytorch as pl
        return pl, "lightning.pytorch"
    except ImportError:
        pass
    try:
        import pytorch_lightning as pl
        return pl, "pytorch_lightning"
    except ImportError:
        raise SetupError("hvdp.lightning needs PyTorch Lightning 2.x: pip install 'hvdp[lightning]' "
                         "(or pip install lightning)") from None


pl, PACKAGE = _lightning()
if int(pl.__version__.split(".")[0]) < 2:
    raise SetupError(f"hvdp.lightning needs Lightning 2.x, and {PACKAGE} {pl.__version__} is installed: "
                     f"pip install 'lightning>=2.0' (Lightning 1.x has its own strategy='horovod')")
from lightning_utilities.core.rank_zero import rank_zero_only  # noqa: E402,F401  (Lightning's rank-zero switch)

strategies = pl.strategies
fabric = importlib.import_module("lightning.fabric" if PACKAGE == "lightning.pytorch" else "lightning_fabric")
ClusterEnvironment = importlib.import_module(f"{PACKAGE}.plugins.environments").ClusterEnvironment
