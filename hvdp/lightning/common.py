"""What hvdp.lightning's two strategies share: the cluster environment, Horovod's collectives, the training
loader of hvdp's exact sharding (resumable), the evaluation batches, the DataLoader arguments carried over."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils.data

from hvdp import torch as _ht
from hvdp._horovod import agree
from hvdp.core.errors import ConfigError
from hvdp.core.sharding import ShardPlan, eval_batches
from hvdp.lightning._package import ClusterEnvironment, rank_zero_only
from hvdp.torch.data import ShardSampler, _ShardLoader, _data_identity
from hvdp.torch.runtime import hvd
from hvdp.torch.workers import _configure


class HorovodEnvironment(ClusterEnvironment):
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


class _Horovod:
    """What both strategies take from Horovod: the world (this rank's device, its ranks, the size) and reduce
    (all_reduce in Fabric), all_gather, barrier and broadcast."""

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
