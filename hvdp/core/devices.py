"""Which device each rank computes on: the rank's own GPU when there are GPUs, else the CPU.

Pure: the adapters ask their framework how many GPUs this process sees and what identifies each, and
exchange those identities through Horovod; the decisions are made here, once for every framework.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from hvdp.core.errors import ConfigError

KINDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """What the user asked for: `kind` "auto" (the rank's GPU if there is one, else the CPU), "cpu" or "cuda"
    (a GPU, an error without one); `index`, a GPU the user chose ("cuda:1"), or None (the rank's by its
    local rank); `share`, whether several ranks may use one GPU."""

    kind: str = "auto"
    index: int | None = None
    share: bool = False


def request(device: str | None = None, share: bool | None = None, env=None) -> DeviceRequest:
    """The DeviceRequest from init()'s arguments, or where they are None from HVDP_DEVICE and HVDP_SHARE_GPUS.

    Args:
        device: "auto", "cpu", "cuda" or "cuda:N" (default None: HVDP_DEVICE, else "auto").
        share: let several ranks use one GPU (default None: HVDP_SHARE_GPUS=1, else False).
        env: the environment to read (default os.environ).

    Raises:
        ConfigError: an unknown device or a malformed HVDP_SHARE_GPUS, naming where it came from.
    """
    env = os.environ if env is None else env
    source = "device=" if device is not None else "HVDP_DEVICE="
    spec = (device if device is not None else env.get("HVDP_DEVICE", "auto")).strip().lower()
    kind, _, number = spec.partition(":")
    if kind not in KINDS or (number and (kind != "cuda" or not number.isdigit())):
        raise ConfigError(f"{source}{spec!r} is not a device: use auto (the rank's GPU when there is one), cpu, "
                          f"cuda (the rank's GPU by its local rank) or cuda:N (GPU N of those this process sees)")
    if share is None:
        raw = env.get("HVDP_SHARE_GPUS", "0").strip()
        if raw not in ("0", "1"):
            raise ConfigError(f"HVDP_SHARE_GPUS={raw!r}: use 1 (several ranks may use one GPU) or 0 (the default)")
        share = raw == "1"
    return DeviceRequest(kind, int(number) if number else None, bool(share))


def gpu_index(req: DeviceRequest, local_rank: int, visible: int) -> int | None:
    """The GPU (an index among the `visible` ones) this rank uses, or None for the CPU.

    "auto" and "cuda" take GPU local_rank % visible, so the ranks of a host spread over its GPUs, and a
    rank that sees only its own (Slurm's --gpus-per-task, a per-rank CUDA_VISIBLE_DEVICES) takes that one.

    Args:
        req: what the user asked for (request()).
        local_rank: this rank's place among the ranks of its host.
        visible: how many GPUs this process sees.

    Raises:
        ConfigError: "cuda" with no visible GPU, or cuda:N with N >= visible.
    """
    if req.kind == "cpu" or (req.kind == "auto" and visible == 0):
        return None
    if visible == 0:
        raise ConfigError("device cuda was asked for, but this process sees no GPU (no CUDA build of the "
                          "framework, no driver, or CUDA_VISIBLE_DEVICES empty): use device='auto' or 'cpu'")
    if req.index is not None:
        if req.index >= visible:
            raise ConfigError(f"device cuda:{req.index} was asked for, but this process sees {visible} GPU(s) "
                              f"(0..{visible - 1})")
        return req.index
    return local_rank % visible


def shared_gpus(placements: list) -> dict:
    """The GPUs that two or more ranks use: {(host, gpu id): [ranks]}.

    Args:
        placements: every rank's (host, gpu id), or None for a rank on the CPU, in rank order.
    """
    users = defaultdict(list)
    for rank, placement in enumerate(placements):
        if placement is not None and placement[1] is not None:
            users[tuple(placement)].append(rank)
    return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}


def sharing_error(shared: dict, visible: int) -> str | None:
    """The message for ranks that share a GPU without asking to, or None when none do.

    Args:
        shared: what shared_gpus() found.
        visible: how many GPUs each rank sees (for the advice).
    """
    if not shared:
        return None
    (host, gpu), ranks = next(iter(shared.items()))
    return (f"ranks {ranks} on host {host} would all use GPU {gpu}: more ranks on the host than the {visible} GPU(s) "
            f"each sees. Launch at most {visible} rank(s) per host (horovodrun -H {host}:{visible}), give each rank "
            f"its own GPU (Slurm --gpus-per-task=1, CUDA_VISIBLE_DEVICES), or set HVDP_SHARE_GPUS=1 "
            f"(init(share_gpus=True)) to share: NCCL refuses two ranks on one GPU, so sharing needs a Horovod "
            f"built without GPU operations (CUDA tensors then go through host memory)")


__all__ = ["KINDS", "DeviceRequest", "request", "gpu_index", "shared_gpus", "sharing_error"]
