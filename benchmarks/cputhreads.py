"""Where a rank's CPU goes, by thread (Linux /proc/self/task), for `hvdp bench`'s per-thread table.

    import torch                        # first: numpy's and torch's own pools start at import
    threads = Threads.before_init()     # the threads that exist before the library starts its own
    hvd.init()                          # or dist.init_process_group(...)
    threads.after_init(engine=True)     # names the threads init started (engine=False for DDP)
    threads.start(); ...timed steps...; threads.stop()
    threads.report()                    # {"main": cores, "engine": cores, ...}: CPU seconds / timed seconds

The kinds:
- main: the Python thread that runs the training step: the forward and backward compute, the gradient hooks
  and everything Python does (with one intra-op thread, torch computes on it);
- engine: the first native thread the library's init started: Horovod's background thread (its negotiation
  and the collectives it runs, hvdp's shared-memory all-reduce included). MPI_Init runs inside it, so
  MPI's own threads come after it (seen with gdb: the first is in BackgroundThreadLoop, the next two in
  libevent for PMIx, when torch was imported before before_init(); imported after it, OpenBLAS's thread,
  which numpy starts, would come first). Not used for DDP;
- transport: the other native threads init started: MPI's and PMIx's progress threads, Gloo's event loop
  (DDP's collectives run there and on the main thread);
- watchdog: hvdp's watchdog (the Python thread named hvdp-watchdog);
- other: any thread started later (torch's pools, autograd's device threads).
"""

import os
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(tid: int) -> float:
    """CPU seconds (user + system) thread `tid` of this process has used, 0 once it has exited."""
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class Threads:
    def __init__(self, before: set[int]):
        self.before, self.started, self.engine = before, [], False
        self.used: dict[str, float] = {}
        self.seconds, self._at = 0.0, None

    @classmethod
    def before_init(cls) -> "Threads":
        return cls(_tids())

    def after_init(self, engine: bool) -> None:
        """Note the native threads the library's init started; `engine`: the first is its background thread."""
        python = {t.native_id for t in threading.enumerate()}
        self.started, self.engine = sorted(_tids() - self.before - python), engine

    def _kinds(self) -> dict[int, str]:
        kinds = {}
        watchdog = {t.native_id for t in threading.enumerate() if t.name == "hvdp-watchdog"}
        for tid in _tids():
            if tid == threading.main_thread().native_id:
                kinds[tid] = "main"
            elif tid in watchdog:
                kinds[tid] = "watchdog"
            elif self.started and tid == self.started[0] and self.engine:
                kinds[tid] = "engine"
            elif tid in self.started:
                kinds[tid] = "transport"
            else:
                kinds[tid] = "other"
        return kinds

    def start(self) -> None:
        """Begin a timed span (forgetting the last one's figures)."""
        self.used, self._at = {}, (time.perf_counter(), {tid: _cpu(tid) for tid in _tids()})

    def stop(self) -> None:
        began, cpu = self._at
        self.seconds = time.perf_counter() - began
        for tid, kind in self._kinds().items():  # a thread that exited meanwhile: its CPU is not counted
            self.used[kind] = self.used.get(kind, 0.0) + max(0.0, _cpu(tid) - cpu.get(tid, 0.0))

    def report(self) -> dict[str, float]:
        """Each kind's CPU over the timed seconds: 1.0 is one core busy all the time."""
        return {kind: round(used / self.seconds, 3) for kind, used in sorted(self.used.items())} if self.seconds else {}
