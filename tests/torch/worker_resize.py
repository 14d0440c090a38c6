"""Resume at another world size (tests/test_resume_resize.py): `worker_resize.py LOAD_DIR SAVE_DIR`.

Loads the newest checkpoint in LOAD_DIR (when not '-'), reports the learning rate it then has, trains one
epoch and saves an end-of-epoch checkpoint in SAVE_DIR. Rank 0 prints `result: {...}`.

The same for one model per torch LR scheduler in SCHEDULERS (in LOAD_DIR/<name>, SAVE_DIR/<name>), as
examples/train_torch.py does it: the scheduler's state_dict() saved among the checkpoint's extras and loaded
after load_checkpoint. Those report the rate of every step they take, with the optimizer step it was taken at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.optim import lr_scheduler  # noqa: E402

import hvdp.torch as ht  # noqa: E402

BASE_LR = 0.05
WARMUP = 6          # optimizer steps: the ramp runs into the second run of the chain
TOTAL_STEPS = 20    # OneCycleLR's and CosineAnnealingLR's length; the chain np=2, 1, 2 takes 4 + 8 + 4 steps
SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.25 * t)),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL_STEPS),
    # OneCycleLR sets the rate from max_lr itself: give it the rates prepare() scaled
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups],
                                                      total_steps=TOTAL_STEPS),
}

world = ht.init()
load_dir, save_dir = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))


def fresh(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, ht.prepare(model, torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9), **kw), \
        ht.shard(data, batch_size=4)


def epoch(model, opt, loader, scheduler=None, step=0):
    rates = []
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        rates.append([step, ht.current_lr(opt)])
        opt.step()
        if scheduler is not None:
            scheduler.step()
        step += 1
    return rates, step


model, opt, loader = fresh()
state = ht.load_checkpoint(load_dir, model, opt, loader) if load_dir != "-" else None
resumed_epoch = state["epoch"] if state else 0
lr_after_load = ht.current_lr(opt)
epoch(model, opt, loader)
ht.save_checkpoint(save_dir, model, opt, epoch=resumed_epoch + 1, step=0, global_step=resumed_epoch + 1)

schedulers = {}
for name, make in SCHEDULERS.items():
    model, opt, loader = fresh(warmup_steps=WARMUP)
    scheduler = make(opt)
    state = ht.load_checkpoint(Path(load_dir) / name, model, opt, loader) if load_dir != "-" else None
    if state:
        scheduler.load_state_dict(state["scheduler"])
    rates, step = epoch(model, opt, loader, scheduler, state["global_step"] if state else 0)
    ht.save_checkpoint(Path(save_dir) / name, model, opt, epoch=resumed_epoch + 1, step=0, global_step=step,
                       scheduler=scheduler.state_dict())
    schedulers[name] = rates

if world.rank == 0:
    print("result: " + json.dumps({"size": world.size, "lr": lr_after_load, "base": BASE_LR,
                                   "resumed_epoch": resumed_epoch, "warmup": WARMUP, "total_steps": TOTAL_STEPS,
                                   "schedulers": schedulers}), flush=True)
