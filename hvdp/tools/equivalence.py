"""The N x b == 1 x N*b experiment behind `hvdp verify` and the equivalence tests.

Runs inside a launched job. Every rank builds the model from a different seed (so the broadcast is
exercised), trains `steps` optimizer steps through the hvdp adapter on its shard, and rank 0 replays the
same steps as one plain process on the union batches. Returns a dict on every rank:
{"rank", "size", "framework", "optimizer", "steps", "max_abs_diff", "replicas_identical"}.
"""

from __future__ import annotations

import math

import numpy as np

from hvdp.core.scaling import lr_multiplier
from hvdp.core.sharding import ShardPlan


def synthetic_data(n: int, input_shape: tuple[int, ...], classes: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *input_shape)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


def run(framework: str, **kw) -> dict:
    return {"torch": _torch}[framework](**kw)


def _torch(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
           factory=None, input_shape: tuple[int, ...] = (20,)) -> dict:
    import copy

    import torch
    import torch.nn.functional as F

    import hvdp.torch as ht
    from hvdp.core.errors import DivergenceError

    world = ht.init()
    torch.manual_seed(seed + 1000 * world.rank + 1)  # deliberately different initial weights per rank
    if factory is not None:
        model = factory()
    else:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 32),
                                    torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        classes = model(torch.zeros(2, *input_shape)).shape[-1]

    def make_optimizer(params, rate):
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=rate)
        return torch.optim.SGD(params, lr=rate, momentum=0.9)

    n = steps * accumulate * world.size * batch_size
    x, y = (torch.from_numpy(a) for a in synthetic_data(n, input_shape, classes, seed))
    # Rank 0's initial weights are what every rank holds after the broadcast in prepare().
    reference = copy.deepcopy(model) if world.rank == 0 else None

    dist = ht.prepare(model, make_optimizer(model.parameters(), lr), backward_passes_per_step=accumulate)
    loader = ht.shard(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, seed=seed)
    for i, (xb, yb) in enumerate(loader):
        F.cross_entropy(model(xb), yb).backward()
        if (i + 1) % accumulate == 0:
            dist.step()
            dist.zero_grad()

    try:
        ht.check_consistency(model)
        identical = True
    except DivergenceError:
        identical = False

    diff = None
    if reference is not None:
        ref_opt = make_optimizer(reference.parameters(), lr * lr_multiplier(
            "linear", world.size, backward_passes_per_step=accumulate))
        plan = ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed)
        for idx in plan.batches(epoch=0):
            idx = torch.from_numpy(idx)
            F.cross_entropy(reference(x[idx]), y[idx]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                              reference.state_dict().values()))
    diff = ht.hvd.broadcast_object(diff, root_rank=0, name="hvdp.verify.diff")
    return {"rank": world.rank, "size": world.size, "framework": "torch", "optimizer": optimizer,
            "steps": steps, "accumulate": accumulate, "max_abs_diff": diff, "replicas_identical": identical}
