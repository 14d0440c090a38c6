"""The training knobs every adapter and example shares, validated once, with their help text in one place.

TrainConfig is a keyword-only dataclass: each field carries its help text in its metadata, and
TrainConfig.add_arguments turns the fields into command-line flags (--batch-size, --lr-scaling, ...), so the
examples and the `hvdp` tools share one definition. COMPRESSIONS and OPS are the allowed gradient
compressions and reductions.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hvdp.core.errors import ConfigError
from hvdp.core.scaling import LR_RULES

COMPRESSIONS = ("none", "fp16")
OPS = ("average", "sum", "adasum")


def _opt(help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": help, "flag": flag, "choices": choices}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Common training configuration. Batch size is per rank; the learning rate is the base rate for it.

    Keyword arguments only, one per field; each field's meaning and default are its --flag's help text
    (see add_arguments, or any example's --help). Validated on construction.

    Raises:
        ConfigError: epochs, batch_size, accumulate or keep_checkpoints is not an integer >= 1; lr is not
            > 0; warmup_epochs is < 0; lr_scaling is not one of LR_RULES or compression not one of
            COMPRESSIONS.
    """

    epochs: int = field(default=10, metadata=_opt("passes over the training data"))
    batch_size: int = field(default=32, metadata=_opt("samples per rank per backward pass"))
    lr: float = field(default=0.05, metadata=_opt("base learning rate, tuned for one process at --batch-size"))
    lr_scaling: str = field(default="linear", metadata=_opt(
        "how the learning rate grows with ranks x accumulation: linear (Goyal et al.), sqrt, none",
        choices=LR_RULES))
    warmup_epochs: float = field(default=0.0, metadata=_opt(
        "epochs over which the learning rate ramps from base to scaled (Goyal et al. use 5)"))
    seed: int = field(default=0, metadata=_opt("seed for initialisation and the per-epoch data order"))
    compression: str = field(default="none", metadata=_opt(
        "gradient compression on the wire", choices=COMPRESSIONS))
    accumulate: int = field(default=1, metadata=_opt(
        "backward passes accumulated per optimizer step (Horovod's backward_passes_per_step)"))
    adasum: bool = field(default=False, metadata=_opt("combine gradients with Adasum instead of averaging"))
    checkpoint_dir: str | None = field(default=None, metadata=_opt(
        "write checkpoints here (rank 0) and resume from the newest one found"))
    keep_checkpoints: int = field(default=3, metadata=_opt("how many checkpoints to keep"))
    save_model: str | None = field(default=None, metadata=_opt("write the final model weights to this path"))
    data: str | None = field(default=None, metadata=_opt(
        "your own data: a .npz file with arrays x (samples first) and y (integer labels)"))
    files: str | None = field(default=None, metadata=_opt(
        "train from files in this directory, written there first from the training data if it has none "
        "(TFRecord files for TensorFlow/Keras, one .npy file per sample for PyTorch)"))
    device: str = field(default="auto", metadata=_opt(
        "where each rank computes: auto (its own GPU when the framework sees GPUs, else the CPU), cpu, or cuda "
        "(its own GPU, an error without one)", choices=("auto", "cpu", "cuda")))
    logdir: str | None = field(default=None, metadata=_opt("write TensorBoard scalars here (rank 0)"))
    timeline: str | None = field(default=None, metadata=_opt(
        "write Horovod's timeline (Chrome trace, open in chrome://tracing) to this path"))

    def __post_init__(self):
        for name in ("epochs", "batch_size", "accumulate", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if not self.warmup_epochs >= 0:
            raise ConfigError(f"warmup_epochs must be >= 0, got {self.warmup_epochs!r}")
        for name in ("lr_scaling", "compression", "device"):
            choices = type(self).__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")

    @property
    def op(self) -> str:
        """The gradient reduction: 'adasum' or 'average'."""
        return "adasum" if self.adasum else "average"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
        """Add one --flag per field to `parser` (e.g. `batch_size` becomes --batch-size) and return it.

        Args:
            parser: the argparse parser to add the flags to.
            defaults: field name = value pairs that override the fields' defaults (e.g. epochs=20).

        Returns:
            `parser`, for chaining. Values are validated later, by from_args.
        """
        for f in fields(cls):
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default, help=f.metadata["help"])
                continue
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=default, choices=f.metadata["choices"],
                                metavar=None if f.metadata["choices"] else f.name.upper(),
                                help=f"{f.metadata['help']} (default: {default})")
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        """Build (and so validate) a config from parsed arguments; unrelated attributes are ignored.

        Args:
            args: the namespace parser.parse_args() returned (after add_arguments).

        Raises:
            ConfigError: a value is invalid (see the class).
        """
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


__all__ = ["COMPRESSIONS", "OPS", "TrainConfig"]
