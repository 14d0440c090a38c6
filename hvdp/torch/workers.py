"""shard()'s DataLoader workers: started by forkserver, not fork (a rank's threads run: a forked worker can
deadlock at its first step, issue 36), kept for the whole run with a map-style dataset, and what they need
checked before any starts (hvdp.core.workers has the rules)."""

from __future__ import annotations

import functools
import os
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np
import torch

from hvdp import _workers
from hvdp.core.errors import ConfigError
from hvdp.core.workers import unpicklable, unpicklable_message
from hvdp.torch.runtime import hvd

STARTING_WORKERS = "in its DataLoader, starting its worker processes"
LOADING = "in its DataLoader, waiting for a batch"


def _configure(loader_kwargs: dict, parts: dict[str, Any], *, persistent: bool) -> None:
    """Set the workers' start method (and, when `persistent`, persistent_workers) in `loader_kwargs` unless
    given, and check what the workers need, for num_workers > 0; nothing for num_workers=0.

    With the default method (forkserver; spawn where the platform has none) or any explicit one but "fork":
    a ConfigError on this rank, naming the object or the script line and the fix, when `parts` (the
    dataset, a stream's transform), collate_fn or worker_init_fn do not pickle, or when the script started
    Horovod (or is calling shard()) at its unguarded top level, which every worker would run again. An explicit
    "fork" is the caller's choice (still kept when `persistent`): the fork guard of init() warns once when it
    forks.

    Args:
        loader_kwargs: shard()'s DataLoader arguments, completed in place.
        parts: what the workers receive, by the name the message should give it ("dataset", "transform").
        persistent: keep the workers from one epoch to the next (map-style datasets: the sampler is in this
            process, so a kept worker needs nothing new per epoch).
    """
    workers = loader_kwargs.get("num_workers", 0)
    if not workers:
        return
    context = loader_kwargs.get("multiprocessing_context")
    if context is None:
        context = loader_kwargs["multiprocessing_context"] = _workers.worker_context()
    method = context if isinstance(context, str) else context.get_start_method()
    if persistent:
        loader_kwargs.setdefault("persistent_workers", True)
    if method == "fork":
        return  # the caller's choice: fork never imports the script nor pickles; kept, it forks once per run
    if method == "forkserver":
        _workers.preload_forkserver(["torch"])
    call = f"shard(num_workers={workers})"
    problem = _workers.script_problem(call, method)
    if problem:
        raise ConfigError(problem, rank=hvd.rank())
    given = {"collate_fn": loader_kwargs.get("collate_fn"), "worker_init_fn": loader_kwargs.get("worker_init_fn")}
    for what, obj in {**parts, **given}.items():
        if obj is None:
            continue
        why = unpicklable(obj, skip=_sent_by_value, pickler=ForkingPickler)
        if why:
            raise ConfigError(unpicklable_message(call, what, obj, why, method), rank=hvd.rank())
    loader_kwargs["worker_init_fn"] = functools.partial(_worker_start, os.getpid(), given["worker_init_fn"])


def _worker_start(rank_pid: int, worker_init_fn: Callable[[int], None] | None, worker_id: int) -> None:
    """Every worker's first call: follow the rank's life (a worker of a dead rank ends at once, instead of
    living on under the forkserver), then the user's worker_init_fn."""
    _workers.follow(rank_pid)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _sent_by_value(obj) -> bool:
    """Tensors and plain arrays always pickle (tensors through shared memory): not serialized by the check."""
    return isinstance(obj, torch.Tensor) or (isinstance(obj, np.ndarray) and obj.dtype != object)
