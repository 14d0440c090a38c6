"""Resume at another world size (tests/test_resume_resize.py): `worker_resize.py LOAD_DIR SAVE_DIR`.

Loads the newest checkpoint in LOAD_DIR (when not '-'), reports the learning rate it then has, trains one
epoch and saves an end-of-epoch checkpoint in SAVE_DIR. Rank 0 prints `result: {...}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.torch as ht  # noqa: E402

BASE_LR = 0.05

world = ht.init()
load_dir, save_dir = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
loader = ht.shard(data, batch_size=4)
state = ht.load_checkpoint(load_dir, model, opt, loader) if load_dir != "-" else None
epoch = state["epoch"] if state else 0
lr_after_load = ht.current_lr(opt)
for x, y in loader:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
ht.save_checkpoint(save_dir, model, opt, epoch=epoch + 1, step=0, global_step=epoch + 1)
if world.rank == 0:
    print("result: " + json.dumps({"size": world.size, "lr": lr_after_load, "base": BASE_LR,
                                   "resumed_epoch": epoch}), flush=True)
