"""Data and bookkeeping shared by the three examples (framework-free: numpy, scikit-learn, the core).

The default data is scikit-learn's bundled handwritten digits: 1,797 8x8 grey images, 10 classes, no
download. `--data file.npz` trains on your own arrays instead: `x` (samples first) and `y` (integer labels).
`--files DIR` reads the training samples from files, as a dataset too large for memory is read: rank 0
writes them there first if DIR has none (write_files), in the layout each example reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

import hvdp
from hvdp import TrainConfig
from hvdp.core.errors import ConfigError, HvdpError
from hvdp.core.records import frame

TEST_FRACTION = 0.2
DEFAULTS = {"epochs": 12, "batch_size": 32, "lr": 0.03, "warmup_epochs": 1.0}  # the examples' flags' defaults
SPLIT_SEED = 0  # fixed: every run, every rank and every world size gets the same train/test split


KERAS_BACKENDS = ("tensorflow", "torch")  # the Keras 3 backends hvdp.keras runs on


def parse_config(description: str, *, keras_backend: bool = False, **defaults) -> TrainConfig:
    """The TrainConfig of the command line; keras_backend=True also accepts --keras-backend (read before
    Keras is imported, by select_keras_backend)."""
    parser = argparse.ArgumentParser(description=description)
    TrainConfig.add_arguments(parser, **defaults)
    if keras_backend:
        _add_keras_backend(parser)
    args = parser.parse_args()
    try:
        return TrainConfig.from_args(args)
    except ConfigError as e:
        parser.error(str(e))


def _add_keras_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keras-backend", choices=KERAS_BACKENDS, default=None,
                        help="the Keras 3 backend to train on: sets KERAS_BACKEND before Keras is imported "
                             "(default: KERAS_BACKEND from the environment, else Keras's own, tensorflow)")


def select_keras_backend(argv: list[str] | None = None) -> None:
    """Set KERAS_BACKEND from --keras-backend in `argv` (default sys.argv), which must run before Keras is
    imported: Keras reads it once, at import. Without the flag the environment's KERAS_BACKEND stays."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_keras_backend(parser)
    chosen = parser.parse_known_args(argv)[0].keras_backend
    if chosen:
        os.environ["KERAS_BACKEND"] = chosen


def load_data(path: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x is float32 with samples first, y int64 class indices."""
    if path is None:
        from sklearn.datasets import load_digits
        digits = load_digits()
        x, y = digits.images[:, None, :, :] / 16.0, digits.target
    else:
        x, y = _read_npz(Path(path))
    x, y = x.astype(np.float32), y.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(round(len(x) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file; give a .npz with arrays x and y")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise ConfigError(f"--data {path}: not a readable .npz file ({type(e).__name__}: {e})")
    missing = {"x", "y"} - arrays.keys()
    if missing:
        raise ConfigError(f"--data {path}: missing array(s) {sorted(missing)}; found {sorted(arrays)}. "
                          f"Save with np.savez(path, x=inputs, y=labels)")
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or len(x) != len(y) or y.ndim != 1:
        raise ConfigError(f"--data {path}: x must be (samples, ...) and y (samples,); got x{x.shape}, y{y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ConfigError(f"--data {path}: y must hold integer class labels >= 0, got dtype {y.dtype}")
    if not np.isfinite(x).all():
        raise ConfigError(f"--data {path}: x contains NaN or inf values")
    if x.ndim == 2:    # (samples, features) -> a 1-pixel-high, one-channel image
        x = x[:, None, None, :]
    elif x.ndim == 3:  # (samples, h, w) -> one channel
        x = x[:, None, :, :]
    elif x.ndim > 4:
        raise ConfigError(f"--data {path}: x has {x.ndim} dimensions; use (samples, [channels,] h, w)")
    return x, y


RECORD_FILES = 4


def write_files(directory: str, x: np.ndarray, y: np.ndarray, kind: str) -> None:
    """Write the samples (x[i], y[i]) under `directory` unless it has them already; call it on one rank.

    kind "tfrecord": RECORD_FILES files train-K.tfrecord, each record the label (int64, little-endian)
    followed by the sample's float32 bytes (parsed in train_keras.training_data). kind "npy": samples/NNNNNN.npy,
    one array per sample, and labels.npy.
    """
    root = Path(directory)
    done = list(root.glob("train-*.tfrecord")) if kind == "tfrecord" else (root / "labels.npy").exists()
    if done:
        return
    root.mkdir(parents=True, exist_ok=True)
    if kind == "tfrecord":
        for k, part in enumerate(np.array_split(np.arange(len(x)), RECORD_FILES)):
            records = (frame(struct.pack("<q", int(y[i])) + x[i].astype(np.float32).tobytes()) for i in part)
            (root / f"train-{k}.tfrecord").write_bytes(b"".join(records))
    else:
        (root / "samples").mkdir(exist_ok=True)
        for i in range(len(x)):
            np.save(root / "samples" / f"{i:06d}.npy", x[i])
        np.save(root / "labels.npy", y)


def record_files(directory: str) -> list[str]:
    files = sorted(str(p) for p in Path(directory).glob("train-*.tfrecord"))
    if not files:
        raise ConfigError(f"--files {directory}: no train-*.tfrecord files there")
    return files


def num_classes(*ys: np.ndarray) -> int:
    return max((int(y.max()) for y in ys if len(y)), default=0) + 1


def summary(metrics: dict, *, framework: str, world_size: int, epochs: int, samples: int, seconds: float,
            **extra) -> dict:
    """What a training run reports: `metrics` is what the adapter's evaluate() returned; `samples` is the
    training samples of all ranks; `extra` (a rank, a weights digest) is added as it is."""
    periods = hvdp.straggler_periods()  # the straggler report: the last period's step times, every line
    return {"test_accuracy": round(metrics["accuracy"], 4), "test_loss": round(metrics["loss"], 4),
            "test_samples": metrics["samples"], "world_size": world_size, "epochs": epochs,
            "samples_per_sec": round(samples / seconds, 1) if seconds else 0.0, "seconds": round(seconds, 2),
            "framework": framework, "step_times_ms": periods[-1]["ranks"] if periods else {},
            "stragglers": [line for p in periods for line in p["stragglers"]], **extra}


def report(metrics: dict, **fields) -> None:
    """The examples' last line of output: `result: {json}` of summary(metrics, **fields) (rank 0 only;
    callers check)."""
    print_result(summary(metrics, **fields))


def print_result(result: dict) -> None:
    """Print `result: {json}`, the line the tests and `hvdp bench` read."""
    print("result: " + json.dumps(result, sort_keys=True), flush=True)


def digest(arrays) -> str:
    """SHA-256 of the bytes of `arrays` (numpy arrays, in order): equal on two ranks iff their weights are
    bit-identical."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def fail(error: HvdpError) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(1)
