"""shard()'s DataLoader workers: started by forkserver, not fork (a rank's threads run: a forked worker can
deadlock at its first step, issue 36), kept for the whole run with a map-style dataset, and what they need
checked before any starts (hvdp.core.workers has the rules)."""

from __future__ import annotations

import functools
import os
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np
import torch

from hvdp import _preemption, _workers
from hvdp.core.errors import ConfigError
from hvdp.core.workers import interactive_reason, main_importable, probe, unpicklable_message
from hvdp.torch.runtime import hvd

STARTING_WORKERS = "in its DataLoader, starting its worker processes"
LOADING = "in its DataLoader, waiting for a batch"


def _configure(loader_kwargs: dict, parts: dict[str, Any], *, persistent: bool) -> None:
    """Set the workers' start method (and, when `persistent`, persistent_workers) in `loader_kwargs` unless
    given, and check what the workers need, for num_workers > 0; nothing for num_workers=0.

    With the default method (forkserver; spawn where the platform has none) or any explicit one but "fork":
    a ConfigError on this rank, naming the object and the fix, when `parts` (the dataset, a stream's transform),
    collate_fn or worker_init_fn do not pickle. The workers import the script (module `__main__`) only when
    something they receive is defined there; then a script that started Horovod (or is calling shard()) at its
    unguarded top level, which every worker would run again, is a ConfigError naming the line, and so is a
    `__main__` no worker can import (`python -c`, `python -`, a notebook). Otherwise, with the default method,
    the workers never import it: any way of running Python works. An explicit "fork" is the caller's choice
    (still kept when `persistent`): the fork guard of init() warns once when it forks.

    While preemption handling is on (init(preemption=True)), the workers (and their forkserver) ignore the stop
    signals and SIGINT: a scheduler signals every process of the job, and the ranks must reach the step they
    agree on and checkpoint, their workers still serving them.

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
    if persistent:
        loader_kwargs.setdefault("persistent_workers", True)
    ignore = _preemption.worker_ignores()
    given = {"collate_fn": loader_kwargs.get("collate_fn"), "worker_init_fn": loader_kwargs.get("worker_init_fn")}
    loader_kwargs["worker_init_fn"] = functools.partial(_worker_start, os.getpid(), given["worker_init_fn"], ignore)
    method = context if isinstance(context, str) else context.get_start_method() if context else None
    if method == "fork":
        return  # the caller's choice: fork never imports the script nor pickles; kept, it forks once per run
    call = f"shard(num_workers={workers})"
    needed: dict[str, list[str]] = {}
    for what, obj in {**parts, **given}.items():
        if obj is None:
            continue
        why, from_main = probe(obj, skip=_sent_by_value, pickler=ForkingPickler)
        if why:
            raise ConfigError(unpicklable_message(call, what, obj, why, method or start_method()), rank=hvd.rank())
        if from_main:
            needed[what] = from_main
    main = bool(needed) or context is not None  # a context the caller gave imports the script, as it always has
    if context is None:
        context = loader_kwargs["multiprocessing_context"] = _workers.worker_context(main=main)
        method = context.get_start_method()
    if needed and not main_importable(sys.modules.get("__main__")):
        what, names = next(iter(needed.items()))
        obj = {**parts, **given}[what]
        raise ConfigError(unpicklable_message(call, what, obj, interactive_reason(names), method), rank=hvd.rank())
    if method == "forkserver":
        _workers.preload_forkserver(["torch"], main=main, ignore_signals=ignore)
    if main:
        problem = _workers.script_problem(call, method, sorted({n for names in needed.values() for n in names}))
        if problem:
            raise ConfigError(problem, rank=hvd.rank())


def start_method() -> str:
    """The start method shard() gives workers by default."""
    return _workers.worker_context().get_start_method()


def _worker_start(rank_pid: int, worker_init_fn: Callable[[int], None] | None, ignore: tuple[str, ...],
                  worker_id: int) -> None:
    """Every worker's first call: follow the rank's life (a worker of a dead rank ends at once, instead of
    living on under the forkserver), ignore the stop signals `ignore` (preemption is on: the rank stops it),
    then the user's worker_init_fn."""
    _workers.ignore_stop_signals(ignore)
    _workers.follow(rank_pid)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _sent_by_value(obj) -> bool:
    """Tensors and plain arrays always pickle (tensors through shared memory): not serialized by the check."""
    return isinstance(obj, torch.Tensor) or (isinstance(obj, np.ndarray) and obj.dtype != object)
