"""Checkpoint I/O at its limits, at np=2: `--framework torch|tf --case CASE:DIR [--case CASE:DIR ...]`, the
cases one after another in one launch, CASE one of big, readonly, full, deleted.

big (torch): a model whose state is over 2 GiB (three 768 MiB parameters) is saved and loaded; prints
each rank's peak extra anonymous memory while loading and whether its tensors came back exactly.
readonly / full: save_checkpoint into a read-only or full filesystem; deleted: the newest checkpoint is
deleted between rank 0's listing and its read. Each rank prints the CheckpointError it got, prefixed with
the case, and the ranks meet in one more collective after each case, so a rank left waiting shows as a hang.
"""

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

p = argparse.ArgumentParser()
p.add_argument("--case", action="append", required=True, metavar="CASE:DIR")
p.add_argument("--framework", choices=["torch", "tf"], default="torch")
args = p.parse_args()
cases = [tuple(c.split(":", 1)) for c in args.case]
assert all(name in ("big", "readonly", "full", "deleted") for name, _ in cases), cases


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """The largest RssAnon seen while the block runs (sampled every 20 ms), minus the value before it."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        self.extra = self.peak - self.base


if args.framework == "torch":
    import torch
    import hvdp.torch as ht
    world = ht.init()
    hvd = ht.hvd
    model = torch.nn.Linear(64, 64)
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.randn(4, 64)).sum().backward()
    opt.step()

    def save(directory, step):
        return ht.save_checkpoint(directory, model, opt, epoch=0, step=0, global_step=step)

    def load(directory):
        return ht.load_checkpoint(directory, model, opt)

    def meet():
        hvd.allreduce(torch.ones(1), name="meet")
else:
    import keras
    import numpy as np
    import hvdp.keras as hk
    world = hk.init()
    hvd = hk.hvd
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((8, 8)), np.ones((8, 4)), epochs=1, verbose=0, callbacks=hk.callbacks())

    def save(directory, step):
        return hk.save_checkpoint(directory, model, model.optimizer, epoch=0, step=0, global_step=step)

    def load(directory):
        return hk.load_checkpoint(directory, model, model.optimizer)

    def meet():
        import tensorflow as tf
        hvd.allreduce(tf.ones(1), name="meet")

from hvdp.core import checkpoint as ckpt  # noqa: E402
from hvdp.core.errors import CheckpointError  # noqa: E402


def expect_error(case, what, fn):
    try:
        fn()
        print(f"[{case}] rank {world.rank}: {what} succeeded", flush=True)
    except CheckpointError as e:
        print(f"[{case}] rank {world.rank}: CheckpointError: {e}", flush=True)


def big(directory):
    n = 768 << 18  # 768 MiB of float32 per parameter, three of them: 2.25 GiB of state
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(n)) for _ in range(3)])
    for i, param in enumerate(params):  # a pattern every rank can check without a second copy
        with torch.no_grad():
            param.copy_(torch.arange(n, dtype=torch.float32).remainder_(1000 + i))
    big_opt = ht.prepare(params, torch.optim.SGD(params.parameters(), lr=0.1))
    path = ht.save_checkpoint(directory, params, big_opt, epoch=0, step=0, global_step=1)
    if world.is_main:
        print(f"checkpoint bytes {path.stat().st_size}", flush=True)
    for param in params:
        param.data.zero_()
    with PeakAnon() as peak:
        ht.load_checkpoint(directory, params, big_opt)
    exact = all(torch.equal(param.data, torch.arange(n, dtype=torch.float32).remainder_(1000 + i))
                for i, param in enumerate(params))
    print(f"rank {world.rank}: exact {exact} state bytes {3 * n * 4} extra anon bytes while loading {peak.extra}",
          flush=True)


def deleted(directory):
    save(directory, 1)
    real = ckpt.latest_checkpoint

    def listed_then_deleted(where):
        path = real(where)
        path.unlink()  # another job pruning the same directory, between the listing and the read
        return path
    if world.is_main:
        ckpt.latest_checkpoint = listed_then_deleted
    try:
        expect_error("deleted", "load", lambda: load(directory))
    finally:
        ckpt.latest_checkpoint = real


for case, directory in cases:
    if case == "big":
        big(directory)
    elif case in ("readonly", "full"):
        expect_error(case, "save", lambda: save(directory, 1))
    else:
        deleted(directory)
    meet()
print(f"rank {world.rank}: done", flush=True)
