"""collective_worker.py's mismatch, with hvdp.tensorflow: rank 0 calls hvd.broadcast_object alone, while rank 1
goes on to hvdp.tensorflow.check_consistency(model) (an all-gather): both blocked in collectives the other never
submits. (Two different broadcasts do not hang under TensorFlow: run eagerly, Horovod names each op by its type,
so it pairs them and fails both at once.) Run by tests/faults/test_hangs.py under horovodrun, MPI and Gloo."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import hvdp.tensorflow as htf  # noqa: E402


def main() -> None:
    world = htf.init()
    hvd = htf.hvd
    if world.rank == 0:
        print("collective: rank 0 entering broadcast_object", flush=True)
        hvd.broadcast_object({"lr": 0.1}, root_rank=0, name="config")
    else:
        print(f"collective: rank {world.rank} entering hvdp.tensorflow.check_consistency", flush=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        htf.check_consistency(model)
    print(f"collective: rank {world.rank} finished without noticing", flush=True)


if __name__ == "__main__":
    main()
