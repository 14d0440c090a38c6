"""Under KERAS_BACKEND=torch, hvdp.keras.init() and hvdp.tensorflow.init() refuse, on every rank
(tests/tensorflow/test_keras_backend.py). Rank 0 prints `result: {...}` with every rank's outcome."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hvdp.keras as hk  # noqa: E402
import hvdp.tensorflow as htf  # noqa: E402
from hvdp.core.errors import ConfigError  # noqa: E402

outcome = {}
for name, init in (("keras", hk.init), ("tensorflow", htf.init)):
    try:
        init()
        outcome[name] = "no error"
    except ConfigError as e:
        outcome[name] = str(e)
rank, size = htf.hvd.rank(), htf.hvd.size()  # Horovod itself is up: the check runs after hvd.init()
gathered = htf.hvd.allgather_object({"rank": rank, **outcome}, name="outcomes") if size > 1 else [
    {"rank": rank, **outcome}]
if rank == 0:
    print("result: " + json.dumps({"size": size, "ranks": gathered}), flush=True)
