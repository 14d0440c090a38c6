"""What a rank holds for training, measured rather than computed (benchmarks/train_worker.py's records).

    rise = Rise(device)                     # resets the kernel's peak-RSS mark, notes RSS and RssAnon now
    ...train...
    held(model, optimizer)                  # {"optimizer_state_bytes": ..., "gradient_bytes": ...}
    rise.report()                           # {"peak_rss_rise_bytes": ..., "anon_rise_bytes": ..., ...}

held() walks the tensors that exist: every tensor in the optimizer's state (the wrapped optimizer's for hvdp's
sharded one, whose state is its shard's; the local optimizer's for ZeroRedundancyOptimizer) and every .grad of
the model's parameters and of the optimizer's (the sharded optimizer's flat shard parameters hold its
gradients), each storage counted once (by its data pointer) at its allocated size. What a library keeps
elsewhere (DDP's gradient buckets, Horovod's fusion buffer, autograd's activations) is not a tensor of either
kind: the process's memory rise shows it.
"""

from __future__ import annotations

from pathlib import Path

import torch

STATUS = Path("/proc/self/status")


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    seen.pop(0, None)  # empty tensors: no storage
    return sum(seen.values())


def _state_tensors(optimizer):
    optimizers = [optimizer, getattr(optimizer, "optim", None), getattr(optimizer, "_inner", None)]
    for opt in (o for o in optimizers if isinstance(o, torch.optim.Optimizer)):
        for per_param in opt.state.values():
            yield from (v for v in per_param.values() if torch.is_tensor(v))


def _gradients(model, optimizer):
    optimizers = [optimizer, getattr(optimizer, "optim", None)]
    params = [*model.parameters(), *(p for o in optimizers if isinstance(o, torch.optim.Optimizer)
                                     for g in o.param_groups for p in g["params"])]
    return (p.grad for p in params if p.grad is not None)


def held(model, optimizer) -> dict[str, int]:
    """The bytes of the optimizer-state tensors and of the gradient tensors that exist now on this rank."""
    return {"optimizer_state_bytes": _storage_bytes(_state_tensors(optimizer)),
            "gradient_bytes": _storage_bytes(_gradients(model, optimizer))}


def _status() -> dict[str, int]:
    """/proc/self/status's sizes in bytes (VmRSS, VmHWM, RssAnon, ...)."""
    out = {}
    for line in STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Rise:
    """How much the process's memory grew from before training: the peak (the kernel's high-water mark of the
    resident set, reset at the start) and the anonymous memory now (malloc's heap: tensors, buffers)."""

    def __init__(self, device: torch.device):
        try:  # "5": reset VmHWM to the current RSS (Linux 4.0+), so the peak is this run's, not the imports'
            Path("/proc/self/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        now = _status()
        self.rss, self.anon, self.device = now["VmRSS"], now["RssAnon"], device
        self.cuda = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.cuda = torch.cuda.memory_allocated(device)

    def report(self) -> dict:
        now = _status()
        out = {"peak_rss_rise_bytes": now["VmHWM"] - self.rss, "anon_rise_bytes": now["RssAnon"] - self.anon,
               "peak_reset": self.reset}
        if self.cuda is not None:  # on a GPU the tensors are there: the allocator's peak above the start
            out["cuda_peak_rise_bytes"] = torch.cuda.max_memory_allocated(self.device) - self.cuda
        return out
