"""HorovodStrategy: hvdp's data parallelism for Lightning's Trainer (strategy="hvdp")."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils.data

from hvdp import _preemption, torch as _ht
from hvdp._horovod import agree
from hvdp.core import checkpoint as _ckpt
from hvdp.core.errors import CheckpointError, ConfigError
from hvdp.lightning._package import pl, rank_zero_only, strategies
from hvdp.lightning.common import (EvalBatches, HorovodEnvironment, _Horovod, _EpochSampler, _loader_kwargs,
                                   _TrainLoader, _training_loader)
from hvdp.torch.data import _data_identity
from hvdp.torch.optimizer import _rescale_groups, _rescale_scheduler_states
from hvdp.torch.runtime import hvd
from hvdp.torch.sharded import ShardedOptimizer
from hvdp.torch.weights import _Batch
from hvdp.torch.workers import _configure

_RunningStage = pl.trainer.states.RunningStage
_TrainerFn = pl.trainer.states.TrainerFn


class HorovodStrategy(_Horovod, strategies.ParallelStrategy):
    """Data-parallel training on hvdp: one process per rank, started by the launcher.

    Args:
        lr_scaling: hvdp.torch.prepare's rule: "linear" (default: the rates x size), "sqrt" or "none". Write
            the rates configure_optimizers returns for one process's batch (the per-rank batch).
        warmup_steps: optimizer steps over which the rate ramps from the base to the scaled one (default 0).
        compression: "none" (default) or "fp16" (gradients sent as float16).
        op: "average" (default), "sum" or "adasum" (the MPI controller only).
        sync_batchnorm: replace the module's BatchNorm layers by hvdp's SyncBatchNorm (default False).
        shard_optimizer_state: ZeRO-1/2 (default False): prepare()'s sharded optimizer, each rank holding the
            optimizer state of 1/N of the parameters; gradient_clip_val clips by the global norm (or value)
            across the shards; checkpoints hold the full state (gathered on rank 0). With
            accumulate_grad_batches = k, the k passes' gradients are summed in the model's full gradients and
            reduced to the shards after the last (the optimizer state stays split; the gradients are held whole
            until then, as without sharding).
        preemption: hvdp's preemption handling (hvdp.torch.init's; default None: HVDP_PREEMPTION=1, else off).
            On, a stop signal (SIGTERM, SIGUSR1) on any rank makes every rank, after the same optimizer step,
            write Lightning's HPC checkpoint (hpc_ckpt_<n>.ckpt in the Trainer's default_root_dir, the one its
            SLURMEnvironment writes and a fit(ckpt_path=None) under Slurm resumes from) and exit with the
            requeue code (75). Lightning's own SIGTERM handling (the signalled rank alone stops at its next batch)
            is left out meanwhile.
        seed: the seed of the training data's epoch order (default: PL_GLOBAL_SEED, which seed_everything
            sets, else 0); the same on every rank.
        accelerator, checkpoint_io, precision_plugin: as for Lightning's other strategies (the Trainer fills
            them in from its own arguments).

    Raises:
        ConfigError: configure_optimizers returned more than one optimizer; a training loader with its own
            batch_sampler (hvdp splits by batch_size); prepare()'s and shard()'s own checks.
    """

    strategy_name = "hvdp"

    def __init__(self, *, lr_scaling: str = "linear", warmup_steps: int = 0, compression: str = "none",
                 op: str = "average", sync_batchnorm: bool = False, shard_optimizer_state: bool = False,
                 preemption: bool | None = None, seed: int | None = None, accelerator=None, checkpoint_io=None,
                 precision_plugin=None):
        self._world = _ht.init(preemption=preemption)
        super().__init__(accelerator=accelerator, parallel_devices=[_ht.device()],
                         cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._prepare_kwargs = dict(lr_scaling=lr_scaling, warmup_steps=warmup_steps, compression=compression,
                                    op=op, sync_batchnorm=sync_batchnorm,
                                    shard_optimizer_state=shard_optimizer_state)
        self._seed = seed
        self._train_sampler: _EpochSampler | None = None
        self._raw: torch.optim.Optimizer | None = None  # the optimizer configure_optimizers built, before prepare()
        self._stepping: dict[int, _StepAfterClosure] = {}
        self._asked_at: int | None = None  # the optimizer step after which preempted() was last asked
        rank_zero_only.rank = self._world.rank
        # Lightning's advice against its DistributedSampler in validate()/test() (it pads): process_dataloader
        # replaces that sampler by unpadded slices
        warnings.filterwarnings("ignore", message="Using `DistributedSampler` with the dataloaders. During `trainer")

    # ------------------------------------------------------------------------------------------ the world

    @property
    def is_distributed(self) -> bool:
        # self.log(sync_dist=True) syncs only then; the DistributedSampler Lightning then puts in the loaders is
        # replaced by process_dataloader
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def setup_environment(self) -> None:
        rank_zero_only.rank = self._world.rank
        super().setup_environment()

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------ optimizers

    def setup(self, trainer) -> None:
        super().setup(trainer)  # the accelerator, the precision plugin, the model on the device, the optimizers
        if trainer.state.fn != _TrainerFn.FITTING:
            _ht.broadcast(self.lightning_module)  # validate/test/predict a model the ranks built alike
            return
        if len(self.optimizers) > 1:
            raise ConfigError(f"strategy='hvdp' prepares one optimizer, and configure_optimizers returned "
                              f"{len(self.optimizers)}: build one optimizer with a param group per part of the "
                              f"model (torch.optim.Adam([{{'params': a.parameters()}}, {{'params': "
                              f"b.parameters(), 'lr': ...}}]))", rank=self.global_rank)
        if not self.optimizers:
            _ht.broadcast(self.lightning_module)
            return
        raw = self._raw = _unwrapped(self.optimizers[0])
        prepared = _ht.prepare(self.lightning_module, raw, **self._prepare_kwargs)
        if isinstance(prepared, ShardedOptimizer):
            # accumulate_grad_batches: the passes' gradients summed in the model, reduced to the shards after
            # the last (post_backward); Lightning divides the loss by k
            prepared.sum_passes(trainer.accumulate_grad_batches)
        schedule = prepared.hvdp_schedule
        # The schedulers hold `raw`. prepare()'s broadcast loads rank 0's state_dict into the other ranks'
        # optimizer, which gives it new param-group dicts: `raw` takes them, so that a scheduler's rates are the
        # ones the prepared optimizer steps with on every rank.
        raw.param_groups = prepared.param_groups
        # The schedulers' rates, set before prepare() scaled the groups' "lr", scaled alike: the rates they
        # keep in the groups (once, however many schedulers there are) and those in their own state.
        schedulers = [c.scheduler for c in self.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is raw]
        if schedulers:
            for group in prepared.param_groups:
                for key in ("initial_lr", "max_lr", "min_lr"):
                    if isinstance(group.get(key), (int, float)) and not isinstance(group[key], bool):
                        group[key] = schedule.rate(group[key], scaled_by=1.0)
        for scheduler in schedulers:
            scheduler.load_state_dict(_rescale_scheduler_states({"s": scheduler.state_dict()}, 1.0, schedule)["s"])
        self.optimizers = [prepared]
        # The LightningOptimizer that self.optimizers() gives (manual optimization) subclasses the optimizer's
        # class, so Horovod's methods would run on the wrapper: its zero_grad() (super(self.__class__, ...))
        # recursed without end, its synchronize() would set its state on the wrapper. They are the prepared one's.
        for wrapper in self._lightning_optimizers:
            for name in ("zero_grad", "synchronize", "skip_synchronize", "add_param_group"):
                setattr(wrapper, name, getattr(prepared, name))
        if isinstance(prepared, ShardedOptimizer):
            _clip_the_model(self.precision_plugin)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # Horovod's step() would average the gradients before Lightning's closure computes them: they are
        # averaged here, after each backward pass (accumulated passes: the sum of averages, as one process sums)
        for optimizer in self.optimizers:
            optimizer = _unwrapped(optimizer)
            if isinstance(optimizer, ShardedOptimizer) and self._accumulating():
                continue  # its gradients are reduced after the step's last pass (sum_passes)
            if hasattr(optimizer, "hvdp_schedule"):
                optimizer.synchronize()

    def _accumulating(self) -> bool:
        """Whether this backward pass is one of accumulate_grad_batches that the optimizer does not step after
        (Lightning's own decision: the epoch's last batch steps after fewer)."""
        trainer = self.lightning_module.trainer
        return (trainer.accumulate_grad_batches > 1 and trainer.training
                and trainer.fit_loop.epoch_loop._should_accumulate())

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        optimizer = _unwrapped(optimizer)
        if not hasattr(optimizer, "hvdp_schedule"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        stepping = self._stepping.get(id(optimizer))
        if stepping is None or stepping.optimizer is not optimizer:
            stepping = self._stepping[id(optimizer)] = _StepAfterClosure(optimizer, self._raw)
        return super().optimizer_step(stepping, closure, model, **kwargs)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._raw is not None and self.optimizers:
            self._raw.param_groups = _unwrapped(self.optimizers[0]).param_groups  # loaded as new dicts (see setup)
        if not self.optimizers:
            return
        optimizer = _unwrapped(self.optimizers[0])
        schedule = getattr(optimizer, "hvdp_schedule", None)
        if schedule is None:
            return
        # A checkpoint of another strategy (one device, DDP) holds one process's rates: multiplier 1, and its
        # optimizer steps are the Trainer's global_step.
        saved = checkpoint.get("hvdp") or {"multiplier": 1.0, "steps": checkpoint.get("global_step", 0)}
        schedule.step = int(saved["steps"])  # the warmup goes on where it was
        if saved["multiplier"] != schedule.multiplier:  # written at another world size (or rule)
            _rescale_groups(optimizer, saved["multiplier"], schedule.size)
            if "lr_schedulers" in checkpoint:
                checkpoint["lr_schedulers"] = _rescale_scheduler_states(
                    list(checkpoint["lr_schedulers"]), saved["multiplier"], schedule)

    # ------------------------------------------------------------------------------------------ data

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if (not isinstance(dataloader, torch.utils.data.DataLoader)
                or isinstance(dataloader.dataset, torch.utils.data.IterableDataset)
                or not trainer._accelerator_connector.use_distributed_sampler):
            return dataloader  # the user's own sampling (use_distributed_sampler=False), or a stream
        stage = trainer.state.stage
        with torch.inference_mode(False):  # the evaluation loops set up their data under inference_mode
            return self._sharded(dataloader, stage)

    def _sharded(self, dataloader: torch.utils.data.DataLoader, stage) -> object:
        if stage == _RunningStage.TRAINING:
            return self._train_loader(dataloader)
        if stage in (_RunningStage.VALIDATING, _RunningStage.TESTING, _RunningStage.SANITY_CHECKING):
            return self._eval_loader(dataloader)
        return dataloader  # predict: Lightning's own split (unpadded, each rank predicts its part)

    def _train_loader(self, dataloader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        self._train_sampler, loader = _training_loader(dataloader, self._seed, _TrainLoader)
        return loader

    def _eval_loader(self, dataloader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        batch_size = dataloader.batch_size
        if batch_size is None:
            return dataloader  # a batch_sampler of the user's: left as it is (every rank evaluates it all)
        dataset = dataloader.dataset
        agree(hvd, lambda: {"batch_size": batch_size, **_data_identity(dataset)},
              call="an evaluation DataLoader of strategy='hvdp'")
        sampler = EvalBatches(len(dataset), batch_size, hvd.rank(), hvd.size())
        kwargs = _loader_kwargs(dataloader)
        _configure(kwargs, {"dataset": dataset}, persistent=False)
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **kwargs)

    def on_train_start(self) -> None:
        # Lightning's signal connector (installed after setup()) handles SIGTERM on the rank that gets it: that
        # rank's fit stops at its next batch while the others wait in the all-reduce. With hvdp's preemption on,
        # hvdp's handlers rule (every rank stops after the same step); the connector's teardown restores them.
        self._asked_at = None
        if _preemption.enabled():
            _preemption.reinstall()

    def _preempted(self) -> None:
        """After each optimizer step (asked as the next batch begins, before it is counted): when hvdp's
        agreement says stop, every rank writes Lightning's HPC checkpoint and exits with the requeue code."""
        trainer = self.lightning_module.trainer
        if not _preemption.enabled() or trainer.global_step == 0 or trainer.global_step == self._asked_at:
            return
        self._asked_at = trainer.global_step
        if _ht.preempted():
            trainer.save_checkpoint(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
            _ht.exit_for_requeue()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._preempted()
        # Which batch prepare()'s gradient hooks weigh: the loader tells them as it hands a batch out, and
        # Lightning may fetch ahead of the batch it trains on (a loader without len()): the Trainer's own
        # count of the batch being trained on is the one that holds.
        sampler = self._train_sampler
        if sampler is not None and sampler._running is not None:
            # the index within this iteration (from where a resumed epoch began), then the batch is counted as
            # trained: a checkpoint written at its end resumes after it
            _Batch.sampler, _Batch.index = sampler, sampler._running[3]
            sampler.record_steps(1)

    def on_train_end(self) -> None:
        if _Batch.sampler is self._train_sampler:
            _Batch.sampler = None

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """Rank 0 writes `filepath` atomically (a temp file renamed into place); every rank returns together or
        raises the same CheckpointError. A remote path (s3://...) goes through the Trainer's CheckpointIO."""
        optimizer = _unwrapped(self.optimizers[0]) if self.optimizers else None
        schedule = getattr(optimizer, "hvdp_schedule", None)
        if schedule is not None:
            checkpoint["hvdp"] = {"size": schedule.size, "multiplier": schedule.multiplier, "steps": schedule.step}
        outcome: dict = {}
        if self.is_global_zero:
            try:
                if "://" in str(filepath) or storage_options is not None:
                    self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
                else:
                    buffer = io.BytesIO()
                    torch.save(checkpoint, buffer)
                    _ckpt.write_atomic(filepath, lambda f: f.write(buffer.getbuffer()))
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                outcome = {"error": f"cannot write checkpoint {filepath} on rank 0: {type(e).__name__}: {e}. "
                                    f"Check that the directory is writable and has room for the checkpoint"}
        if hvd.size() > 1:
            outcome = hvd.broadcast_object(outcome, root_rank=0, name="hvdp.lightning.save_checkpoint")
        if "error" in outcome:
            raise CheckpointError(outcome["error"], rank=self.global_rank)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            if "://" in str(filepath):
                self.checkpoint_io.remove_checkpoint(filepath)
            else:
                Path(filepath).unlink(missing_ok=True)

    def teardown(self) -> None:
        if _Batch.sampler is self._train_sampler:
            _Batch.sampler = None
        self._stepping.clear()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="hvdp's data parallelism on Horovod "
                                   "(one process per rank, started by horovodrun, mpirun or srun)", override=True)


class _StepAfterClosure:
    """The prepared optimizer as Lightning's precision plugin sees it: step(closure) runs the closure (the
    training step, the backward pass with the gradients averaged, then Lightning's clipping of the averaged
    gradients) and only then Horovod's step, which would otherwise reduce before the gradients exist."""

    def __init__(self, optimizer: torch.optim.Optimizer, raw: torch.optim.Optimizer | None = None):
        self.optimizer, self.raw = optimizer, raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self.optimizer.step(**kwargs)
        if self.raw is not None:
            self.raw._opt_called = True  # what torch's schedulers check: the step they follow was taken
        return result


def _unwrapped(optimizer):
    """The torch optimizer inside a LightningOptimizer (or _StepAfterClosure)."""
    while hasattr(optimizer, "_optimizer") or isinstance(optimizer, _StepAfterClosure):
        optimizer = optimizer.optimizer if isinstance(optimizer, _StepAfterClosure) else optimizer._optimizer
    return optimizer


def _clip_the_model(precision_plugin) -> None:
    """Make `precision_plugin`'s gradient clipping (gradient_clip_val) clip a sharded optimizer's gradients by
    their global norm (or value). Lightning clips main_params(optimizer), the optimizer's parameters: a sharded
    optimizer's are this rank's flat shards, whose norm is one rank's part of the whole. Given the model's
    parameters instead, torch's clip_grad_norm_/clip_grad_value_ (guarded by hvdp.torch.sharded_clip) clip the shards
    by the norm across all of them, as one process clips its gradients. Once per plugin."""
    if getattr(precision_plugin.main_params, "hvdp_sharded", False):
        return
    own = precision_plugin.main_params

    def main_params(optimizer):
        inner = _unwrapped(optimizer)
        if isinstance(inner, ShardedOptimizer):
            return inner._params()
        return own(optimizer)

    main_params.hvdp_sharded = True
    precision_plugin.main_params = main_params
