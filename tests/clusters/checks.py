"""What the Spark and the Ray tests both check: the main job's results, and an elastic job that loses a rank."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

from hvdp import TrainConfig
from tests.clusters.jobs import lines, record

# The examples' defaults (examples/common.py DEFAULTS): what `make train` runs.
CFG = TrainConfig(epochs=12, batch_size=32, lr=0.03, warmup_epochs=1.0)


def check_replicas(results: list[dict], size: int) -> None:
    """Every rank reported, in rank order, the same world, the accuracy of the main job and bit-identical
    final weights."""
    assert [r["rank"] for r in results] == list(range(size)), results
    assert {r["world_size"] for r in results} == {size}, results
    assert len({r["weights_sha256"] for r in results}) == 1, f"the replicas' weights differ: {results}"
    assert results[0]["test_samples"] == 359, results[0]  # exact evaluation: every test sample once
    assert results[0]["test_accuracy"] >= 0.97, results[0]


def _kill_rank_one_after_epoch_zero(progress, killed: list[int], stop: threading.Event) -> None:
    while not stop.is_set():
        found = [r for r in lines(progress) if r["epoch"] == 0 and r["rank"] == 1 and r["size"] == 2]
        if found:
            os.kill(found[0]["pid"], signal.SIGKILL)  # the rank's process, as the OOM killer would
            killed.append(found[0]["pid"])
            return
        time.sleep(0.1)


def run_losing_a_worker(launch, tmp_path, **kw) -> tuple[list[dict], int, list[dict]]:
    """Run train_torch_elastic.train with `launch` (hvdp.spark.run_elastic or hvdp.ray.run_elastic, `kw` its
    arguments), killing rank 1's process once both ranks finished epoch 0. Returns (every final rank's
    result, the killed pid, the progress lines)."""
    progress, killed, stop = tmp_path / "progress.jsonl", [], threading.Event()
    killer = threading.Thread(target=_kill_rank_one_after_epoch_zero, args=(progress, killed, stop), daemon=True)
    killer.start()
    try:
        results = launch("train_torch_elastic:train", args=(CFG, functools.partial(record, str(progress))),
                         all_ranks=True, **kw)
    finally:
        stop.set()
        killer.join(5)
    assert killed, f"the job ended before rank 1 finished epoch 0 on two ranks: {lines(progress)}"
    return results, killed[0], lines(progress)


def check_elastic(results: list[dict], killed: int, progress: list[dict]) -> list[int]:
    """Training went on after the kill to the last epoch, without the killed process, and the final ranks
    agree (check_replicas). Returns the world sizes the job (re)started at."""
    sizes = results[0]["world_sizes"]
    assert sizes[0] == 2 and len(sizes) >= 2, f"no reset after the kill: world sizes {sizes}"
    after = progress[next(i for i, r in enumerate(progress) if r["pid"] == killed) + 1:]
    assert {r["epoch"] for r in after} >= set(range(1, CFG.epochs)), f"epochs after the kill: {after}"
    assert killed not in {r["pid"] for r in after}, "the killed rank reported again"
    check_replicas(results, results[0]["world_size"])
    return sizes
