"""`hvdp verify --framework lightning`: the N x b == 1 x N*b experiment through Lightning's Trainer.

N ranks fit a LightningModule with Trainer(strategy=HorovodStrategy(...)) for one epoch of `steps` optimizer
steps (and a short last one); rank 0 replays the same epoch as one plain torch process, without Lightning, on the
global batches of hvdp's epoch order at N times the rate, with Lightning's own meaning of accumulate_grad_batches
(each pass's loss divided by k) and gradient_clip_val (the global norm). compare_lightning returns what
equivalence.compare_torch returns, so that `hvdp verify` and `hvdp verify --zoo` print and explain it alike.

The model: a LightningModule of the user's (--model FACTORY returning one: its training_step(batch, batch_idx)
and configure_optimizers are what both sides run; batch is (inputs..., target)), or a torch module, which
_Wrapped makes into one (its loss and optimizer are the zoo case's, or `hvdp verify`'s).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

import hvdp.torch as ht
from hvdp._horovod import gather_or_raise
from hvdp.core.errors import DivergenceError
from hvdp.core.sharding import ShardPlan
from hvdp.lightning._package import pl
from hvdp.lightning.trainer import HorovodStrategy, _unwrapped
from hvdp.tools import equivalence


class _Wrapped(pl.LightningModule):
    """A torch module as a LightningModule: `loss(model, inputs, target)` its training step (default
    cross-entropy), `optimizer(model, lr)` its configure_optimizers; `before_step(step, model, optimizer, lr)` called
    as each optimizer step's first batch begins (a fine-tuning recipe), with the optimizer hvdp prepared."""

    def __init__(self, model: torch.nn.Module, optimizer: Callable, lr: float, loss: Callable | None = None,
                 before_step: Callable | None = None, accumulate: int = 1):
        super().__init__()
        self.model = model
        self._make, self._lr, self._loss = optimizer, lr, loss or equivalence._cross_entropy
        self._before, self._accumulate = before_step, accumulate
        self.seen: list[list[int]] = []  # the sample indices of each optimizer step (the first tensor of a batch)

    def training_step(self, batch, batch_idx):
        index, *inputs, target = batch
        if batch_idx % self._accumulate == 0:
            self.seen.append([])
        self.seen[-1] += index.tolist()
        return self._loss(self.model, tuple(inputs), target)

    def on_train_batch_start(self, batch, batch_idx):
        if self._before is not None and batch_idx % self._accumulate == 0:
            self._before(self.trainer.global_step, self.model, _unwrapped(self.trainer.strategy.optimizers[0]),
                         self._lr)

    def configure_optimizers(self):
        return self._make(self.model, self._lr)


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer of what configure_optimizers returned (an optimizer, a list, a dict, a tuple of lists)."""
    while not isinstance(configured, torch.optim.Optimizer):
        if isinstance(configured, dict):
            configured = configured["optimizer"]
        elif isinstance(configured, (list, tuple)) and configured:
            configured = configured[0]
        else:
            raise TypeError(f"configure_optimizers returned {type(configured).__name__}, not an optimizer")
    return configured


def compare_lightning(*, build: Callable, optimizer: Callable, data: Callable, lr: float, steps: int,
                      batch_size: int, accumulate: int = 1, leftover: int | None = None, seed: int = 0,
                      loss: Callable | None = None, shard: bool = False, sync_batchnorm: bool = False,
                      before_step: Callable | None = None, clip: float | None = None) -> dict:
    """N ranks fitting `build()` (a LightningModule, or a torch module wrapped by _Wrapped with `optimizer`,
    `loss` and `before_step`) on Trainer(strategy=HorovodStrategy(shard_optimizer_state=shard, sync_batchnorm=
    ...), accumulate_grad_batches=accumulate, gradient_clip_val=clip), against one plain process with the global
    batch at N times the rate. data(n, built): n samples, target last, the same on every rank. Returns on every
    rank compare_torch's fields ("max_abs_diff", "worst", "replicas_identical", "data_identical", "no_grad", ...)."""
    world = ht.init()
    torch.manual_seed(seed + 1000 * world.rank + 1)  # different initial weights per rank: the broadcast is tested
    built = build()
    user = isinstance(built, pl.LightningModule)
    module = built if user else _Wrapped(built, optimizer, lr, loss, before_step, accumulate)
    leftover = equivalence._leftover(leftover, world.size, batch_size)
    n = steps * accumulate * world.size * batch_size + leftover
    tensors = tuple(torch.as_tensor(t) for t in data(n, built))
    digest = equivalence._digest(t.cpu().numpy() for t in tensors)
    digests = ht.hvd.allgather_object(digest, name="hvdp.verify.digest") if world.size > 1 else [digest]
    common = {"rank": world.rank, "size": world.size, "framework": "lightning", "lightning_module": user,
              "accumulate": accumulate,
              "leftover": leftover, "sharded": shard, "clip": clip, "sync_batchnorm": sync_batchnorm,
              "parameters": sum(p.numel() for p in module.parameters()), "data_identical": len(set(digests)) == 1}
    if not common["data_identical"]:
        other = [r for r, d in enumerate(digests) if d != digests[0]]
        return {**common, "steps": 0, "clipped_steps": 0, "max_abs_diff": float("inf"), "worst": None,
                "replicas_identical": False, "no_grad": {}, "unfrozen_after_prepare": [], "added_after_prepare": [],
                "plain_batchnorm": [],
                "data_problem": f"rank(s) {', '.join(map(str, other))} made other data than rank 0; nothing was trained"}
    reference = copy.deepcopy(module) if world.rank == 0 else None  # rank 0's start: every rank's after prepare()
    indexed = tensors if user else (torch.arange(n), *tensors)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*indexed), batch_size=batch_size,
                                         shuffle=True)
    where = ht.device()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, a small log interval, ...)
        trainer = pl.Trainer(
            strategy=HorovodStrategy(seed=seed, shard_optimizer_state=shard, sync_batchnorm=sync_batchnorm),
            accelerator="gpu" if where.type == "cuda" else "cpu", max_epochs=1, accumulate_grad_batches=accumulate,
            gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, loader)
    try:
        ht.check_consistency(module)
        identical = True
    except DivergenceError:
        identical = False
    seen = [] if user else module.seen
    plain_bn = sorted(name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      and not isinstance(m, (ht.SyncBatchNorm, torch.nn.SyncBatchNorm)))

    def reference_run():  # rank 0 alone: one process, no Lightning, the global batches of hvdp's epoch order
        gathered = ht.hvd.allgather_object(seen, name="hvdp.verify.seen") if world.size > 1 else [seen]
        if reference is None:
            return None
        rate = lr * world.size  # the linear rule: the strategy's default; Lightning's accumulation keeps the rate
        if user:
            ref_opt = _first_optimizer(reference.configure_optimizers())
            for group in ref_opt.param_groups:
                group["lr"] *= world.size
            step_of = reference.training_step
        else:
            ref_opt = optimizer(reference.model, rate)
            ref_loss = loss or equivalence._cross_entropy

            def step_of(batch, i):
                return ref_loss(reference.model, tuple(batch[:-1]), batch[-1])
        chunks = list(ShardPlan(n=n, batch_size=batch_size * world.size, seed=seed, shuffle=True).batches(epoch=0))
        # the names of the torch module's parameters (a wrapped one's, without _Wrapped's "model.")
        params = dict((reference if user else reference.model).named_parameters())
        no_grad, clipped, optimizer_steps = {}, 0, 0
        for i, idx in enumerate(chunks):
            if i % accumulate == 0 and before_step is not None and not user:
                before_step(optimizer_steps, reference.model, ref_opt, rate)
            out = step_of(tuple(t[torch.from_numpy(idx)] for t in tensors), i)
            (out["loss"] if isinstance(out, dict) else out).div(accumulate).backward()  # Lightning's normalization
            if (i + 1) % accumulate and i + 1 < len(chunks):
                continue
            for name, p in params.items():
                if p.requires_grad and p.grad is None:
                    no_grad[name] = no_grad.get(name, 0) + 1
            if clip is not None:
                clipped += float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)) > clip
            ref_opt.step()
            ref_opt.zero_grad()
            optimizer_steps += 1
        ours, theirs = module.state_dict(), reference.state_dict()
        diffs = {k: float((v.double().cpu() - theirs[k].double().cpu()).abs().max()) if v.numel() else 0.0
                 for k, v in ours.items()}
        worst = max(diffs, key=diffs.get)
        global_batches = list(ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed,
                                        shuffle=True).batches(epoch=0))
        problem = None if user else equivalence._data_problem(gathered, global_batches, n)
        return {"max_abs_diff": diffs[worst], "worst": worst.removeprefix("model."), "no_grad": no_grad,
                "clipped_steps": clipped, "steps": optimizer_steps, "data_problem": problem}

    outcome = gather_or_raise(ht.hvd, reference_run, name="hvdp.verify.diff", operation="hvdp verify")[0]
    return {**common, "replicas_identical": identical, "unfrozen_after_prepare": [], "added_after_prepare": [],
            "plain_batchnorm": plain_bn, **outcome}


def run(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int, factory=None,
        input_shape: tuple[int, ...] = (20,), leftover: int | None = None, shard: bool = False,
        clip: float | None = None) -> dict:
    """`hvdp verify --framework lightning`: `factory()` (a LightningModule, or a torch module; default the small
    MLP of the torch experiment) on synthetic data of `input_shape`, the optimizer named `optimizer` for a torch
    module (a LightningModule brings its own)."""
    def build():
        return factory() if factory is not None else equivalence.default_torch_model(input_shape)

    def samples(n, model):
        with torch.no_grad():
            classes = model(torch.zeros(2, *input_shape)).shape[-1]
        return equivalence.synthetic_data(n, input_shape, classes, seed)

    result = compare_lightning(build=build, optimizer=lambda module, rate: equivalence.OPTIMIZERS[optimizer](
                                   equivalence.param_groups(module, rate, 1)),
                               data=samples, lr=lr, steps=steps, batch_size=batch_size, accumulate=accumulate,
                               leftover=leftover, seed=seed, shard=shard, clip=clip)
    return {**result, "optimizer": optimizer, "groups": 1}


def zoo_worker(steps: int, batch_size: int) -> int:
    """`hvdp verify --zoo --framework lightning`'s launch: the torch zoo's cases (hvdp.tools.zoo.torch_cases), each
    model wrapped in a LightningModule (_Wrapped: the case's loss, optimizer and fine-tuning calls) and fit by the
    Trainer on strategy="hvdp", on each case's paths; rank 0 prints one zoo record per case."""
    from hvdp.tools import zoo

    world = ht.init()
    for case in zoo.torch_cases():
        for path in case.paths:
            def compute(case=case, path=path):
                result = compare_lightning(
                    build=case.build, optimizer=case.optimizer, data=case.data, loss=case.loss, lr=case.lr,
                    steps=steps, batch_size=batch_size, accumulate=case.accumulate, seed=0,
                    shard=path == "sharded", sync_batchnorm=case.sync_batchnorm, before_step=case.before_step)
                not_exercised = case.exercised(result) if case.exercised else None
                ok = result["max_abs_diff"] <= zoo.TOLERANCE and result["replicas_identical"] and not not_exercised
                return {"max_abs_diff": result["max_abs_diff"], "worst": result["worst"], "ok": ok,
                        "replicas_identical": result["replicas_identical"], "steps": result["steps"],
                        "causes": [] if ok else equivalence.explain(result), "not_exercised": not_exercised}
            zoo._one(world.rank, {"name": case.name, "framework": "lightning", "path": path}, compute)
    return 0
