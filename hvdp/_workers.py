"""The processes a rank starts, for every adapter: the start method of data-loading workers (forkserver, with
what every worker would import loaded once), the script checks that start needs, and a warning at the first
fork a rank makes while its threads run. The rules and messages are in hvdp.core.workers."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import FrameType

from hvdp.core.errors import ConfigError
from hvdp.core.workers import fork_warning, guard_message, guard_problem, helper_message, start_method

PRELOAD_ENV = "HVDP_FORKSERVER_PRELOAD"  # what hvdp._preload imports in the forkserver (JSON), set by hvdp

_init_site: tuple[str, str] | None = None  # (file:line, what) of an init() at a script's unguarded top level
_guard_pid: int | None = None   # the process whose forks are watched (a forked child inherits the hook)
_fork_warned = False
_STARTED = time.time()  # when hvdp was imported here: the script running was read before that


def _script_frame() -> FrameType | None:
    """The outermost frame of the script's top-level code (module `__main__`) on this thread's stack, or
    None (a thread of its own)."""
    frame, site = sys._getframe(1), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            site = frame
        frame = frame.f_back
    return site


def _unguarded_site() -> str | None:
    """"file:line" of the script's top-level line running now when it is outside a main guard, else None
    (no script file: interactive code, `python -c`; or a script edited since this process started, whose
    lines on disk are no longer the ones running)."""
    site = _script_frame()
    if site is None:
        return None
    path = Path(site.f_code.co_filename)
    try:
        if path.stat().st_mtime > _STARTED:
            return None
        source = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return f"{site.f_code.co_filename}:{site.f_lineno}" if guard_problem(source, site.f_lineno) else None


def refuse_helper_import(call: str) -> None:
    """Raise ConfigError when `call` (init) runs because a worker process imports the script as
    `__mp_main__`: Horovod must never start inside a DataLoader worker or a forkserver.

    Args:
        call: the function reached, e.g. "hvdp.torch.init()".
    """
    frame = sys._getframe(1)
    while frame is not None:  # a helper's own code (`python -c ...`) is further out, as module __main__
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise ConfigError(helper_message(call, f"{frame.f_code.co_filename}:{frame.f_lineno}"))
        frame = frame.f_back


def note_init_site(call: str) -> None:
    """Remember where `call` (init) ran when that is a script's unguarded top level: a worker started with a
    safe method would run it again, and script_problem() says so before any worker starts."""
    global _init_site
    where = _unguarded_site()
    if where is not None and _init_site is None:
        _init_site = (where, f"{call} is called")


def script_problem(call: str, method: str, needed: list[str] | None = None) -> str | None:
    """The error for starting worker processes that import the script with `method` now, or None: the script
    started Horovod at its unguarded top level, or is making this call there (each worker would do it again).

    Args:
        call: what starts the workers, e.g. "shard(num_workers=2)".
        method: the start method ("forkserver" or "spawn"; "fork" never imports the script).
        needed: what the workers need from the script (why they import it), for the message.
    """
    if method == "fork":
        return None
    if _init_site is not None:
        return guard_message(call, _init_site[0], _init_site[1], method, needed)
    where = _unguarded_site()
    return guard_message(call, where, f"{call.split('(')[0]}() is called", method, needed) if where else None


def worker_context(main: bool = True):
    """The multiprocessing context for data-loading workers: forkserver, or spawn where there is none
    (hvdp.core.workers.start_method). Give a forkserver its preload with preload_forkserver().

    Args:
        main: whether the workers import the script (module `__main__`) as they start, as multiprocessing's
            own contexts always have them do. False (nothing sent to them is defined there) gives a context
            whose workers do not: they start from a `python -`, `python -c`, a notebook kernel, or a script
            without a main guard, none of which a worker can (or may) import.
    """
    method = start_method(multiprocessing.get_all_start_methods())
    if main:
        return multiprocessing.get_context(method)
    return _NoMainForkServerContext() if method == "forkserver" else _NoMainSpawnContext()


_launching = threading.local()  # .without_main: this thread is starting a worker that must not import __main__


def _without_main(get_preparation_data):
    """multiprocessing.spawn.get_preparation_data, less the keys that make the new process import the parent's
    `__main__` ("init_main_from_path", "init_main_from_name") while this thread starts a no-main worker.
    Installed once; any other process start (another thread's, any other context's) gets the data unchanged."""
    def get_without_main(name):
        data = get_preparation_data(name)
        if getattr(_launching, "without_main", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data
    get_without_main.hvdp_without_main = True
    return get_without_main


def _launch_without_main(popen_class):
    """A Popen class (popen_forkserver's, popen_spawn_posix's) whose child does not import `__main__`: the
    start pickles the same preparation data, less that."""
    from multiprocessing import spawn

    if not getattr(spawn.get_preparation_data, "hvdp_without_main", False):
        spawn.get_preparation_data = _without_main(spawn.get_preparation_data)

    class Popen(popen_class):
        def _launch(self, process_obj):
            _launching.without_main = True
            try:
                super()._launch(process_obj)
            finally:
                _launching.without_main = False
    return Popen


class _NoMainForkServerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        from multiprocessing import popen_forkserver
        return _launch_without_main(popen_forkserver.Popen)(process_obj)


class _NoMainForkServerContext(multiprocessing.context.ForkServerContext):
    """multiprocessing's forkserver context, whose processes do not import the parent's `__main__`."""
    Process = _NoMainForkServerProcess


class _NoMainSpawnProcess(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        from multiprocessing import popen_spawn_posix
        return _launch_without_main(popen_spawn_posix.Popen)(process_obj)


class _NoMainSpawnContext(multiprocessing.context.SpawnContext):
    """multiprocessing's spawn context (POSIX), whose processes do not import the parent's `__main__`."""
    Process = _NoMainSpawnProcess


def preload_forkserver(modules: list[str], *, main: bool = True, ignore_signals: tuple[str, ...] = ()) -> None:
    """Have this rank's forkserver, when it starts, import `modules` and, when `main`, the script (as
    `__mp_main__`, as each worker otherwise would: Python 3.11's forkserver never preloads the script, its key
    for it is misspelt), so that each worker forked from it starts in milliseconds instead of importing torch
    again (seconds). A no-op once the forkserver runs.

    Args:
        modules: what to import there.
        main: whether to import the script there too (False: nothing the workers receive is defined in it, and
            the script may be unimportable or unguarded).
        ignore_signals: signal names the forkserver ignores from its start, and so every worker it forks
            ("SIGTERM"...: preemption is on, and a scheduler signals every process of the job).
    """
    from multiprocessing import forkserver, spawn

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    spec = {"modules": list(modules), "ignore_signals": list(ignore_signals)}
    if main:
        data = spawn.get_preparation_data("hvdp-preload")  # how a worker would find the script (none: interactive)
        spec.update({k: data[k] for k in ("init_main_from_path", "init_main_from_name") if k in data})
    os.environ[PRELOAD_ENV] = json.dumps(spec)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if "hvdp._preload" not in current:
        multiprocessing.set_forkserver_preload(current + ["hvdp._preload"])


def ignore_stop_signals(names: tuple[str, ...]) -> None:
    """Ignore the signals `names` ("SIGTERM", "SIGUSR1", "SIGINT") in this process (a data-loading worker, its
    forkserver) and restore the default action of the other stop signals: a worker lives as long as its rank
    (follow()) and is stopped by it, so a scheduler's signal to every process of the job reaches the rank,
    which checkpoints at the step the ranks agree on, instead of killing the worker under it."""
    import signal

    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        if name in names:
            signal.signal(sig, signal.SIG_IGN)
        elif name != "SIGINT" and signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def follow(pid: int) -> None:
    """End this process (a data-loading worker) as soon as process `pid` (its rank) is gone, however it ended.

    A worker forked from a forkserver is the forkserver's child, not the rank's: torch's worker loop checks
    its parent, which outlives a killed rank (it waits for its own children), so without this the workers and
    the forkserver of a rank that crashed or was killed live on, and horovodrun --gloo, whose output pipe they
    hold, waits for them. One daemon thread, blocked on a pidfd (or polling once a second without one)."""
    import threading

    def watch():
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            import select
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except OSError:
                    pass
                time.sleep(1.0)
        os._exit(0)

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        os._exit(0)
    except OSError:
        pass
    threading.Thread(target=watch, name="hvdp-follow-rank", daemon=True).start()


def guard_forks() -> None:
    """Warn once, at the first fork this process makes from now on (os.fork, multiprocessing's fork method, a
    DataLoader with fork workers, subprocess with preexec_fn), that a forked child can deadlock. Installed by
    init() (Horovod's threads run from then on); never raises."""
    global _guard_pid
    if _guard_pid is None:
        _guard_pid = os.getpid()
        os.register_at_fork(before=_before_fork)


def _before_fork() -> None:
    global _fork_warned
    if _fork_warned or os.getpid() != _guard_pid:
        return
    _fork_warned = True
    try:
        message = fork_warning(*_fork_origin())
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - warnings turned into errors: say it, never raise at a fork
            print(f"RuntimeWarning: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a fork must go on whatever happens here
        pass


def _fork_origin() -> tuple[str, str | None]:
    """(what forks, "file:line" of the first frame outside the standard library and installed packages)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    origin, where = "os.fork()", None
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch/utils/data/dataloader.py" in name:
            origin = "a torch DataLoader with num_workers > 0 and the fork start method"
        elif origin == "os.fork()" and os.sep + "multiprocessing" + os.sep in name:
            origin = "a multiprocessing process started with the fork method"
        elif origin == "os.fork()" and name.endswith("subprocess.py"):
            origin = "subprocess with preexec_fn"
        if where is None and not name.startswith(stdlib) and "site-packages" not in name and not name.startswith("<"):
            where = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return origin, where
