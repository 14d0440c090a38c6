"""Trains a few steps with a checkpoint after every step, resuming from --dir when it holds one; writes the
final weights to --out. Large enough (~24 MB per checkpoint) that a save takes a visible moment, so a kill
can land inside it."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.torch as ht  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

world = ht.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Dropout(0.1), torch.nn.Linear(2048, 4))
opt = ht.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3), warmup_steps=4)
data = torch.utils.data.TensorDataset(torch.randn(64, 1024), torch.randint(0, 4, (64,)))
loader = ht.shard(data, batch_size=8, seed=1)
state = ht.load_checkpoint(args.dir, model, opt, loader)
epoch, first, global_step = (state["epoch"], state["step"], state["global_step"]) if state else (0, 0, 0)
while global_step < args.steps:
    for step, (x, y) in enumerate(loader, first):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        global_step += 1
        done_epoch = step + 1 == len(loader)
        ht.save_checkpoint(args.dir, model, opt, epoch=epoch + done_epoch, step=0 if done_epoch else step + 1,
                           global_step=global_step, keep=2)
        if global_step == args.steps:
            break
    epoch, first = epoch + 1, 0
if world.is_main:
    torch.save(model.state_dict(), args.out)
