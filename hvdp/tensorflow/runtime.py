"""hvdp.tensorflow's runtime: horovod.tensorflow (imported here, once), init() and world(), and each
rank's GPU placement."""

from __future__ import annotations

import os

import tensorflow as tf
import keras

from hvdp import _horovod, _preemption
from hvdp.core import devices as _devices
from hvdp.core.errors import ConfigError
from hvdp.core.world import World
from hvdp.tensorflow import tracking

hvd = _horovod.import_horovod("tensorflow")


def init(*, timeline: str | None = None, device: str | None = None, share_gpus: bool | None = None,
         preemption: bool | None = None) -> World:
    """Initialise Horovod (horovodrun, mpirun, or plain python as size 1) and return this process's World.

    Every rank must call it (Horovod's init, the watchdog's address exchange and the CPU count are collective); a second
    call returns the World again. Before Horovod starts, hvdp's runtime defaults (hvdp.core.tuning) are set
    where the environment lacks them, and for 2+ ranks the watchdog starts (unless HVDP_WATCHDOG=0 or
    elastic mode). Unless OMP_NUM_THREADS is set, each rank gets an equal share of the CPUs it may use (its
    affinity and cgroup quota, split among the ranks on its host that share them; hvdp.core.cpus) for
    TensorFlow's thread pools (TensorFlow would otherwise start one thread per core in every rank); if an
    op already ran, TensorFlow's pools are kept as they are.

    When TensorFlow sees GPUs, each rank is given its own, GPU local_rank % (GPUs it sees), as the only GPU
    TensorFlow may use, with memory growth on (TensorFlow would otherwise map every GPU's memory in every
    rank); the ranks check that no two of them got the same GPU. Call init() before TensorFlow uses a GPU.

    Args:
        timeline: write Horovod's timeline (Chrome trace of every collective) to this path; default None:
            no timeline.
        device: "auto" (the rank's GPU when TensorFlow sees one, else the CPU), "cpu" (no GPU visible to
            TensorFlow), "cuda" (the rank's GPU, an error without one) or "cuda:N"; default None:
            HVDP_DEVICE, else "auto".
        share_gpus: allow several ranks on one GPU (default None: HVDP_SHARE_GPUS=1, else False).
        preemption: True: SIGTERM and SIGUSR1 (HVDP_PREEMPT_SIGNALS) no longer end the rank once the loop
            has called preempted(); they make preempted() true on every rank at the same step (see
            hvdp.tensorflow.preemption; hvdp.keras's callbacks call it). False: the signals' usual action.
            Default None: HVDP_PREEMPTION=1, else False.

    Returns:
        This process's World (rank, size, local_rank, local_size).

    Raises:
        SetupError: launched by mpirun or horovodrun's MPI mode, but Horovod was built without MPI.
        ConfigError: a malformed HVDP_SHM_*, HVDP_WATCHDOG_TIMEOUT, HVDP_DEVICE or HVDP_SHARE_GPUS; Keras
            runs on a backend other than TensorFlow (KERAS_BACKEND); a device that cannot be had, ranks
            sharing a GPU unasked, or TensorFlow already using GPUs before init(): on every rank; a malformed
            HVDP_PREEMPT_* or HVDP_PREEMPTION, or preemption outside the main thread or in elastic mode.
    """
    first = not hvd.is_initialized()
    w = _horovod.init("tensorflow", timeline)[1]
    _preemption.enable(preemption, w)
    if _horovod.collectives() is not None:
        tracking.install(_horovod.collectives())  # the watchdog then names the eager collective a rank waits in
    _check_keras_backend(w.rank)
    if first or device is not None:
        _place(w, _devices.request(device, share_gpus))
    if "OMP_NUM_THREADS" not in os.environ:
        threads = _horovod.threads()
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:  # TensorFlow already started its pools (an op ran before init): keep them
            pass
    return w


def world() -> World:
    """This process's World (rank, size, local_rank, local_size); call init() first (Horovod raises before)."""
    return World.from_horovod(hvd)


def _place(w: World, req) -> None:
    """Make only this rank's GPU visible to TensorFlow (none for the CPU), with memory growth."""
    gpus = tf.config.list_physical_devices("GPU")  # does not start TensorFlow's GPU runtime
    env_gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    index = _horovod.place(hvd, w, req, len(gpus), lambda i: f"{env_gpus}#{i}")
    if not gpus:
        return
    try:
        tf.config.set_visible_devices([] if index is None else [gpus[index]], "GPU")
        if index is not None:
            tf.config.experimental.set_memory_growth(gpus[index], True)
    except RuntimeError as e:  # TensorFlow's GPU runtime already started: every GPU is mapped in this rank
        raise ConfigError(f"TensorFlow already used its GPUs before hvdp.tensorflow.init() ({e}): call init() "
                          f"first, before building a model or running an op", rank=w.rank) from e


def _check_keras_backend(rank: int) -> None:
    # Under another Keras backend, a custom loop's gradients are that framework's tensors: a TensorFlow
    # all-reduce of them fails at np>1 (and does nothing visible at np=1). Every rank reads the same
    # KERAS_BACKEND, so every rank raises here, before any collective. (hvdp.keras picks horovod.torch on the
    # torch backend and never calls this init there: hvdp/_keras_backend.py.)
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ConfigError(
            f"Keras runs on the {backend!r} backend (keras.backend.backend()), and hvdp.tensorflow averages "
            f"TensorFlow gradients only: set KERAS_BACKEND=tensorflow before Keras is imported, use hvdp.keras's "
            f"model.fit (which also runs on the torch backend), or train the PyTorch way with hvdp.torch",
            rank=rank)


def _ensure_init() -> World:
    return world() if hvd.is_initialized() else init()
