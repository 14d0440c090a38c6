"""What hvdp.spark and hvdp.ray share on the driver: importing the engine with the install line in the error,
a training function named by "module:function" (imported on the workers only), finding a launch made from a
script's top level without a main guard, and waiting visibly. Stdlib only: the workers import it too."""

from __future__ import annotations

import functools
import importlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hvdp.core.clusters import main_guard_message, unguarded
from hvdp.core.errors import ConfigError, SetupError


def require(module: str, install: str):
    """Import `module`, or raise SetupError naming the fix (`install`, e.g. the pip line)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SetupError(f"cannot import {module} ({e}): {install}") from e


def call_by_name(target: str, *args: Any, **kwargs: Any) -> Any:
    """Import "module:function" and call it: runs on a worker, so the driver never imports the training code
    (nor the framework it imports)."""
    module, _, name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"train_fn={target!r}: cannot import it on this worker ({type(e).__name__}: {e}). "
                          f"The module must be importable where the workers run (PYTHONPATH, or installed "
                          f"there)") from e
    return fn(*args, **kwargs)


def training_function(train_fn: Callable | str, launcher: str) -> Callable:
    """`train_fn` as the callable Horovod ships to the workers: a callable as it is, a "module:function"
    string as call_by_name bound to it."""
    if callable(train_fn):
        return train_fn
    if isinstance(train_fn, str) and train_fn.count(":") == 1 and all(train_fn.split(":")):
        return functools.partial(call_by_name, train_fn)
    raise ConfigError(f"{launcher}: train_fn={train_fn!r} is neither a function nor a 'module:function' name")


def check_main_guard(launcher: str, why: str, *, always: bool) -> None:
    """Raise ConfigError when this launch runs as a driver script's module-level code outside an
    `if __name__ == "__main__":` block.

    A launch from a script that multiprocessing's spawn re-imports (module `__mp_main__`) is always refused:
    that is the missing guard at work, a second launch from a helper process. A launch from the script
    itself (`__main__`) is checked when `always` (the launch will spawn such helpers); interactive code and
    `python -c`, which have no script file to read, are not.
    """
    frame, site = sys._getframe(1), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") in ("__main__", "__mp_main__"):
            site = frame
        frame = frame.f_back
    if site is None:
        return
    where = f"{site.f_code.co_filename}:{site.f_lineno}"
    if site.f_globals["__name__"] == "__mp_main__":
        raise ConfigError(main_guard_message(launcher, where, why + " This process is such a helper."))
    if not always:
        return
    try:
        source = Path(site.f_code.co_filename).read_text()
    except (OSError, UnicodeDecodeError):
        return
    if unguarded(source, site.f_lineno):
        raise ConfigError(main_guard_message(launcher, where, why))


def wait_for(what: str, ready: Callable[[], bool], timeout: float, fail: Callable[[float], Exception],
             every: float = 10.0, poll: float = 0.5) -> None:
    """Poll `ready()` until it is true; say on stderr every `every` seconds that `what` is still awaited;
    after `timeout` seconds raise `fail(seconds waited)`."""
    started = last = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - started >= timeout:
            raise fail(now - started)
        if now - last >= every:
            print(f"hvdp: still waiting for {what} ({now - started:.0f}s of {timeout:.0f}s)", file=sys.stderr,
                  flush=True)
            last = now
        time.sleep(poll)
