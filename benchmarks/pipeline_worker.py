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
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = (64, 64, 3)
CROP = 56
FILES = 8


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

    return {"hvdp": lambda epoch: count(hvdp_data), "hand": lambda epoch: count(hand(epoch))}


class _Images:
    """One .npy image per sample; __getitem__ does the per-sample work (in the DataLoader's workers)."""

    def __init__(self, directory: Path):
        self.paths = sorted((directory / "samples").glob("*.npy"))
        self.labels = np.load(directory / "labels.npy")

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch

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
    loaders = {"hvdp": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2),
               "hvdp-fork": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2,
                                             multiprocessing_context="fork", persistent_workers=False)}
    if compare_starts:
        loaders.update({"forkserver-per-epoch": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2,
                                                                 persistent_workers=False),
                        "spawn-per-epoch": hvdp_torch.shard(dataset, batch_size=batch, seed=0, num_workers=2,
                                                            multiprocessing_context="spawn", persistent_workers=False)})
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=size, rank=rank, seed=0)
    loaders["hand"] = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=2)

    def reader(name):
        def read(epoch):
            if name == "hand":
                sampler.set_epoch(epoch)
            start, samples, startup = time.perf_counter(), 0, None
            for _, y in loaders[name]:
                if startup is None:
                    startup = time.perf_counter() - start
                samples += len(y)
            return samples, startup
        return read

    return {name: reader(name) for name in loaders}


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
    for epoch in range(args.reps + 1):  # the first round warms up (file cache, workers, tf.data graphs)
        # ABBA: which implementation goes first alternates, so neither always follows the other's teardown
        for name, read_epoch in list(impls.items())[::1 if epoch % 2 else -1]:
            hvd.broadcast_object(0, name=f"bench.start.{epoch}.{name}")
            start = time.perf_counter()
            samples = read_epoch(epoch)
            samples, startup = samples if isinstance(samples, tuple) else (samples, None)
            rate = samples / (time.perf_counter() - start)
            mean, startup = (float(np.mean(v)) if v[0] is not None else None for v in
                             zip(*hvd.allgather_object((rate, startup), name=f"bench.rate.{epoch}.{name}")))
            if epoch:
                rates[name].append(mean)
                if startup is not None:
                    startups[name].append(startup)
            elif startup is not None:
                first[name] = startup
    if world.rank == 0:
        report = {"framework": args.framework, "np": world.size, "samples": args.samples, "batch": args.batch,
                  "samples_per_sec_per_rank": rates}
        if first:
            report.update({"startup_s": startups, "first_startup_s": first})
        print("bench: " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
