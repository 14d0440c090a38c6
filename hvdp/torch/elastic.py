"""Elastic training: ElasticState (model, optimizer, data position and extras kept across a lost or added
worker) and elastic_run, Horovod's reset loop."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from hvdp import _horovod
from hvdp.core.errors import ConfigError
from hvdp.torch import sharded_elastic
from hvdp.torch.checkpoint import _ARRAYS, _into
from hvdp.torch.data import ShardSampler
from hvdp.torch.optimizer import _rescale_groups
from hvdp.torch.runtime import _plain, hvd
from hvdp.torch.sharded import ShardedOptimizer
from hvdp.torch.streams import _StreamLoader

from horovod.common.elastic import ObjectState  # noqa: E402,I001  (after runtime's import_horovod: its clear error)


class ElasticState(_horovod.CopiedExtras, ObjectState):
    """What an elastic job keeps across a lost or added worker: model, optimizer, data position, extras.

        state = hvdp_torch.ElasticState(model, optimizer, loader, best=0.0)

        @hvdp_torch.elastic_run
        def train(state):
            while state.epoch < epochs:
                for x, y in loader:           # resumes mid-epoch after a reset
                    ...; optimizer.step()
                    state.commit()            # or every few steps: a failure rolls back to the last commit

    `optimizer` comes from prepare() and `loader` from shard(). Each optimizer step records the batches
    it trained on, so a commit holds the exact offset into the epoch's order; after a reset the ranks there
    are then split the rest of the epoch, and no sample is skipped or seen twice. A step that GradScaler
    skips counts too: its batches were trained on. After every reset, reset() rescales the learning rate to
    the new world size by the rule given to prepare() (also when Horovod skips sync() because hosts were only
    removed), and sync() broadcasts everything from rank 0. With a sharded optimizer (prepare(...,
    shard_optimizer_state=True)) a commit keeps this rank's slices of the state and copies of another host's,
    and after every reset the state is re-sharded for the new world (hvdp.torch.sharded_elastic).

    Args:
        model: the module being trained.
        optimizer: the optimizer prepare() returned.
        loader: the DataLoader shard() returned.
        extra: further values to keep and sync, read and set as attributes (state.best); not `epoch`.

    Raises:
        ConfigError: `optimizer` is not from prepare(), `loader` not from shard(), or `extra` has `epoch`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loader: torch.utils.data.DataLoader, **extra: Any):
        model = _plain(model)
        schedule = getattr(optimizer, "hvdp_schedule", None)
        sampler = getattr(loader, "batch_sampler", None)
        if schedule is None:
            raise ConfigError("ElasticState needs the optimizer returned by hvdp.torch.prepare()")
        if isinstance(loader, _StreamLoader):
            raise ConfigError("ElasticState needs a map-style dataset: shard() of a stream (an IterableDataset) "
                              "cannot be split again among a changed number of ranks mid-epoch")
        if not isinstance(sampler, ShardSampler):
            raise ConfigError("ElasticState needs the DataLoader returned by hvdp.torch.shard()")
        if "epoch" in extra:
            raise ConfigError("`epoch` is kept by ElasticState itself (state.epoch, from the data position); "
                              "leave it out of the extras")
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self._sharded = isinstance(optimizer, ShardedOptimizer)
        self._reshard = False  # a reset happened: the sharded state is rebuilt when training is entered again
        self._serial = 0  # sharded: the count of commits, agreed by every rank at each entry (sharded_elastic)
        schedule.on_step = sampler.record_steps
        self._snapshot = self._take(collective=False)
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0, name="hvdp.elastic"),
                         get_rank=hvd.rank, **extra)

    @property
    def epoch(self) -> int:
        """The epoch training is in (or starts next): the loop condition of an elastic training function."""
        return self.sampler.position()[0]

    def _take(self, collective: bool = True, previous: dict | None = None) -> dict:
        """A snapshot; with `previous` (the last one), its tensors are overwritten in place where they fit, so
        that a commit holds one snapshot at a time, not two while the new one is built. The sharded commit's
        collectives run first: if one fails, `previous` is still whole."""
        s = self.optimizer.hvdp_schedule
        previous = previous or {}
        if not self._sharded:
            optimizer = _copied_into(previous.get("optimizer"), self.optimizer.state_dict())
        elif collective:  # its slices and copies of its keepers' (every rank, at the same commit)
            self._serial += 1
            optimizer = sharded_elastic.commit_copies(self.optimizer, self._serial)
        else:
            optimizer = None  # none yet
        return {"model": _copied_into(previous.get("model"), self.model.state_dict()), "optimizer": optimizer,
                "groups": _hyperparameters(self.optimizer) if self._sharded else None,  # (else in its state_dict)
                "schedule": (s.step, s.size),
                "position": self.sampler.position()}

    def save(self) -> None:
        """Snapshot model, optimizer, schedule and data position in memory (state.commit() calls it)."""
        self._snapshot = self._take(previous=self._snapshot)
        super().save()

    def restore(self) -> None:
        """Roll model, optimizer, schedule and data position back to the last save(); Horovod calls it."""
        snap = self._snapshot
        self.model.load_state_dict(snap["model"])
        if self._sharded:  # the state is rebuilt from the commits once the new world is formed: _hvdp_entered()
            self._reshard = True
            _set_hyperparameters(self.optimizer, snap["groups"])
        else:
            self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        s = self.optimizer.hvdp_schedule
        s.step, s.size = snap["schedule"]  # the restored rates are scaled for the world of the snapshot
        s.fresh = False  # gradients of a step that raised
        self.sampler.resume(*snap["position"])
        super().restore()

    def reset(self) -> None:
        """Rescale the learning rate to the world there is now and make the loader's next iteration start
        where training is (Horovod calls it after every reset, before sync() or instead of it)."""
        # Horovod skips sync() when hosts were only removed (HostsUpdatedInterrupt(skip_sync=True)): the
        # rates must follow the new world size here, not in sync().
        _rescale_groups(self.optimizer, self.optimizer.hvdp_schedule.multiplier, hvd.size())
        # After a reset the next iteration starts where training is, not at the next epoch.
        self.sampler.resume(*self.sampler.position())
        self._reshard = self._sharded  # a world of other ranks: the shards are laid out anew in _hvdp_entered()

    def sync(self) -> None:
        """Broadcast model, optimizer state, schedule and data position from rank 0; rescale the LR.

        The learning rate is rescaled for the new world size by prepare()'s rule. elastic_run calls it
        after every reset; every rank must call it.
        """
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        # The whole optimizer state as one tree: a worker that just joined has none yet, and Horovod's
        # broadcast_optimizer_state would make it take a zero-gradient step to create it.
        # Streamed (see _horovod.broadcast_tree): an optimizer state of any size, received in place where
        # this rank already has it.
        s = self.optimizer.hvdp_schedule
        # A sharded optimizer's state is rebuilt from the ranks' commits in _hvdp_entered(): here its hyperparameters.
        optimizer = _hyperparameters(self.optimizer) if self._sharded else self.optimizer.state_dict()
        synced = _horovod.broadcast_tree(
            hvd, _ARRAYS, {"optimizer": optimizer, "schedule": (s.step, s.multiplier),
                           "position": self.sampler.position()},
            name="hvdp.elastic.sync", into=None if self._sharded else _into(None, self.optimizer))
        opt_state, (step, multiplier), position = synced["optimizer"], synced["schedule"], synced["position"]
        if self._sharded:
            _set_hyperparameters(self.optimizer, opt_state)
        else:
            self.optimizer.load_state_dict(opt_state)
        _rescale_groups(self.optimizer, multiplier, hvd.size())  # rank 0's rates, for this world
        s.step, s.fresh = step, False
        self.sampler.resume(*position)
        super().sync()
        if not self._sharded:  # (sharded: in _hvdp_entered(), after the re-sharding)
            self._snapshot = self._take()  # what a failure before the next commit rolls back to

    def _hvdp_entered(self) -> None:
        """elastic_run calls it on every rank each time training is entered, after sync() or a reset that
        skipped it. With a sharded optimizer: if a reset happened on any rank, lay the shards out for this
        world and rebuild their state from the last commit (sharded_elastic.reshard), then commit, so that a
        failure before the next commit rolls back to this state. The ranks' commit counts are made equal here
        (a worker lost mid-commit can leave one rank a commit ahead; a joined worker has none)."""
        if not self._sharded:
            return
        every = hvd.allgather_object((self._reshard, self._serial), name="hvdp.elastic.reshard")
        if any(reshard for reshard, _ in every):
            sharded_elastic.reshard(self.optimizer, self._snapshot["optimizer"] if self._reshard else None)
        self._reshard, self._serial = False, max(serial for _, serial in every)
        self._snapshot = self._take()


def _hyperparameters(optimizer) -> list[dict]:
    """Each param group's settings (lr, momentum...), without its parameters."""
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _set_hyperparameters(optimizer, groups: list[dict]) -> None:
    for group, values in zip(optimizer.param_groups, groups):
        group.update(copy.deepcopy(values))


def elastic_run(train: Callable) -> Callable:
    """Horovod's elastic loop around `train(state, ...)`: on a lost worker, roll back to the last commit,
    re-form the world with the survivors (and any host that was added), sync from rank 0, and call again.

    Use it as a decorator; every rank must call the decorated function, with an ElasticState first.

    Args:
        train: the training function, train(state, ...); it returns when training is done.

    Returns:
        The wrapped function (Horovod's hvd.elastic.run).
    """
    return hvd.elastic.run(_horovod.elastic_body(train))


def _copied_into(kept, live):
    """A copy of `live` (a state_dict: tensors in dicts and lists), written into `kept`'s tensors where the
    same key holds a tensor of the same shape, dtype and device (no new memory), freshly allocated elsewhere."""
    if torch.is_tensor(live):
        if (torch.is_tensor(kept) and kept.shape == live.shape and kept.dtype == live.dtype
                and kept.device == live.device and kept is not live):
            with torch.no_grad():
                return kept.copy_(live)
        return live.detach().clone()
    if isinstance(live, dict):
        kept = kept if isinstance(kept, dict) else {}
        out = type(live)((k, _copied_into(kept.get(k), v)) for k, v in live.items())
        if hasattr(live, "_metadata"):  # a module's state_dict: the versions load_state_dict reads
            out._metadata = copy.deepcopy(live._metadata)
        return out
    if isinstance(live, (list, tuple)):
        kept = kept if isinstance(kept, (list, tuple)) and len(kept) == len(live) else [None] * len(live)
        return type(live)(_copied_into(k, v) for k, v in zip(kept, live))
    return copy.deepcopy(live)
