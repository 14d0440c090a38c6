"""What hvdp's watchdog knows of this rank's Horovod collectives (PyTorch): every collective horovod.torch
submits (allreduce, allgather, broadcast, alltoall, reducescatter, their grouped forms, barrier, join: also
what allgather_object, broadcast_object, broadcast_parameters and the DistributedOptimizer use) is recorded by
its name and size, and every wait in synchronize() by the collective waited on, in the registry the watchdog
reads (hvdp.core.watchdog.Collectives), which keeps a ring of the last ones; a wait that raises writes that
ring (hvdp._horovod.collective_failed). So a hang names what each rank is blocked in, whoever called Horovod.

install() wraps horovod.torch's submit functions and synchronize() in place, once per process, when the
watchdog runs; a few dictionary operations per collective."""

from __future__ import annotations

import functools
import inspect

from hvdp import _horovod
from hvdp.core.watchdog import Collectives

# horovod.torch.mpi_ops's functions that submit a collective and return its handle, and the prefix Horovod
# gives its name (mpi_ops_v2.cc: GetOpName: "<prefix>.<name>", or "<prefix>.noname.<handle>" without one).
_SUBMIT = {"_allreduce_async": "allreduce", "_grouped_allreduce_async": "grouped_allreduce",
           "_allgather_async": "allgather", "_grouped_allgather_async": "grouped_allgather",
           "_broadcast_async": "broadcast", "_alltoall_async": "alltoall",
           "_reducescatter_async": "reducescatter", "_grouped_reducescatter_async": "grouped_reducescatter"}
# mpi_lib's functions that submit a collective without a name of the caller's.
_FIXED = {"horovod_torch_barrier": "barrier", "horovod_torch_join": "join"}


def install(collectives: Collectives) -> bool:
    """Record horovod.torch's collectives in `collectives` from now on; False when this Horovod lacks the
    functions wrapped (another version: then only the optimizer's phases are known)."""
    import horovod.torch
    import horovod.torch.functions as functions
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as optimizer

    if getattr(mpi_ops, "_hvdp_tracked", None) is collectives:
        return True
    if not all(hasattr(mpi_ops, f) for f in (*_SUBMIT, "synchronize")):
        return False
    for fn, prefix in _SUBMIT.items():
        setattr(mpi_ops, fn, _submitter(getattr(mpi_ops, fn), prefix, collectives))
    for fn, name in _FIXED.items():
        original = getattr(mpi_ops.mpi_lib, fn, None)
        if original is not None:
            setattr(mpi_ops.mpi_lib, fn, _fixed(original, name, collectives))
    original = mpi_ops.synchronize
    wait = _synchronizer(original, collectives)
    for module in (mpi_ops, functions, optimizer, horovod.torch):
        if getattr(module, "synchronize", None) is original:
            module.synchronize = wait
    mpi_ops._hvdp_tracked = collectives
    return True


def _submitter(original, prefix: str, collectives: Collectives):
    at = list(inspect.signature(original).parameters).index("name")

    @functools.wraps(original)
    def submit(*args, **kwargs):
        handle = original(*args, **kwargs)
        name = args[at] if len(args) > at else kwargs.get("name")
        collectives.submitted(handle, f"{prefix}.{name}" if name else f"{prefix}.noname.{handle}",
                              _nbytes(args[0] if args else None))
        return handle
    return submit


def _nbytes(tensors) -> int | None:
    """The bytes of a collective's input: a tensor, or a list of them (the grouped forms)."""
    try:
        if isinstance(tensors, (list, tuple)):
            return sum(t.numel() * t.element_size() for t in tensors)
        return tensors.numel() * tensors.element_size()
    except (AttributeError, TypeError):
        return None


def _fixed(original, name: str, collectives: Collectives):
    @functools.wraps(original)
    def submit(*args, **kwargs):
        handle = original(*args, **kwargs)
        collectives.submitted(handle, name)
        return handle
    return submit


def _synchronizer(original, collectives: Collectives):
    @functools.wraps(original)
    def synchronize(handle):
        collectives.wait(handle)
        try:
            result = original(handle)
        except BaseException as e:  # a collective that raised: the ring is written (hvdp._horovod)
            _horovod.collective_failed(handle, f"{type(e).__name__}: {str(e)[:200]}")
            raise
        collectives.finished(handle)
        return result
    return synchronize
