"""hvdp for PyTorch Lightning 2.x: HorovodStrategy, a Trainer strategy that runs one process per rank under
horovodrun, mpirun or srun (the Trainer spawns nothing) and trains as one process with the global batch would.

    import lightning.pytorch as pl
    import hvdp.lightning                      # registers strategy="hvdp" (Trainer and Fabric)
    trainer = pl.Trainer(strategy="hvdp", max_epochs=10)   # or strategy=hvdp.lightning.HorovodStrategy(...)
    trainer.fit(model, train_loader, val_loader)           # batch_size of the loaders: per rank

What it does to the Trainer's run (docs/lightning.md):
- initializes hvdp (hvdp.torch.init: Horovod, the watchdog, the rank's device) when it is built, and makes
  Lightning's rank-zero-only output (loggers, progress bar, prints) rank 0's;
- prepares the optimizer configure_optimizers returns with hvdp.torch.prepare (the learning-rate rule and
  warmup, gradients averaged by Horovod, rank 0's weights and state broadcast); the LR schedulers keep
  stepping the same param groups, their rates scaled by the same multiplier;
- replaces the training loader's sampler by hvdp's exact sharding (every sample once per epoch, an epoch's
  uneven last batch weighted so that the step is one process's step on the global batch) and splits the
  validation and test loaders into contiguous unpadded slices, so that self.log(..., sync_dist=True) over an
  epoch is the mean over every sample counted once;
- maps reduce, all_gather, barrier and broadcast onto Horovod's collectives, writes checkpoints from rank 0
  atomically (every rank learns of a failed write), resumes a checkpoint written within an epoch at the first
  sample not trained on (the training loader is resumable), and rescales the rates of a checkpoint written at
  another world size, or by another strategy (one process's rates).
accumulate_grad_batches, gradient_clip_val/algorithm and precision="bf16-mixed" keep one process's meaning.
One optimizer (configure_optimizers returning more is a ConfigError).

HorovodFabricStrategy (Fabric(strategy="hvdp")) does the same for Lightning Fabric's loops: setup(model,
optimizer) prepares the optimizer, setup_dataloaders() shards, clip_gradients() clips the averaged gradients.

Importing this module imports Lightning (lightning.pytorch, else pytorch_lightning: the one already imported
when both are installed), torch and horovod.torch; nothing else in hvdp imports it.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils.data

from hvdp._horovod import agree
from hvdp.core import checkpoint as _ckpt
from hvdp.core.errors import CheckpointError, ConfigError, SetupError
from hvdp.core.sharding import ShardPlan, eval_batches
from hvdp import torch as _ht
from hvdp.torch.data import ShardSampler, _ShardLoader, _data_identity
from hvdp.torch.optimizer import _rescale_groups, _rescale_scheduler_states
from hvdp.torch.runtime import hvd
from hvdp.torch.weights import _Batch
from hvdp.torch.workers import _configure


def _lightning():
    """(the Lightning package, its name): the one the script imported, else lightning.pytorch, else
    pytorch_lightning."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        import pytorch_lightning as pl
        return pl, "pytorch_lightning"
    try:
        import lightning.pytorch as pl
        return pl, "lightning.pytorch"
    except ImportError:
        pass
    try:
        import pytorch_lightning as pl
        return pl, "pytorch_lightning"
    except ImportError:
        raise SetupError("hvdp.lightning needs PyTorch Lightning 2.x: pip install 'hvdp[lightning]' "
                         "(or pip install lightning)") from None


pl, PACKAGE = _lightning()
if int(pl.__version__.split(".")[0]) < 2:
    raise SetupError(f"hvdp.lightning needs Lightning 2.x, and {PACKAGE} {pl.__version__} is installed: "
                     f"pip install 'lightning>=2.0' (Lightning 1.x has its own strategy='horovod')")
from lightning_utilities.core.rank_zero import rank_zero_only  # noqa: E402  (Lightning's rank-zero switch)

_strategies = pl.strategies
_fabric = importlib.import_module("lightning.fabric" if PACKAGE == "lightning.pytorch" else "lightning_fabric")
_ClusterEnvironment = importlib.import_module(f"{PACKAGE}.plugins.environments").ClusterEnvironment
_RunningStage = pl.trainer.states.RunningStage
_TrainerFn = pl.trainer.states.TrainerFn


class HorovodEnvironment(_ClusterEnvironment):
    """Lightning's view of the job hvdp runs in: the ranks Horovod started (the launcher made the processes)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # Horovod's

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        rank_zero_only.rank = hvd.rank()  # Horovod's rank, whatever Lightning computed

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


class _Collectives:
    """reduce (all_reduce in Fabric), all_gather, barrier and broadcast of both strategies: Horovod's collectives."""

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is not None:
            raise ConfigError("strategy='hvdp' reduces over all ranks: group must be None", rank=hvd.rank())
        op = _reduce_op(reduce_op)
        if hvd.size() == 1:
            return tensor
        if op is hvd.Average and not tensor.is_floating_point():
            tensor = tensor.double()
        with torch.inference_mode(False):  # Lightning evaluates under inference_mode, where Horovod cannot allocate
            return hvd.allreduce(tensor.clone(), op=op)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if group is not None:
            raise ConfigError("strategy='hvdp' gathers over all ranks: group must be None", rank=hvd.rank())
        stacked = tensor.unsqueeze(0)  # (world_size, *shape), as Lightning's DDP gives it
        if hvd.size() == 1:
            return stacked
        if sync_grads:
            return hvd.allgather(stacked)  # differentiable (Horovod's allgather has a backward)
        with torch.inference_mode(False):
            return hvd.allgather(stacked.detach().clone())

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        _ht.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if hvd.size() == 1:
            return obj
        return hvd.broadcast_object(obj, root_rank=src)

    def all_reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        return self.reduce(tensor, group=group, reduce_op=reduce_op)


class HorovodStrategy(_Collectives, _strategies.ParallelStrategy):
    """Data-parallel training on hvdp: one process per rank, started by the launcher.

    Args:
        lr_scaling: hvdp.torch.prepare's rule: "linear" (default: the rates x size), "sqrt" or "none". Write
            the rates configure_optimizers returns for one process's batch (the per-rank batch).
        warmup_steps: optimizer steps over which the rate ramps from the base to the scaled one (default 0).
        compression: "none" (default) or "fp16" (gradients sent as float16).
        op: "average" (default), "sum" or "adasum" (the MPI controller only).
        sync_batchnorm: replace the module's BatchNorm layers by hvdp's SyncBatchNorm (default False).
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
                 op: str = "average", sync_batchnorm: bool = False, seed: int | None = None,
                 accelerator=None, checkpoint_io=None, precision_plugin=None):
        self._world = _ht.init()
        super().__init__(accelerator=accelerator, parallel_devices=[_ht.device()],
                         cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._prepare_kwargs = dict(lr_scaling=lr_scaling, warmup_steps=warmup_steps, compression=compression,
                                    op=op, sync_batchnorm=sync_batchnorm)
        self._seed = seed
        self._train_sampler: _EpochSampler | None = None
        self._raw: torch.optim.Optimizer | None = None  # the optimizer configure_optimizers built, before prepare()
        self._stepping: dict[int, _StepAfterClosure] = {}
        rank_zero_only.rank = self._world.rank
        # Lightning's advice against its DistributedSampler in validate()/test() (it pads): process_dataloader
        # replaces that sampler by unpadded slices
        warnings.filterwarnings("ignore", message="Using `DistributedSampler` with the dataloaders. During `trainer")

    # ------------------------------------------------------------------------------------------ the world

    @property
    def root_device(self) -> torch.device:
        return _ht.device()

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

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

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # Horovod's step() would average the gradients before Lightning's closure computes them: they are
        # averaged here, after each backward pass (accumulated passes: the sum of averages, as one process sums)
        for optimizer in self.optimizers:
            optimizer = _unwrapped(optimizer)
            if hasattr(optimizer, "hvdp_schedule"):
                optimizer.synchronize()

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

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
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


class HorovodFabricStrategy(_Collectives, _fabric.strategies.ParallelStrategy):
    """HorovodStrategy's data parallelism for Lightning Fabric's loops: Fabric(strategy="hvdp").

    fabric.setup(model, optimizer) prepares the optimizer (hvdp.torch.prepare: the rate rule and warmup,
    gradients averaged in optimizer.step(), rank 0's weights and state broadcast); fabric.setup_dataloaders()
    gives hvdp's exact sharding of every loader it is given (an epoch's uneven last batch weighted, so that
    optimizer.step() is one process's step on the global batch); fabric.clip_gradients() clips the averaged
    gradients; all_reduce, all_gather, barrier and broadcast are Horovod's. Arguments as HorovodStrategy's.
    """

    def __init__(self, *, lr_scaling: str = "linear", warmup_steps: int = 0, compression: str = "none",
                 op: str = "average", sync_batchnorm: bool = False, seed: int | None = None,
                 accelerator=None, checkpoint_io=None, precision=None):
        self._world = _ht.init()
        super().__init__(accelerator=accelerator, parallel_devices=[_ht.device()],
                         cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io, precision=precision)
        self._prepare_kwargs = dict(lr_scaling=lr_scaling, warmup_steps=warmup_steps, compression=compression,
                                    op=op, sync_batchnorm=sync_batchnorm)
        self._seed = seed
        rank_zero_only.rank = self._world.rank

    @property
    def root_device(self) -> torch.device:
        return _ht.device()

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def setup_environment(self) -> None:
        rank_zero_only.rank = self._world.rank
        super().setup_environment()

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) != 1:
            raise ConfigError(f"Fabric(strategy='hvdp') prepares one optimizer with its model, and setup() was given "
                              f"{len(optimizers)}: build one optimizer with a param group per part of the model",
                              rank=hvd.rank())
        self.module_to_device(module)
        prepared = _ht.prepare(module, optimizers[0], **self._prepare_kwargs)
        return module, [_Prepared(prepared)], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.module_to_device(module)
        _ht.broadcast(module)  # a model set up without an optimizer: rank 0's weights everywhere
        return module

    def setup_optimizer(self, optimizer):
        raise ConfigError("Fabric(strategy='hvdp') prepares an optimizer with its model: fabric.setup(model, "
                          "optimizer), not fabric.setup_optimizers(optimizer)", rank=hvd.rank())

    def process_dataloader(self, dataloader):
        if (not isinstance(dataloader, torch.utils.data.DataLoader)
                or isinstance(dataloader.dataset, torch.utils.data.IterableDataset)
                or not isinstance(dataloader.sampler, torch.utils.data.DistributedSampler)):
            return dataloader  # use_distributed_sampler=False: the user's own sampling; a stream
        return _training_loader(dataloader, self._seed, _ShardLoader)[1]

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        _prepared_of(optimizer).synchronize()  # the averaged gradients are clipped (step() then skips the reduce)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        _prepared_of(optimizer).synchronize()
        return super().clip_gradients_value(module, optimizer, clip_val)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("hvdp", cls, description="hvdp's data parallelism on Horovod for Fabric",
                                   override=True)


class _Prepared:
    """The prepared optimizer as Fabric holds it. Fabric's optimizer wrapper subclasses the class of what it
    wraps, and Horovod's methods (zero_grad: super(self.__class__, self)) would then run on that wrapper and
    recurse; this plain class's methods reach the prepared optimizer by name instead."""

    def __init__(self, prepared: torch.optim.Optimizer):
        self._prepared = prepared

    def __getattr__(self, name: str) -> Any:
        if name == "_prepared":
            raise AttributeError(name)
        return getattr(self._prepared, name)

    @property
    def param_groups(self) -> list:
        return self._prepared.param_groups

    @property
    def state(self) -> dict:
        return self._prepared.state

    @property
    def defaults(self) -> dict:
        return self._prepared.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._prepared.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._prepared.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        self._prepared.synchronize()

    def skip_synchronize(self):
        return self._prepared.skip_synchronize()

    def state_dict(self) -> dict:
        return self._prepared.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._prepared.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self._prepared.add_param_group(param_group)


def _prepared_of(optimizer):
    """The optimizer prepare() returned, inside Fabric's wrapper and _Prepared."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    return getattr(optimizer, "_prepared", optimizer)


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


class _EpochSampler(ShardSampler):
    """hvdp's ShardSampler with the set_epoch() Lightning calls at each epoch's start (found as
    batch_sampler.sampler), so that a run resumed from a checkpoint takes that epoch's order."""

    @property
    def sampler(self) -> "_EpochSampler":
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.resume(epoch, 0)


class _TrainLoader(_ShardLoader):
    """shard()'s loader as Lightning's training loader: a stateful one (state_dict/load_state_dict), so that a
    checkpoint written within an epoch resumes at the first sample not trained on, at any world size."""

    def __len__(self) -> int:
        # the whole epoch's batches, as Lightning expects of a resumable loader: it reads len() once, then
        # stops a resumed epoch where its loader ends
        return self.batch_sampler.plan.steps_per_epoch

    def state_dict(self) -> dict:
        epoch, offset = self.batch_sampler.position()
        return {"epoch": epoch, "offset": offset}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.resume(int(state["epoch"]), int(state["offset"]))


class EvalBatches(torch.utils.data.Sampler):
    """A batch sampler of `rank`'s evaluation batches (hvdp.core.sharding.eval_batches): contiguous slices of
    each global batch, unpadded, so that every sample is scored exactly once and a metric logged with
    sync_dist=True is the mean over all of them."""

    def __init__(self, n: int, batch_size: int, rank: int, size: int):
        self.batches = eval_batches(n, batch_size, rank, size)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _training_loader(dataloader: torch.utils.data.DataLoader, seed: int | None, loader_class: type):
    """(the sampler, the loader) of hvdp's exact sharding in place of `dataloader`'s sampling (both strategies)."""
    if dataloader.batch_size is None:
        raise ConfigError("strategy='hvdp' splits the training data by its DataLoader's batch_size, and this "
                          "loader has a batch_sampler of its own: build it with batch_size=<per-rank batch> "
                          "(and shuffle=True/False), or pass use_distributed_sampler=False (to the Trainer, or to "
                          "Fabric's setup_dataloaders) to shard the data yourself", rank=hvd.rank())
    sampler = dataloader.sampler
    own = type(getattr(sampler.dataset, "_sampler", sampler)).__name__ if hasattr(sampler, "dataset") else ""
    if isinstance(sampler, torch.utils.data.DistributedSampler) and type(sampler) is not \
            torch.utils.data.DistributedSampler:  # Lightning's wrapper around a sampler of the user's
        raise ConfigError(f"strategy='hvdp' shards the training data itself, in place of a random or sequential "
                          f"sampler, and this loader's sampler is a {own}: pass use_distributed_sampler=False "
                          f"(Trainer, setup_dataloaders) and split the data yourself (the run is then not hvdp's "
                          f"exact one), or drop the sampler", rank=hvd.rank())
    # the DistributedSampler Lightning put in (shuffle=True for training) or the user's own, or none
    shuffle = getattr(sampler, "shuffle", isinstance(sampler, torch.utils.data.RandomSampler))
    seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
    dataset = dataloader.dataset
    agree(hvd, lambda: {"batch_size": dataloader.batch_size, "seed": seed, "shuffle": shuffle,
                        "drop_last": dataloader.drop_last, **_data_identity(dataset)},
          call="the training DataLoader of strategy='hvdp'")
    plan = ShardPlan(n=len(dataset), batch_size=dataloader.batch_size, rank=hvd.rank(), size=hvd.size(),
                     seed=seed, shuffle=shuffle, drop_last=dataloader.drop_last)
    kwargs = _loader_kwargs(dataloader)
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed + hvd.rank()))
    _configure(kwargs, {"dataset": dataset}, persistent=False)
    sampler = _EpochSampler(plan)
    return sampler, loader_class(dataset, batch_sampler=sampler, **kwargs)


def _reduce_op(reduce_op: Any):
    name = str(getattr(reduce_op, "name", reduce_op)).lower().rsplit(".", 1)[-1]
    ops = {"none": hvd.Average, "mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average,
           "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "product": hvd.Product}
    if name not in ops:
        raise ConfigError(f"reduce_op={reduce_op!r} is not one of {', '.join(ops)}", rank=hvd.rank())
    return ops[name]


def _unwrapped(optimizer):
    """The torch optimizer inside a LightningOptimizer (or _StepAfterClosure)."""
    while hasattr(optimizer, "_optimizer") or isinstance(optimizer, _StepAfterClosure):
        optimizer = optimizer.optimizer if isinstance(optimizer, _StepAfterClosure) else optimizer._optimizer
    return optimizer


# The DataLoader arguments hvdp carries over to the loader it builds (not the sampling ones it replaces).
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def _loader_kwargs(dataloader: torch.utils.data.DataLoader) -> dict:
    kwargs = {}
    for name in _KEPT:
        if hasattr(dataloader, name):
            kwargs[name] = getattr(dataloader, name)
    if not kwargs.get("num_workers"):
        for name in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout", "worker_init_fn"):
            kwargs.pop(name, None)
    if getattr(dataloader, "generator", None) is not None:
        kwargs["generator"] = dataloader.generator
    return kwargs


HorovodStrategy.register_strategies(_strategies.StrategyRegistry)
HorovodFabricStrategy.register_strategies(_fabric.strategies.STRATEGY_REGISTRY)

__all__ = ["HorovodStrategy", "HorovodFabricStrategy", "HorovodEnvironment", "EvalBatches"]
