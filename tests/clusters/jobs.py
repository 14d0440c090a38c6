"""What the cluster tests hand the training functions; imported by the ranks, on the executors and actors."""

import json
import os


def record(path: str, epoch: int, rank: int, size: int) -> None:
    """train_torch_elastic.train's on_epoch hook: one JSON line per rank and epoch, with the rank's pid (the
    process a test kills to lose a worker)."""
    with open(path, "a") as f:  # one short O_APPEND write per line: lines of two ranks never interleave
        f.write(json.dumps({"epoch": epoch, "rank": rank, "size": size, "pid": os.getpid()}) + "\n")


def lines(path) -> list[dict]:
    """What record() wrote so far."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def startup() -> float:
    """The smallest hvdp job: init and one average over the ranks (what tests/clusters/startup.py times)."""
    import hvdp.torch as hvdp_torch

    hvdp_torch.init()
    return hvdp_torch.average(1.0)
