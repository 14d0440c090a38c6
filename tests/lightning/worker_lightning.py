"""Checks of hvdp.lightning that need a real job; run under horovodrun by tests/lightning/test_lightning.py.

The reference of every training check is one process written here independently of Lightning: a plain torch
loop over the same epoch order (hvdp.core.sharding.epoch_order, the order hvdp defines) with the global batch
N*b and the rate x N. Every assertion holds at any world size.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# the Lightning package (lightning.pytorch, or pytorch_lightning from test_lightning.py), imported first so that
# hvdp.lightning builds on the same one
pl = importlib.import_module(os.environ.get("TEST_LIGHTNING_PACKAGE", "lightning.pytorch"))
import hvdp.torch as ht  # noqa: E402
import hvdp.lightning as hl  # noqa: E402
from hvdp.core.sharding import epoch_order  # noqa: E402
from hvdp.torch.sharded import ShardedOptimizer  # noqa: E402
from tests.checks import check, main  # noqa: E402

warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, the linear rule with Adam...)
world = None
hvd = ht.hvd
B, SEED, LR = 4, 3, 0.05


def data(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 2, generator=g) + 0.1 * torch.randn(n, 2, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def n_train() -> int:
    # 3 full global batches and a last one of N*b - 3 samples, smaller than the others (hvdp splits it 3 + 2 at
    # N = 2, 3 + 3 + 3 at N = 3)
    return 3 * B * world.size + max(1, B * world.size - 3)


class Net(pl.LightningModule):
    def __init__(self, optimizer="sgd", scheduler=False):
        super().__init__()
        torch.manual_seed(0)  # every rank the same start (prepare() broadcasts rank 0's anyway)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.optimizer, self.scheduler = optimizer, scheduler

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("val_loss", F.mse_loss(out, y), sync_dist=True)
        self.log("val_abs", (out - y).abs().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = (torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9) if self.optimizer == "sgd"
               else torch.optim.Adam(self.parameters(), lr=LR / 10))
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def trainer(**kwargs) -> pl.Trainer:
    settings = dict(strategy=hl.HorovodStrategy(seed=SEED), accelerator="cpu", max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
    settings.update(kwargs)
    return pl.Trainer(**settings)


def reference(module: Net, dataset, *, epochs=2, accumulate=1, clip=None, clip_value=None, bf16=False,
              fp16=False, warmup=0) -> torch.nn.Module:
    """One process, batch N*b, rate x N, in hvdp's epoch order: what the N ranks must reproduce. With `warmup`,
    optimizer step t takes the rate x (1 + (N - 1) * min(t, warmup) / warmup) / N (from x 1 to x N)."""
    model = copy.deepcopy(Net(module.optimizer, module.scheduler))
    opt = model.configure_optimizers()
    sched = None
    if isinstance(opt, dict):
        opt, sched = opt["optimizer"], opt["lr_scheduler"]
    for g in opt.param_groups:
        g["lr"] *= world.size
        g["initial_lr"] = g["lr"]
    if sched is not None:
        sched.base_lrs = [lr * world.size for lr in sched.base_lrs]
    x, y = dataset.tensors
    n, gb = len(x), B * world.size
    steps = 0
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=fp16)
    for epoch in range(epochs):
        order = torch.as_tensor(epoch_order(n, seed=SEED, epoch=epoch, shuffle=True))
        chunks = [order[i:i + gb] for i in range(0, n, gb)]
        for i, idx in enumerate(chunks):
            with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16, enabled=bf16 or fp16):
                loss = F.mse_loss(model(x[idx]), y[idx]) / accumulate
            scaler.scale(loss).backward()
            if (i + 1) % accumulate == 0 or i == len(chunks) - 1:
                scaler.unscale_(opt)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                if clip_value is not None:
                    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
                kept = [g["lr"] for g in opt.param_groups]
                if warmup:
                    for g in opt.param_groups:
                        g["lr"] *= (1 + (world.size - 1) * min(steps, warmup) / warmup) / world.size
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                for g, lr in zip(opt.param_groups, kept):
                    g["lr"] = lr
                steps += 1
        if sched is not None:
            sched.step()
    return model


def max_dw(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def same_on_every_rank(module: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert bool((gathered == gathered[0]).all()), "the replicas differ"


def fit_and_compare(module: Net, *, tol=1e-5, **kwargs) -> torch.utils.data.Dataset:
    dataset = data(n_train())
    ref_kwargs = {k: kwargs.pop(k) for k in ("accumulate", "clip", "clip_value", "bf16", "fp16", "warmup")
                  if k in kwargs}
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True)
    trainer(**kwargs).fit(module, loader)
    same_on_every_rank(module)
    dw = max_dw(module, reference(module, dataset, **ref_kwargs))
    print(f"[rank {world.rank}] max |dw| {dw:.3g} ({module.optimizer}, {kwargs}, {ref_kwargs})", file=sys.stderr)
    assert dw < tol, f"max |dw| {dw} >= {tol}"
    return dataset


# ------------------------------------------------------------------------------------------ training

@check
def fit_sgd_equals_one_process_with_the_global_batch(tmp):
    fit_and_compare(Net("sgd"))


@check
def fit_adam_with_a_scheduler_equals_one_process(tmp):
    fit_and_compare(Net("adam", scheduler=True), max_epochs=2)


@check
def strategy_by_name_accumulate_and_clip_equal_one_process(tmp):
    # strategy="hvdp" (the registry), seed from seed_everything's PL_GLOBAL_SEED
    pl.seed_everything(SEED, verbose=False)
    module = Net("sgd")
    dataset = fit_and_compare(module, strategy="hvdp", accumulate_grad_batches=2, gradient_clip_val=0.5,
                              accumulate=2, clip=0.5)
    # both settings matter here: one process without either is far from the run
    for other in ({"accumulate": 2}, {"clip": 0.5}):
        assert max_dw(module, reference(module, dataset, **other)) > 1e-2, other


@check
def warmup_ramps_the_rate_as_one_process(tmp):
    dataset = fit_and_compare(module := Net("sgd"), strategy=hl.HorovodStrategy(seed=SEED, warmup_steps=5), warmup=5)
    if world.size > 1:  # the ramp matters: one process without it is far from the run
        assert max_dw(module, reference(module, dataset)) > 1e-2


@check
def bf16_mixed_follows_one_process(tmp):
    # bf16 rounding: not bit for bit, but the same run (a wrong sharding or rate is off by far more)
    fit_and_compare(Net("sgd"), precision="bf16-mixed", bf16=True, tol=1e-2)


SCALE = 2.0 ** 8  # the GradScalers' initial scale: no overflow on either side (see the check below)


@check
def fp16_mixed_with_a_grad_scaler_follows_one_process(tmp):
    # precision="16-mixed" with accelerator="cpu" is turned into "bf16-mixed" by Lightning's accelerator connector
    # (a warning: "AMP with fp16 is not supported on CPU"); torch has fp16 autocast and GradScaler("cpu"), which
    # Lightning's own MixedPrecision plugin takes when given: the gradients scaled, averaged, unscaled, clipped.
    # At GradScaler's default scale (65536) this model's fp16 backward overflows in some steps, on the ranks (a
    # batch of b) and in one process (N*b) at different steps, so their skips differ: a scale that never
    # overflows compares the rest.
    mixed = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=SCALE))
    fit_and_compare(Net("sgd"), plugins=[mixed], gradient_clip_val=0.5, fp16=True, clip=0.5, tol=1e-3)
    assert mixed.scaler.get_scale() == SCALE  # no step skipped (an overflow halves it)


@check
def lightnings_own_distributed_sampler_is_not_one_process(tmp):
    # The user's DistributedSampler kept (use_distributed_sampler=False): it pads the uneven last batch with
    # repeated samples and weighs the ranks' batches alike, so the run is not one process's. hvdp's is.
    if world.size == 1:
        return
    # a size the ranks cannot split evenly (n_train() splits evenly at N = 3), so that DistributedSampler pads
    dataset = data(n_train() + (n_train() % world.size == 0))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world.size, rank=world.rank, shuffle=False)
    module = Net("sgd")
    trainer(use_distributed_sampler=False, max_epochs=1).fit(
        module, torch.utils.data.DataLoader(dataset, batch_size=B, sampler=sampler))
    # the reference in DistributedSampler's own (unshuffled) order, so that only the split differs
    ref = Net("sgd")
    opt = ref.configure_optimizers()
    for g in opt.param_groups:
        g["lr"] *= world.size
    x, y = dataset.tensors
    for i in range(0, len(x), B * world.size):
        F.mse_loss(ref(x[i:i + B * world.size]), y[i:i + B * world.size]).backward()
        opt.step()
        opt.zero_grad()
    dw = max_dw(module, ref)
    print(f"[rank {world.rank}] DistributedSampler: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw > 1e-4, f"max |dw| {dw}: the padded sampler matched one process"


def sharded_state_is_split(optimizer, module: torch.nn.Module) -> None:
    """Each rank holds Adam's moments for its part of the parameters only; together, for all of them."""
    assert isinstance(optimizer, ShardedOptimizer), type(optimizer)
    held = sum(v.numel() for state in optimizer.state.values() for k, v in state.items() if k == "exp_avg")
    counts = hvd.allgather_object(held, name="sharded.held")
    total = sum(p.numel() for p in module.parameters())
    assert sum(counts) == total and (world.size == 1 or max(counts) < total), (counts, total)


@check
def sharded_adam_with_clipping_and_resume_equals_one_process(tmp):
    # HorovodStrategy(shard_optimizer_state=True): Adam's state split over the ranks, gradient_clip_val by the
    # norm across the shards, a checkpoint of the full state written after epoch 1 and resumed for epoch 2
    dataset = data(n_train())
    d = Path(tmp) / "sharded"
    clip = 0.05

    def strategy():
        return hl.HorovodStrategy(seed=SEED, shard_optimizer_state=True)

    t = trainer(strategy=strategy(), max_epochs=1, gradient_clip_val=clip, enable_checkpointing=True,
                callbacks=[pl.callbacks.ModelCheckpoint(dirpath=d, save_last=True, save_top_k=0)])
    first = Net("adam", scheduler=True)
    t.fit(first, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True))
    sharded_state_is_split(trainer_optimizer(t), first)
    saved = torch.load(d / "last.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert sorted(saved) == list(range(len(list(first.parameters())))), sorted(saved)  # the full state
    resumed = Net("adam", scheduler=True)
    t = trainer(strategy=strategy(), max_epochs=2, gradient_clip_val=clip)
    t.fit(resumed, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True), ckpt_path=d / "last.ckpt")
    sharded_state_is_split(trainer_optimizer(t), resumed)
    same_on_every_rank(resumed)
    dw = max_dw(resumed, reference(resumed, dataset, clip=clip))
    unclipped = max_dw(resumed, reference(resumed, dataset))
    print(f"[rank {world.rank}] sharded Adam, clipped, resumed: max |dw| {dw:.3g} (unclipped one process: "
          f"{unclipped:.3g})", file=sys.stderr)
    assert dw < 1e-5, dw
    assert unclipped > 1e-3, unclipped  # the clipping mattered


@check
def sharded_clips_by_value_as_one_process(tmp):
    module = Net("sgd")
    dataset = fit_and_compare(module, strategy=hl.HorovodStrategy(seed=SEED, shard_optimizer_state=True),
                              gradient_clip_val=0.02, gradient_clip_algorithm="value", clip_value=0.02)
    assert max_dw(module, reference(module, dataset)) > 1e-2  # the clipping mattered


@check
def sharded_with_accumulation_and_clipping_equals_one_process(tmp):
    # accumulate_grad_batches=3 over an epoch of 4 batches: a step after 3 passes, then one after the epoch's
    # last pass alone (the uneven, weighted batch); Adam's state split, clipped by the norm across the shards
    module = Net("adam")
    t = trainer(strategy=hl.HorovodStrategy(seed=SEED, shard_optimizer_state=True), accumulate_grad_batches=3,
                gradient_clip_val=0.05)
    dataset = data(n_train())
    t.fit(module, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True))
    sharded_state_is_split(trainer_optimizer(t), module)
    same_on_every_rank(module)
    dw = max_dw(module, reference(module, dataset, accumulate=3, clip=0.05))
    print(f"[rank {world.rank}] sharded Adam, accumulate 3, clipped: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw
    for other in ({"accumulate": 3}, {"clip": 0.05}):  # both settings matter: one process without either is far
        assert max_dw(module, reference(module, dataset, **other)) > 1e-3, other


def trainer_optimizer(t: pl.Trainer):
    """The optimizer strategy='hvdp' prepared, inside Lightning's wrappers."""
    from hvdp.lightning.trainer import _unwrapped
    return _unwrapped(t.strategy.optimizers[0])


class Manual(Net):
    """The same training with Lightning's manual optimization (one optimizer)."""

    def __init__(self):
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        opt.step()


@check
def manual_optimization_equals_one_process(tmp):
    fit_and_compare(Manual())


def fabric_loop(strategy, clip: float, resume: Path | None = None) -> None:
    """The user's own loop under Fabric(strategy=...), with fabric.backward and fabric.clip_gradients, against
    one process with the global batch. With `resume`: fabric.save of the model and the optimizer after epoch 1,
    fabric.load into a new model (its weights zeroed) and optimizer (no momentum yet) set up anew, epoch 2 on
    those."""
    fabric_module = importlib.import_module("lightning.fabric" if pl.__name__ == "lightning.pytorch"
                                            else "lightning_fabric")
    fabric = fabric_module.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()  # Fabric's own call; the launcher already started the processes
    dataset = data(n_train())
    module = Net("sgd")
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True))
    for epoch in range(2):
        if epoch == 1 and resume is not None:
            fabric.save(resume, {"model": model, "optimizer": opt})
            module = Net("sgd")
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
            model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9))
            fabric.load(resume, {"model": model, "optimizer": opt})
        for x, y in loader:
            opt.zero_grad()
            fabric.backward(F.mse_loss(model(x), y))
            fabric.clip_gradients(model, opt, max_norm=clip)
            opt.step()
    same_on_every_rank(module)
    dw = max_dw(module, reference(module, dataset, clip=clip))
    from hvdp.lightning.fabric import _prepared_of
    print(f"[rank {world.rank}] Fabric, {type(_prepared_of(opt)).__name__}: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw
    assert max_dw(module, reference(module, dataset)) > 1e-2  # the clipping mattered
    total = fabric.all_reduce(torch.tensor(float(world.rank + 1)), reduce_op="sum")
    assert float(total) == world.size * (world.size + 1) / 2


@check
def fabric_loop_with_clipping_equals_one_process(tmp):
    fabric_loop(hl.HorovodFabricStrategy(seed=SEED), clip=0.5)


@check
def fabric_sharded_with_clipping_equals_one_process(tmp):
    # shard_optimizer_state=True: fabric.clip_gradients clips by the norm across the ranks' shards; saved with
    # fabric.save (the momentum gathered on rank 0) and loaded into a new model and optimizer in between
    fabric_loop(hl.HorovodFabricStrategy(seed=SEED, shard_optimizer_state=True), clip=0.5,
                resume=Path(tmp) / "fabric-sharded.ckpt")


class RankDependent(Net):
    """A mistake hvdp verify must catch: each rank weighs its loss by its rank (one process: rank 0's weight)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1 + self.global_rank)


@check
def verify_experiment_on_a_lightning_module(tmp):
    # hvdp verify --framework lightning's experiment (compare_lightning) on a LightningModule of the user's: its
    # own training_step (self.log included) and configure_optimizers on both sides, accumulation and clipping
    from hvdp.lightning.verify import compare_lightning
    kwargs = dict(optimizer=None, data=lambda n, model: data(n).tensors, lr=LR, steps=3, batch_size=B, accumulate=2,
                  seed=SEED, clip=0.5)
    result = compare_lightning(build=lambda: Net("adam", scheduler=False), **kwargs)
    print(f"[rank {world.rank}] verify, a LightningModule: max |dw| {result['max_abs_diff']:.3g} "
          f"({result['steps']} steps, {result['clipped_steps']} clipped)", file=sys.stderr)
    assert result["max_abs_diff"] < 1e-5 and result["replicas_identical"] and result["data_identical"], result
    assert result["steps"] == 4 and result["size"] == world.size, result  # 3 whole steps and the short one
    wrong = compare_lightning(build=lambda: RankDependent("adam"), **kwargs)
    assert wrong["replicas_identical"], wrong
    if world.size > 1:
        assert wrong["max_abs_diff"] > 1e-3, wrong  # the experiment sees the mistake


# ------------------------------------------------------------------------------------------ evaluation

@check
def validate_and_test_metrics_count_every_sample_once(tmp):
    module = Net("sgd")
    val = data(2 * B * world.size + 3, seed=1)  # an uneven last global batch
    t = trainer()
    got = t.validate(module, torch.utils.data.DataLoader(val, batch_size=B), verbose=False)[0]
    tested = t.test(module, torch.utils.data.DataLoader(val, batch_size=B), verbose=False)[0]
    x, y = val.tensors
    with torch.no_grad():
        out = module(x)
    want = {"val_loss": float(((out - y) ** 2).mean(1).mean()),
            "val_abs": float((out - y).abs().mean(1).mean()), "test_loss": float(((out - y) ** 2).mean(1).mean())}
    # Lightning weighs each batch's mean by its size: the mean over every sample, each once (float32 sums in
    # another order: relative 1e-6; a sample counted twice or missed moves the mean by far more)
    for name, value in {**got, **tested}.items():
        assert abs(value - want[name]) < 1e-6 * max(1.0, abs(want[name])), (name, value, want[name])


@check
def predict_splits_the_samples_without_repeats(tmp):
    # Lightning's own unpadded split: each rank predicts its part, every sample once over the ranks
    x = data(2 * B * world.size + 3, seed=2).tensors[0]
    module = Net("sgd")
    module.predict_step = lambda batch, batch_idx: module(batch[0])  # noqa: E731
    out = torch.cat(trainer().predict(module, torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x), batch_size=B)))
    rows = hvd.allgather_object(out.detach())
    with torch.no_grad():
        want = module(x)
    got = torch.cat(rows)
    assert len(got) == len(x), (len(got), len(x))
    # each row of the model's output over all samples found once among the ranks' predictions
    matched = sorted(int((want - r).abs().sum(1).argmin()) for r in got)
    assert matched == list(range(len(x))), matched


# ------------------------------------------------------------------------------------------ collectives

@check
def collectives_map_onto_horovod(tmp):
    assert hl.PACKAGE == pl.__name__ and isinstance(hl.HorovodStrategy(), pl.strategies.Strategy), hl.PACKAGE
    s = hl.HorovodStrategy()
    r, n = world.rank, world.size
    t = torch.tensor([float(r + 1), 2.0 * r])
    assert torch.equal(s.reduce(t.clone(), reduce_op="sum"), torch.tensor([n * (n + 1) / 2, float(n * (n - 1))]))
    assert torch.allclose(s.reduce(t.clone(), reduce_op="mean"), torch.tensor([(n + 1) / 2, float(n - 1)]))
    assert torch.equal(s.reduce(t.clone(), reduce_op="max"), torch.tensor([float(n), 2.0 * (n - 1)]))
    gathered = s.all_gather(torch.tensor([r, 10 * r]))
    assert gathered.shape == (n, 2) and gathered[:, 1].tolist() == [10 * i for i in range(n)], gathered
    assert s.broadcast({"from": r}, src=n - 1) == {"from": n - 1}
    assert s.reduce_boolean_decision(r == 0, all=False) is True
    assert s.reduce_boolean_decision(r == 0, all=True) is (n == 1)
    s.barrier("check")
    assert (s.global_rank, s.world_size, s.is_global_zero) == (r, n, r == 0)
    from lightning_utilities.core.rank_zero import rank_zero_only
    assert rank_zero_only.rank == r


# ------------------------------------------------------------------------------------------ checkpoints, logs

@check
def checkpoint_from_rank_0_only_and_resume_exact(tmp):
    dataset = data(n_train())
    d = Path(tmp) / "ckpt"
    module = Net("sgd", scheduler=True)
    t = trainer(max_epochs=1, enable_checkpointing=True,
                callbacks=[pl.callbacks.ModelCheckpoint(dirpath=d, save_last=True, save_top_k=0)])
    t.fit(module, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True))
    t.save_checkpoint(d / f"by-rank-{world.rank}.ckpt")  # every rank calls it: rank 0's name only is written
    hvd.allreduce(torch.zeros(1), name="ckpt.listed")
    names = sorted(p.name for p in d.iterdir())
    assert names == ["by-rank-0.ckpt", "last.ckpt"], names  # no temp file left, nothing from rank 1
    resumed = Net("sgd", scheduler=True)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # not the saved weights: the checkpoint must bring them
    trainer(max_epochs=3).fit(resumed, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True),
                              ckpt_path=d / "last.ckpt")
    same_on_every_rank(resumed)
    dw = max_dw(resumed, reference(resumed, dataset, epochs=3))  # epochs 2 and 3 at the scheduler's rates
    print(f"[rank {world.rank}] resumed: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw


class Interrupted(Exception):
    pass


class InterruptAfter(pl.Callback):
    """The job killed as the batch after optimizer step `steps` begins (the checkpoint of that step written)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.steps:
            raise Interrupted


@check
def resumes_within_an_epoch_exact(tmp):
    # checkpointed every 2 steps, interrupted after 2 of an epoch's 4 steps, resumed: the uninterrupted run
    dataset = data(n_train())
    d = Path(tmp) / "mid-epoch"
    every = pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1)
    try:
        trainer(enable_checkpointing=True, callbacks=[every, InterruptAfter(2)]).fit(
            Net("sgd", scheduler=True), torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True))
        raise AssertionError("not interrupted")
    except Interrupted:
        pass
    path = d / "epoch=0-step=2.ckpt"
    assert torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 0, "offset": 2 * B * world.size}]
    resumed = Net("sgd", scheduler=True)
    trainer(max_epochs=2).fit(resumed, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True),
                              ckpt_path=path)
    dw = max_dw(resumed, reference(resumed, dataset, epochs=2))
    print(f"[rank {world.rank}] resumed within an epoch: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw


RESIZE_N = 29  # the data of the resize check, whatever the world size


def reference_resized(sizes: list[int], dataset) -> torch.nn.Module:
    """One process that takes epoch e with the global batch B * sizes[e] at the rate x sizes[e] (StepLR's decay
    carried over): what a job of sizes[0] ranks, resumed on sizes[1] ranks from its checkpoint, must give."""
    model = Net("sgd")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = dataset.tensors
    for epoch, size in enumerate(sizes):
        for g in opt.param_groups:
            g["lr"] = LR * size * 0.5 ** epoch
        order = torch.as_tensor(epoch_order(len(x), seed=SEED, epoch=epoch, shuffle=True))
        for i in range(0, len(x), B * size):
            idx = order[i:i + B * size]
            F.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    return model


@check
def resumes_at_another_world_size(tmp):
    # In the job of 2+ ranks: one epoch, checkpointed. Then test_lightning.py resumes it in one process (plain
    # python, HVDP_CHECKS=resumes_at_another_world_size): the rates and the scheduler's are rescaled from x2 to x1.
    dataset = data(RESIZE_N)
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True)
    d = Path(tmp) / "resize"
    if world.size > 1:
        t = trainer(max_epochs=1, enable_checkpointing=True,
                    callbacks=[pl.callbacks.ModelCheckpoint(dirpath=d, save_last=True, save_top_k=0)])
        t.fit(Net("sgd", scheduler=True), loader)
        saved = torch.load(d / "last.ckpt", weights_only=False)["hvdp"]
        steps = -(-RESIZE_N // (B * world.size))  # one epoch's optimizer steps
        assert saved == {"size": world.size, "multiplier": float(world.size), "steps": steps}, saved
        return
    written = torch.load(d / "last.ckpt", weights_only=False)["hvdp"]["size"]
    assert written > 1, written
    module = Net("sgd", scheduler=True)
    trainer(max_epochs=3).fit(module, loader, ckpt_path=d / "last.ckpt")
    dw = max_dw(module, reference_resized([written, 1, 1], dataset))
    print(f"[rank {world.rank}] resumed from {written} ranks on 1: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw


@check
def resumes_a_checkpoint_of_one_device(tmp):
    # a checkpoint of Lightning's SingleDeviceStrategy (one process's rates, no hvdp record) resumed on N ranks
    dataset = data(RESIZE_N)
    path = Path(tmp) / f"single-device-{world.rank}.ckpt"
    single = pl.Trainer(strategy=pl.strategies.SingleDeviceStrategy("cpu"), accelerator="cpu", max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    order = torch.as_tensor(epoch_order(len(dataset), seed=SEED, epoch=0, shuffle=True))  # hvdp's epoch 0
    single.fit(Net("sgd", scheduler=True), torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, order),
                                                                      batch_size=B))
    single.save_checkpoint(path)
    assert "hvdp" not in torch.load(path, weights_only=False)
    module = Net("sgd", scheduler=True)
    trainer(max_epochs=3).fit(module, torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=True),
                              ckpt_path=path)
    dw = max_dw(module, reference_resized([1, world.size, world.size], dataset))
    print(f"[rank {world.rank}] resumed a one-device checkpoint: max |dw| {dw:.3g}", file=sys.stderr)
    assert dw < 1e-5, dw


@check
def loggers_write_on_rank_0_only(tmp):
    logs = Path(tmp) / f"logs-rank{world.rank}"
    module = Net("sgd")
    t = trainer(max_epochs=1, logger=pl.loggers.CSVLogger(logs, name="run"), log_every_n_steps=1)
    t.fit(module, torch.utils.data.DataLoader(data(n_train()), batch_size=B, shuffle=True))
    written = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file()) if logs.exists() else []
    if world.rank == 0:
        assert any(name.endswith("metrics.csv") for name in written), written
        text = next(logs.rglob("metrics.csv")).read_text()
        assert "train_loss_epoch" in text, text
    else:
        assert written == [], written


if __name__ == "__main__":
    world = ht.init()
    main(lambda obj: hvd.allgather_object(obj, name="checks.results"), world.rank)
