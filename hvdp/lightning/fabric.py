"""HorovodFabricStrategy: hvdp's data parallelism for Lightning Fabric's loops (Fabric(strategy="hvdp"))."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.data

from hvdp import torch as _ht
from hvdp.core.errors import ConfigError
from hvdp.lightning._package import fabric, rank_zero_only
from hvdp.lightning.common import HorovodEnvironment, _Horovod, _training_loader
from hvdp.torch.data import _ShardLoader
from hvdp.torch.runtime import hvd
from hvdp.torch.sharded import ShardedOptimizer


class HorovodFabricStrategy(_Horovod, fabric.strategies.ParallelStrategy):
    """HorovodStrategy's data parallelism for Lightning Fabric's loops: Fabric(strategy="hvdp").

    fabric.setup(model, optimizer) prepares the optimizer (hvdp.torch.prepare: the rate rule and warmup,
    gradients averaged in optimizer.step(), rank 0's weights and state broadcast); fabric.setup_dataloaders()
    gives hvdp's exact sharding of every loader it is given (an epoch's uneven last batch weighted, so that
    optimizer.step() is one process's step on the global batch); fabric.clip_gradients() clips the averaged
    gradients (with shard_optimizer_state=True, by their norm across the shards); all_reduce, all_gather,
    barrier and broadcast are Horovod's. Arguments as HorovodStrategy's.
    """

    def __init__(self, *, lr_scaling: str = "linear", warmup_steps: int = 0, compression: str = "none",
                 op: str = "average", sync_batchnorm: bool = False, shard_optimizer_state: bool = False,
                 seed: int | None = None, accelerator=None, checkpoint_io=None, precision=None):
        self._world = _ht.init()
        super().__init__(accelerator=accelerator, parallel_devices=[_ht.device()],
                         cluster_environment=HorovodEnvironment(), checkpoint_io=checkpoint_io, precision=precision)
        self._prepare_kwargs = dict(lr_scaling=lr_scaling, warmup_steps=warmup_steps, compression=compression,
                                    op=op, sync_batchnorm=sync_batchnorm,
                                    shard_optimizer_state=shard_optimizer_state)
        self._seed = seed
        rank_zero_only.rank = self._world.rank

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
        prepared = _prepared_of(optimizer)
        prepared.synchronize()  # the averaged gradients are clipped (step() then skips the reduce)
        if not isinstance(prepared, ShardedOptimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        # Fabric would clip main_params(optimizer): the shards of this rank, by their own norm
        self.precision.unscale_gradients(optimizer)
        norm = prepared.clip_grad_norm_(max_norm, norm_type=float(norm_type))  # the norm across the shards
        if error_if_nonfinite and not bool(torch.isfinite(norm)):  # the same norm on every rank: all raise
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               f"non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               f"by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        prepared = _prepared_of(optimizer)
        prepared.synchronize()
        if not isinstance(prepared, ShardedOptimizer):
            return super().clip_gradients_value(module, optimizer, clip_val)
        self.precision.unscale_gradients(optimizer)
        # the model's parameters: torch's clip_grad_value_, guarded by hvdp.torch.sharded_clip, clamps the shards
        return torch.nn.utils.clip_grad_value_(prepared._params(), clip_value=clip_val)

    def save_checkpoint(self, path, state: dict, storage_options: Any = None, filter=None) -> None:
        # fabric.save(path, {"optimizer": optimizer}) hands Fabric the _Prepared it holds, which Fabric takes for
        # any object with a state_dict(): the prepared optimizer instead, whose state Fabric's
        # get_optimizer_state gathers on rank 0 (consolidate_state_dict) when it is sharded
        state = {k: v._prepared if isinstance(v, _Prepared) else v for k, v in state.items()}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

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
