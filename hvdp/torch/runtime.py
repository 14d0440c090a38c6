"""Starting a rank: init() (Horovod, runtime defaults, the watchdog, the rank's device), world(), device(),
and rank-0 output (log, progress). Owns `hvd`, the horovod.torch module every other part of the adapter uses."""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterable

import torch

from hvdp import _horovod, _preemption
from hvdp.core import devices as _devices
from hvdp.core.errors import ConfigError
from hvdp.core.watchdog import COMPUTING  # noqa: F401  (the phase between optimizer steps, for the watchdog)
from hvdp.core.world import World
from hvdp.torch import tracking

hvd = _horovod.import_horovod("torch")


def init(*, timeline: str | None = None, device: str | None = None, share_gpus: bool | None = None,
         preemption: bool | None = None) -> World:
    """Initialise Horovod (horovodrun, mpirun, or plain python as size 1) and return this process's World.

    Every rank must call it the first time (Horovod's init, the watchdog's address exchange, the CPU count and
    the GPU check are collective). A later call without `device` returns the World again and runs no
    collective (one rank alone may make it); a later call with `device` places the ranks again, and every
    rank must make it. Before Horovod starts, hvdp's runtime defaults (hvdp.core.tuning) are set
    where the environment lacks them, and for 2+ ranks the watchdog starts (unless HVDP_WATCHDOG=0 or
    elastic mode). Unless OMP_NUM_THREADS is set, each rank gets an equal share of the CPUs it may use (its
    affinity and cgroup quota, split among the ranks on its host that share them; hvdp.core.cpus) for
    torch's intra-op threads (torch would otherwise start one thread per core in every rank).

    When torch sees GPUs, each rank takes its own: GPU local_rank % (GPUs it sees), made torch's current
    device (torch.cuda.set_device) and returned by device(); put the model and batches there
    (`model.to(hvdp_torch.device())`). The ranks check that no two of them got the same GPU.

    Args:
        timeline: write Horovod's timeline (Chrome trace of every collective) to this path; default None:
            no timeline.
        device: "auto" (the rank's GPU when torch sees one, else the CPU), "cpu", "cuda" (the rank's GPU,
            an error without one) or "cuda:N" (GPU N, for users who place ranks themselves); default None:
            HVDP_DEVICE, else "auto".
        share_gpus: allow several ranks on one GPU (default None: HVDP_SHARE_GPUS=1, else False: an error
            naming the ranks when a host has more ranks than GPUs).
        preemption: True: SIGTERM and SIGUSR1 (HVDP_PREEMPT_SIGNALS) no longer end the rank once the loop
            has called preempted(); they make preempted() true on every rank at the same step (see
            hvdp.torch.preemption). False: the signals' usual action. Default None: HVDP_PREEMPTION=1, else False.

    Returns:
        This process's World (rank, size, local_rank, local_size).

    Raises:
        SetupError: launched by mpirun or horovodrun's MPI mode, but Horovod was built without MPI.
        ConfigError: a malformed HVDP_SHM_*, HVDP_WATCHDOG_TIMEOUT, HVDP_DEVICE or HVDP_SHARE_GPUS; a device
            that cannot be had, or ranks sharing a GPU unasked (on every rank); a malformed HVDP_PREEMPT_* or
            HVDP_PREEMPTION, or preemption outside the main thread or in elastic mode.
    """
    global _device
    first = not hvd.is_initialized()
    w = _horovod.init("torch", timeline)[1]
    _preemption.enable(preemption, w)
    if _horovod.collectives() is not None:
        tracking.install(_horovod.collectives())  # the watchdog then names the collective each rank waits in
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(_horovod.threads())
    if first or device is not None or _device is None:
        req = _devices.request(device, share_gpus)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = _horovod.place(hvd, w, req, visible, _gpu_id)
        if index is None:
            _device = torch.device("cpu")
        else:
            torch.cuda.set_device(index)
            _device = torch.device("cuda", index)
    return w


_device: torch.device | None = None


def _gpu_id(index: int) -> str:
    """What identifies GPU `index` across processes: its UUID (the same GPU whatever CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}#{index}"


def device() -> torch.device:
    """This rank's device, chosen by init(): its own GPU (cuda:i) when torch sees GPUs, else the CPU.

    Raises:
        ConfigError: init() was not called yet.
    """
    if _device is None:
        raise ConfigError("hvdp.torch.device() is chosen by init(): call hvdp.torch.init() first")
    return _device


def world() -> World:
    """This process's World (rank, size, local_rank, local_size); call init() first (Horovod raises before)."""
    return World.from_horovod(hvd)


def _module_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its first parameter's or buffer's device (the CPU for a module with none)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (its state_dict has no '_orig_mod.' prefix), or `model` itself."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch.nn.Module) else model


def log(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (on every process before init()), flushed at once.

    Args:
        args: what to print, as for print().
        kwargs: print()'s keywords (sep, end, file), except flush, which is always True.
    """
    if not hvd.is_initialized() or hvd.rank() == 0:
        print(*args, **kwargs, flush=True)


def progress(iterable: Iterable, **tqdm_kwargs: Any) -> Iterable:
    """A tqdm progress bar over `iterable` on rank 0, a disabled (silent) one elsewhere. Needs init() and tqdm.

    Args:
        iterable: what to iterate over.
        tqdm_kwargs: passed to tqdm.auto.tqdm (desc, total, ...), except disable.
    """
    from tqdm.auto import tqdm
    return tqdm(iterable, disable=hvd.rank() != 0, **tqdm_kwargs)
