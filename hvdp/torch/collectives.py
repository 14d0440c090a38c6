"""Collectives over the ranks: broadcast of model and optimizer state, barrier, average, check_finite,
check_consistency and the model-shape check prepare() runs first."""

from __future__ import annotations

import math

import torch

from hvdp.core import consistency
from hvdp.core.errors import DivergenceError, NonFiniteLossError
from hvdp.torch.runtime import _plain, hvd


def broadcast(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, root_rank: int = 0):
    """Copy parameters, buffers and the optimizer's state and hyperparameters from `root_rank` to every rank.

    What is sent is root_rank's optimizer.state_dict(), whatever the others hold: a rank that restored its
    state alone (Horovod's resume recipe: rank 0 loads, then broadcasts) gives it to all, and a fresh optimizer
    sends its hyperparameters only. (Horovod's broadcast_optimizer_state would first take a zero-gradient step
    on a rank without state, which advances Adam's step count and applies weight decay once: the run would no
    longer match one process.)
    prepare() already calls it (except under elastic horovodrun, where ElasticState.sync() does).

    Every rank must call it, with the same model and optimizer structure.

    Args:
        model: the module whose state_dict (parameters and buffers) is overwritten with root_rank's.
        optimizer: also copy its state and hyperparameters (default None: the model only).
        root_rank: the rank whose values everyone gets (default 0).
    """
    model = _plain(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    if optimizer is None:
        return
    # What is sent is decided by root_rank's optimizer alone: a collective chosen by each rank's own state (a
    # rank that restored its state before prepare(), the others fresh) would leave the ranks in different
    # collectives. Its whole state_dict (state and hyperparameters, its tensors on the CPU) in one broadcast;
    # every other rank loads it (torch's load_state_dict puts each tensor where its parameter is).
    mine = _on_cpu(optimizer.state_dict()) if hvd.rank() == root_rank else None
    theirs = hvd.broadcast_object(mine, root_rank=root_rank, name="hvdp.optimizer_state")
    if hvd.rank() != root_rank:
        optimizer.load_state_dict(theirs)


def _on_cpu(tree):
    """`tree` (an optimizer's state_dict) with its tensors copied to the CPU, so that the ranks unpickle none onto
    root's device."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_on_cpu(v) for v in tree]
    return tree


def barrier() -> None:
    """Wait until every rank gets here (Horovod's own barrier, through the controller).

    Every rank must call it; a no-op in a world of size 1. Call init() first.
    """
    if hvd.size() > 1:
        hvd.barrier()


def average(value: float | torch.Tensor, name: str | None = None) -> float:
    """The mean of a scalar over all ranks (for metrics and logging). Every rank must call it.

    Args:
        value: a number or a one-element tensor (detached; computed in float64).
        name: the all-reduce's name in Horovod (default None: Horovod's own); every rank must pass the same.

    Returns:
        The mean as a float, the same on every rank.
    """
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
    return float(hvd.allreduce(t, op=hvd.Average, name=name))


def check_finite(loss: torch.Tensor | float, step: int) -> None:
    """Raise NonFiniteLossError on every rank if the loss is NaN or inf on any rank (which is named).

    Every rank must call it, at the same steps. One 1-element allgather: call it every step, or every few
    steps where that cost shows.

    Args:
        loss: this rank's loss, a tensor (one element) or a float.
        step: the step number, shown in the message.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite on at least one rank (raised on every rank).
    """
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    bad = torch.tensor([0.0 if math.isfinite(value) else 1.0])
    flags = hvd.allgather(bad, name="hvdp.check_finite")
    if flags.any():
        ranks = [int(r) for r in torch.nonzero(flags).flatten()]
        raise NonFiniteLossError(
            f"loss is not finite at step {step} on rank(s) {ranks} (loss on this rank: {value}); "
            f"lower the learning rate, enable warmup, or check the data", rank=hvd.rank())


def check_consistency(model: torch.nn.Module) -> None:
    """Raise DivergenceError on every rank if any parameter or buffer differs across ranks, naming the first
    one and the ranks that differ from rank 0. Compares exact bytes, so it catches the smallest drift.

    Every rank must call it. One allgather of a sha256 digest per tensor, no tensor data.

    Args:
        model: the module whose state_dict (parameters and buffers) is compared.

    Raises:
        DivergenceError: a tensor's shape or bytes differ from rank 0's on some rank (raised on every rank).
    """
    model = _plain(model)
    digests = [consistency.digest(name, t.shape, _raw_bytes(t)) for name, t in model.state_dict().items()]
    problem = consistency.divergence(
        hvd.allgather_object(digests, name="hvdp.consistency"),
        fix="Broadcast the initial state (hvdp.torch.prepare does) and avoid rank-dependent code paths")
    if problem:
        raise DivergenceError(problem, rank=hvd.rank())


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, for any dtype (numpy has no bfloat16)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_same_model(model: torch.nn.Module) -> None:
    """Raise DivergenceError on every rank, naming the rank and the tensor, if the ranks built models of
    different shapes. (Horovod would fail the first broadcast with "One rank sent a tensor of shape [3], but
    another rank sent ... [4]": neither the rank nor the tensor.) One small allgather, no tensor data."""
    shapes = [consistency.digest(name, t.shape, b"") for name, t in model.state_dict().items()]
    problem = consistency.divergence(hvd.allgather_object(shapes, name="hvdp.model_shapes"), fix="")
    if problem:
        raise DivergenceError(problem, rank=hvd.rank())
