"""Input-pipeline throughput: hvdp's sharded pipeline against the same pipeline written by hand, one framework.

Run under horovodrun (np 1 or more) by `hvdp bench`. Rank 0 first writes the data into --dir if it is not
there: --samples 3x64x64 uint8 images with labels, as 8 TFRecord files (TensorFlow) or one .npy file per
sample (PyTorch). Every repetition reads one epoch with each implementation in turn, interleaved (which one
goes first alternates), with the same per-sample work (decode, random crop and flip, scale to float):

- tensorflow, hvdp: shard(index_records(files), map=parse), one pread per record, exact order;
- tensorflow, hand: Horovod's recipe, the file list .shard(size, rank), interleave(TFRecordDataset),
  shuffle buffer, map(parse), batch, prefetch (not exact: ranks read other counts, the order is the buffer's);
- torch, hvdp: shard(dataset, num_workers=2) (workers started by forkserver once per run); torch, hand:
  DataLoader with DistributedSampler, 2 workers (the platform's fork, every epoch); torch, hvdp-fork: shard()
  as it was before issue 36 (fork, new workers every epoch); with --compare-starts, forkserver-per-epoch and
  spawn-per-epoch: shard() starting its workers anew every epoch with either safe method (what a stream's
  loader pays each epoch).

Rank 0 prints `bench: {json}` with each implementation's samples/s per rank (the ranks' mean) per repetition,
and for PyTorch each epoch's start-up: seconds from the start of the epoch to its first batch (the ranks'
mean), the warm-up epoch's (workers started for the first time) under "first_startup_s".

The loaders that fork their workers every epoch in this threaded process (`hand`, `hvdp-fork`) can deadlock:
a worker forked while another thread held a lock never starts (issue 36). They wait at most FORK_WAIT seconds
(HVDP_BENCH_FORK_WAIT) for a batch; then this rank kills their workers, every rank reads that epoch again,
and the report counts the epoch under "hangs". HVDP_BENCH_STALL=<loader>:<epoch>:<rank> makes that loader's
workers on that rank wait forever in that epoch's first try, as a deadlocked fork does (the test's hook).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import struct
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = (64, 64, 3)
CROP = 56
FILES = 8
FORK_WAIT = float(os.environ.get("HVDP_BENCH_FORK_WAIT", "60"))
HANG_RETRIES = 3  # a fork loader's epoch read again after a deadlock, at most this many times


def _write(directory: Path, samples: int, framework: str) -> None:
    from hvdp.core.records import frame

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (samples, *SHAPE), dtype=np.uint8)
    labels = rng.integers(0, 10, samples)
    if framework == "tensorflow":
        for k, part in enumerate(np.array_split(np.arange(samples), FILES)):
            data = b"".join(frame(struct.pack("<q", int(labels[i])) + images[i].tobytes()) for i in part)
            (directory / f"part-{k}.tfrecord").write_bytes(data)
    else:
        (directory / "samples").mkdir()
        for i in range(samples):
            np.save(directory / "samples" / f"{i:06d}.npy", images[i])
        np.save(directory / "labels.npy", labels)
    (directory / "done").write_text(str(samples))


def _tensorflow(directory: Path, batch: int, rank: int, size: int):
    import tensorflow as tf

    import hvdp.tensorflow as htf

    files = sorted(str(p) for p in directory.glob("part-*.tfrecord"))

    def parse(record):
        label = tf.io.decode_raw(tf.strings.substr(record, 0, 8), tf.int64)[0]
        image = tf.reshape(tf.io.decode_raw(tf.strings.substr(record, 8, tf.strings.length(record) - 8), tf.uint8),
                           SHAPE)
        image = tf.image.random_flip_left_right(tf.image.random_crop(image, (CROP, CROP, 3)))
        return tf.cast(image, tf.float32) / 255.0, label

    hvdp_data = htf.shard(htf.index_records(files), batch_size=batch, seed=0, map=parse)

    def hand(epoch):
        return (tf.data.Dataset.from_tensor_slices(files).shard(size, rank).shuffle(len(files), seed=epoch)
                .interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE)
                .shuffle(1024, seed=epoch).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch).prefetch(tf.data.AUTOTUNE))

    def count(dataset):
        return sum(int(y.shape[0]) for _, y in dataset)

    return {"hvdp": lambda epoch, attempt: (count(hvdp_data), None),
            "hand": lambda epoch, attempt: (count(hand(epoch)), None)}


class _Images:
    """One .npy image per sample; __getitem__ does the per-sample work (in the DataLoader's workers)."""

    def __init__(self, directory: Path):
        self.paths = sorted((directory / "samples").glob("*.npy"))
        self.labels = np.load(directory / "labels.npy")
        self.stall = False  # set while a fork loader reads: the workers it forks inherit it (HVDP_BENCH_STALL)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch

        while self.stall:
            time.sleep(1)
        image = np.load(self.paths[i])
        rng = np.random.default_rng()
        top, left = rng.integers(0, SHAPE[0] - CROP + 1, 2)
        image = image[top:top + CROP, left:left + CROP]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))).float() / 255.0, int(self.labels[i])


def _torch(directory: Path, batch: int, rank: int, size: int, compare_starts: bool = False):
    import torch

    import hvdp.torch as hvdp_torch

    dataset = _Images(directory)
    fork = {"multiprocessing_context": "fork", "persistent_workers": False, "timeout": FORK_WAIT}
    loaders = {"hvdp": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2),
               "hvdp-fork": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2, **fork)}
    if compare_starts:
        loaders.update({"forkserver-per-epoch": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2,
                                                                 persistent_workers=False),
                        "spawn-per-epoch": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2,
                                                            multiprocessing_context="spawn", persistent_workers=False)})
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=size, rank=rank, seed=0)
    loaders["hand"] = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=2,
                                                  timeout=FORK_WAIT)  # the platform's fork, every epoch
    stall = os.environ.get("HVDP_BENCH_STALL", "")

    def reader(name):
        def read(epoch, attempt):
            if name == "hand":
                sampler.set_epoch(epoch)
            start, samples, startup, timed_out = time.perf_counter(), 0, None, False
            before = set(multiprocessing.active_children())  # hvdp's kept workers are not this read's
            dataset.stall = not attempt and stall == f"{name}:{epoch}:{rank}"  # workers forked now inherit it
            batches = iter(loaders[name])
            try:
                for _, y in batches:
                    if startup is None:
                        startup = time.perf_counter() - start
                    samples += len(y)
            except RuntimeError as error:  # "DataLoader timed out after N seconds": a worker never started
                if "timed out" not in str(error):
                    raise
                timed_out = True
            finally:
                dataset.stall = False
            if not timed_out:
                return samples, startup
            # A deadlocked fork ignores the loader's SIGTERM: kill it. torch's SIGCHLD handler raises "DataLoader
            # worker is killed by signal" in the main thread for a dead worker of a live iterator (seen in make
            # test under load), so it is set aside until the iterator has let go of its workers (del: its
            # shutdown unregisters them). Blocking SIGCHLD would not do: another thread would take it.
            handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                for worker in set(multiprocessing.active_children()) - before:
                    os.kill(worker.pid, signal.SIGKILL)
                    worker.join()
                del batches
            finally:
                signal.signal(signal.SIGCHLD, handler)
            return None, None
        return read

    return {name: reader(name) for name in loaders}


def _read_everywhere(hvd, name: str, read_epoch, epoch: int, hangs: dict[str, int]) -> tuple[float, float | None]:
    """One epoch of `name` read on every rank: (samples/s per rank, start-up s), the ranks' means; an epoch
    that hung on any rank is read again on every rank (counted in `hangs`)."""
    for attempt in range(HANG_RETRIES + 1):
        hvd.broadcast_object(0, name=f"bench.start.{epoch}.{name}.{attempt}")
        start = time.perf_counter()
        samples, startup = read_epoch(epoch, attempt)
        rate = None if samples is None else samples / (time.perf_counter() - start)
        gathered = hvd.allgather_object((rate, startup), name=f"bench.rate.{epoch}.{name}.{attempt}")
        if all(r is not None for r, _ in gathered):
            return tuple(float(np.mean(v)) if v[0] is not None else None for v in zip(*gathered))
        hangs[name] = hangs.get(name, 0) + 1
    raise RuntimeError(f"pipeline bench: {name}'s workers deadlocked in all {HANG_RETRIES + 1} tries of epoch "
                       f"{epoch} (no batch for {FORK_WAIT:.0f} s on ranks "
                       f"{[r for r, (rate, _) in enumerate(gathered) if rate is None]})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("tensorflow", "torch"), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compare-starts", action="store_true",
                        help="torch: also shard() starting its workers anew every epoch by forkserver and by spawn")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    if args.framework == "tensorflow":
        import hvdp.tensorflow as adapter
    else:
        import hvdp.torch as adapter
    world = adapter.init()
    hvd = adapter.hvd
    directory = Path(args.dir)
    if world.rank == 0 and not (directory / "done").exists():
        _write(directory, args.samples, args.framework)
    hvd.broadcast_object(0, name="bench.written")  # a barrier: the files exist

    if args.framework == "tensorflow":
        impls = _tensorflow(directory, args.batch, world.rank, world.size)
    else:
        impls = _torch(directory, args.batch, world.rank, world.size, args.compare_starts)
    rates: dict[str, list[float]] = {name: [] for name in impls}
    startups: dict[str, list[float]] = {name: [] for name in impls}
    first: dict[str, float] = {}
    hangs: dict[str, int] = {}
    for epoch in range(args.reps + 1):  # the first round warms up (file cache, workers, tf.data graphs)
        # ABBA: which implementation goes first alternates, so neither always follows the other's teardown
        for name, read_epoch in list(impls.items())[::1 if epoch % 2 else -1]:
            mean, startup = _read_everywhere(hvd, name, read_epoch, epoch, hangs)
            if epoch:
                rates[name].append(mean)
                if startup is not None:
                    startups[name].append(startup)
            elif startup is not None:
                first[name] = startup
    if world.rank == 0:
        report = {"framework": args.framework, "np": world.size, "samples": args.samples, "batch": args.batch,
                  "samples_per_sec_per_rank": rates, "hangs": hangs}
        if first:
            report.update({"startup_s": startups, "first_startup_s": first})
        print("bench: " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
