"""Train a small CNN on scikit-learn's handwritten digits with PyTorch Lightning, data-parallel over Horovod.

    python examples/train_lightning.py                                   # one process
    horovodrun -np 2 -H localhost:2 python examples/train_lightning.py   # two ranks
    mpirun --allow-run-as-root -np 2 python examples/train_lightning.py  # OpenMPI directly

A Lightning script moves to hvdp by one argument of the Trainer (strategy="hvdp") and the import that
registers it; the lines are tagged `# hvdp:`. The last line printed (rank 0) is `result: {json}`.

With --checkpoint-dir (what examples/slurm.sbatch passes: `sbatch examples/slurm.sbatch --script
examples/train_lightning.py`) the Trainer writes its checkpoints there and preemption is on: a stop signal makes
every rank write Lightning's HPC checkpoint there and exit 75; the requeued job's fit resumes from it (under
Slurm, Lightning's own rule).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

import hvdp.lightning  # noqa: F401  # hvdp: registers strategy="hvdp"
from common import digest, load_data, num_classes, print_result


class Digits(pl.LightningModule):
    def __init__(self, channels: int, classes: int, lr: float):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
            nn.Linear(16 * 16, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        # sync_dist=True: the epoch's value is the mean over every test sample, each scored once by one rank
        self.log("test_loss", F.cross_entropy(out, y), sync_dist=True)
        self.log("test_accuracy", (out.argmax(1) == y).float().mean(), sync_dist=True)
        self.log("test_samples", float(len(y)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        # the rate for one process's batch: hvdp scales it for the world (x ranks) and warms it up
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_data(None)
    train = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    test = torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))
    pl.seed_everything(0, verbose=False)
    model = Digits(x_train.shape[1], num_classes(y_train, y_test), args.lr)
    trainer = pl.Trainer(
        # hvdp: or strategy="hvdp"; preemption: a stop signal checkpoints every rank after the same step, exit 75
        strategy=hvdp.lightning.HorovodStrategy(warmup_steps=20, preemption=args.checkpoint_dir is not None),
        accelerator="cpu", max_epochs=args.epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=args.checkpoint_dir is not None,
        default_root_dir=args.checkpoint_dir)
    started = time.perf_counter()
    # batch_size per rank; hvdp replaces the sampler (every sample once per epoch, the order set by the seed)
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True))
    seconds = time.perf_counter() - started
    resumed_from, steps = trainer.ckpt_path, trainer.global_step  # fit's checkpoint (None: a fresh fit)
    # Under Slurm, Lightning's test(ckpt_path=None) loads the newest HPC checkpoint even when given the model:
    # after a requeue, the weights of the preempted step. "best" is the last epoch's checkpoint: these weights
    metrics = trainer.test(model, torch.utils.data.DataLoader(test, batch_size=64), verbose=False,
                           ckpt_path="best" if args.checkpoint_dir else None)[0]
    if trainer.is_global_zero:  # hvdp: rank 0 reports
        print_result({"test_accuracy": round(metrics["test_accuracy"], 4), "test_loss": round(metrics["test_loss"], 4),
                      "test_samples": int(metrics["test_samples"]), "world_size": trainer.world_size,
                      "epochs": args.epochs, "seconds": round(seconds, 2), "framework": "lightning",
                      "global_step": steps, "resumed_from": resumed_from,
                      "weights_sha256": digest(w.numpy() for w in model.state_dict().values())})


if __name__ == "__main__":
    main()
