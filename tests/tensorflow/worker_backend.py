"""Under KERAS_BACKEND=torch, hvdp.tensorflow.init() refuses, on every rank (tests/tensorflow/test_keras_backend.py;
hvdp.keras runs there, through horovod.torch: tests/tensorflow/test_keras_torch.py). Rank 0 prints
`result: {...}` with every rank's outcome."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hvdp.tensorflow as htf  # noqa: E402
from hvdp.core.errors import ConfigError  # noqa: E402

outcome = {}
try:
    htf.init()
    outcome["tensorflow"] = "no error"
except ConfigError as e:
    outcome["tensorflow"] = str(e)
rank, size = htf.hvd.rank(), htf.hvd.size()  # Horovod itself is up: the check runs after hvd.init()
gathered = htf.hvd.allgather_object({"rank": rank, **outcome}, name="outcomes") if size > 1 else [
    {"rank": rank, **outcome}]
if rank == 0:
    print("result: " + json.dumps({"size": size, "ranks": gathered}), flush=True)
