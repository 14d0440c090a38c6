"""Train a small CNN on scikit-learn's handwritten digits with PyTorch, data-parallel over Horovod.

    python examples/train_torch.py                                   # one process
    horovodrun -np 2 -H localhost:2 python examples/train_torch.py   # two ranks
    mpirun --allow-run-as-root -np 2 python examples/train_torch.py  # OpenMPI directly

Every line that distribution costs is tagged `# hvdp:`. The last line printed is `result: {json}`.
train(cfg) is the whole job as a function, which examples/train_on_cluster.py runs on Spark and Ray.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hvdp
import hvdp.torch as hvdp_torch
from common import (DEFAULTS, digest, fail, load_data, num_classes, parse_config, print_result,
                    summary, write_files)
from hvdp.core.checkpoint import write_atomic
from hvdp.core.errors import ConfigError, HvdpError


class Net(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(4), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x):
        return self.head(self.features(x))


class SampleFiles(torch.utils.data.Dataset):
    """One .npy file per sample in DIR/samples and the labels in DIR/labels.npy (common.write_files)."""

    def __init__(self, directory: str):
        self.paths = sorted((Path(directory) / "samples").glob("*.npy"))
        labels = Path(directory) / "labels.npy"
        self.labels = np.load(labels, allow_pickle=False) if labels.exists() else np.zeros(0, np.int64)
        if not self.paths or len(self.paths) != len(self.labels):
            raise ConfigError(f"--files {directory}: {len(self.paths)} samples/*.npy files for {len(self.labels)} "
                              f"labels in labels.npy; they must match one to one")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):  # read in the DataLoader's worker processes
        return torch.from_numpy(np.load(self.paths[i], allow_pickle=False)), int(self.labels[i])


def training_set(cfg, x: np.ndarray, y: np.ndarray, world) -> tuple[torch.utils.data.Dataset, dict]:
    """The training samples, in memory or (--files) one file each, and the DataLoader arguments to read them."""
    if not cfg.files:
        return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), {}
    if world.is_main:  # hvdp: one rank writes the files, the others wait for them
        write_files(cfg.files, x, y, "npy")
    hvdp_torch.barrier()
    return SampleFiles(cfg.files), {"num_workers": 2}


def train(cfg) -> dict:
    """Train and evaluate on every rank (every rank must call it); returns this rank's summary, with its
    rank and the digest of its final weights. Rank 0 also saves the model (--save-model)."""
    # hvdp: rank, size, its own GPU if any; with a checkpoint directory, SIGTERM/SIGUSR1 (preemption) checkpoint
    world = hvdp_torch.init(timeline=cfg.timeline, device=cfg.device, preemption=cfg.checkpoint_dir is not None)
    device = hvdp_torch.device()  # hvdp: this rank's GPU (cuda:local_rank) or the CPU
    torch.manual_seed(cfg.seed)

    x_train, y_train, x_test, y_test = load_data(cfg.data)
    train_set, reading = training_set(cfg, x_train, y_train, world)
    test_set = torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))
    model = Net(x_train.shape[1], num_classes(y_train, y_test)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

    # hvdp: this rank's batches
    loader = hvdp_torch.shard(train_set, batch_size=cfg.batch_size, seed=cfg.seed,
                              pin_memory=device.type == "cuda", **reading)
    steps_per_epoch = len(loader) // cfg.accumulate
    optimizer = hvdp_torch.prepare(  # hvdp: scale LR, all-reduce gradients, broadcast rank 0's state
        model, optimizer, lr_scaling=cfg.lr_scaling, warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        compression=cfg.compression, op=cfg.op, backward_passes_per_step=cfg.accumulate)
    # Any torch scheduler composes with hvdp's warmup: it schedules the scaled rate.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * steps_per_epoch)
    resumed = hvdp_torch.load_checkpoint(cfg.checkpoint_dir, model, optimizer, loader)  # hvdp: resume
    start_epoch, start_step = (resumed["epoch"], resumed["step"]) if resumed else (0, 0)
    global_step = resumed["global_step"] if resumed else 0
    if resumed:
        scheduler.load_state_dict(resumed["scheduler"])
        hvdp_torch.log(f"resumed from epoch {start_epoch} step {start_step} (optimizer step {global_step})")

    def save(epoch: int, step: int, **extra) -> None:  # hvdp: rank 0 writes atomically, every rank calls
        hvdp_torch.save_checkpoint(cfg.checkpoint_dir, model, optimizer, epoch=epoch, step=step,
                                   global_step=global_step, keep=cfg.keep_checkpoints,
                                   scheduler=scheduler.state_dict(), **extra)

    writer = None
    if cfg.logdir and world.is_main:  # hvdp: only rank 0 writes logs
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(cfg.logdir)

    hvdp_torch.log(f"training on {world.size} rank(s): batch {cfg.batch_size}/rank x {cfg.accumulate} "
                   f"accumulated = {world.size * cfg.batch_size * cfg.accumulate}/step, "
                   f"lr {cfg.lr} -> {hvdp_torch.current_lr(optimizer) if not cfg.warmup_epochs else 'warmup'}")
    samples, started = 0, time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        first = start_step if epoch == start_epoch else 0
        # the mean loss over the ranks of a preempted epoch's first `first` batches, summed
        epoch_loss, batches = (resumed.get("epoch_loss", 0.0), first) if first else (0.0, 0)
        for step, (x, y) in enumerate(hvdp_torch.progress(loader, desc=f"epoch {epoch}", leave=False), first):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            hvdp_torch.check_finite(loss, global_step)  # hvdp: NaN/inf on any rank stops all, naming it
            loss.backward()
            epoch_loss, batches, samples = epoch_loss + loss.item(), batches + 1, samples + len(y)
            if (step + 1) % cfg.accumulate == 0 or step + 1 == len(loader):
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                global_step += 1
                if hvdp_torch.preempted():  # hvdp: a stop signal on any rank: every rank stops after this step
                    save(epoch, step + 1, epoch_loss=hvdp_torch.average(epoch_loss))
                    hvdp_torch.exit_for_requeue()  # hvdp: exit 75, and the job script requeues the job
        train_loss = hvdp_torch.average(epoch_loss / max(batches, 1))  # hvdp: mean over ranks
        metrics = hvdp_torch.evaluate(model, test_set)  # hvdp: every test sample counted once
        elapsed = time.perf_counter() - started
        hvdp_torch.log(f"epoch {epoch}: loss {train_loss:.4f}  test accuracy {metrics['accuracy']:.4f}  "
                       f"lr {hvdp_torch.current_lr(optimizer):.4f}")
        if writer:
            for name, value in (("loss/train", train_loss), ("loss/test", metrics["loss"]),
                                ("accuracy/test", metrics["accuracy"]), ("lr", hvdp_torch.current_lr(optimizer)),
                                ("samples_per_sec", samples * world.size / elapsed), *hvdp.straggler_scalars()):
                writer.add_scalar(name, value, epoch)  # step_ms/<part>/rank<r>: the straggler report's figures
        if cfg.checkpoint_dir:
            save(epoch + 1, 0)
    seconds = time.perf_counter() - started

    hvdp_torch.check_consistency(model)  # hvdp: raises, naming rank and parameter, if replicas diverged
    metrics = hvdp_torch.evaluate(model, test_set)
    if writer:
        writer.close()
    weights = {k: v.cpu() for k, v in model.state_dict().items()}  # loadable without a GPU
    if world.is_main and cfg.save_model:  # hvdp: rank 0 saves
        write_atomic(Path(cfg.save_model), lambda f: torch.save(weights, f))
    return summary(metrics, framework="torch", world_size=world.size, epochs=cfg.epochs,
                   samples=samples * world.size, seconds=seconds, rank=world.rank,
                   weights_sha256=digest(w.numpy() for w in weights.values()))


def main() -> None:
    result = train(parse_config(__doc__.splitlines()[0], **DEFAULTS))
    if result["rank"] == 0:  # hvdp: rank 0 reports
        print_result(result)


if __name__ == "__main__":
    try:
        main()
    except HvdpError as e:
        fail(e)
