"""Many epochs of shard(num_workers=2) in a rank whose threads run (Horovod's background thread, hvdp's
watchdog, the loaders' queue feeders), with the ranks made uneven: `worker_starts.py OUT TMP EPOCHS`.

Every epoch each rank reads three loaders: a map-style dataset with shard()'s defaults (its workers start once
per run), the same with persistent_workers=False and a stream (both start their 2 workers every epoch), so
EPOCHS epochs start about 4 * EPOCHS worker processes per rank. Every 4th epoch the same map-style
dataset is read by a loader shard() builds anew (its workers start anew too). Rank (epoch % size) sleeps a
few milliseconds before each loader, and one rank's samples cost more to make, so the ranks reach the
collectives at different moments and fork while the other's collective is in flight. After each epoch the
ranks gather what they read: every sample must have been read exactly once by one rank, in the same number
of steps on every rank; rank 0 writes {"epochs", "starts" (per rank, counted by worker_init_fn), "wrong",
"errors", "seconds"} to OUT.

Run by tests/torch/test_worker_starts.py under horovodrun with a time limit: a worker that deadlocks while it
starts (the fork-in-a-threaded-process hang of issue 36) leaves its rank waiting for a batch and the other
in the epoch's allgather until the limit.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import hvdp.torch as ht  # noqa: E402

SAMPLES = 96  # 12 steps of 4 per rank at np=2: every sample once, no top-up
BATCH = 4


class Indexed(torch.utils.data.Dataset):
    """Sample i is i; `spin` iterations of busy work per sample make one rank's data slower to read."""

    def __init__(self, n: int, spin: int):
        self.n, self.spin = n, spin

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = 0
        for k in range(self.spin):
            x += k
        return torch.tensor([i], dtype=torch.int64)


class Counting(torch.utils.data.IterableDataset):
    """The stream 0, 1, ..., n-1 (every rank and worker reads all of it and keeps its part)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return (torch.tensor([i], dtype=torch.int64) for i in range(self.n))


def count_start(path: str, worker_id: int) -> None:
    """worker_init_fn: one line per worker start-up, appended to this rank's file."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {worker_id}\n")


def ids(loader) -> tuple[int, list[int]]:
    steps, seen = 0, []
    for batch in loader:
        steps += 1
        seen += batch.flatten().tolist()
    return steps, seen


def main() -> None:
    out, tmp, epochs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    world = ht.init()
    rank, size = world.rank, world.size
    starts = tmp / f"starts-{rank}"
    starts.write_text("")
    init_fn = functools.partial(count_start, str(starts))
    spin = 20_000 if rank == size - 1 else 0
    data = Indexed(SAMPLES, spin)

    def loaders(epoch):
        yield "default", kept
        yield "per-epoch", per_epoch
        yield "stream", stream
        if epoch % 4 == 3:
            yield "new", ht.shard(data, batch_size=BATCH, seed=epoch, num_workers=2, worker_init_fn=init_fn)

    kept = ht.shard(data, batch_size=BATCH, num_workers=2, worker_init_fn=init_fn)
    per_epoch = ht.shard(data, batch_size=BATCH, num_workers=2, worker_init_fn=init_fn, persistent_workers=False)
    stream = ht.shard(Counting(SAMPLES), batch_size=BATCH, num_workers=2, worker_init_fn=init_fn)
    rng = random.Random(rank)
    wrong, errors, start = 0, [], time.monotonic()
    for epoch in range(epochs):
        for name, loader in loaders(epoch):
            if epoch % size == rank:
                time.sleep(rng.uniform(0, 0.02))
            steps, seen = ids(loader)
            everyone = ht.hvd.allgather_object((steps, seen), name=f"starts.{epoch}.{name}")
            union = sorted(i for _, part in everyone for i in part)
            if len({s for s, _ in everyone}) != 1 or union != list(range(SAMPLES)):
                wrong += 1
                errors.append(f"epoch {epoch} {name}: steps {[s for s, _ in everyone]}, "
                              f"{len(union)} ids, {len(set(union))} distinct")
        if rank == 0 and epoch % 10 == 0:
            print(f"worker_starts: epoch {epoch} after {time.monotonic() - start:.1f} s", flush=True)
    seconds = time.monotonic() - start
    counts = ht.hvd.allgather_object(len(starts.read_text().splitlines()), name="starts.count")
    if rank == 0:
        out.write_text(json.dumps({"epochs": epochs, "starts": counts, "wrong": wrong, "errors": errors[:10],
                                   "seconds": seconds}))
    print(f"worker_starts: rank {rank} done, {counts[rank]} worker start-ups in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
