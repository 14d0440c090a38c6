"""Starting a rank's data-loading worker processes safely, framework-free: which start method, what must
pickle, and what the script must not run when a worker imports it.

A rank runs threads from init() on (Horovod's background thread, MPI's, hvdp's watchdog). A process forked
while another thread holds a lock starts with that lock held and nobody to release it: CPython 3.11's own
fork handler then waits forever for the interpreter's thread-list lock (PyOS_AfterFork_Child ->
_PyThreadState_DeleteExcept), and the rank waits forever for the batch that worker never makes (issue 36;
tests/torch/test_worker_starts.py makes it happen). So hvdp starts workers with "forkserver": a helper
process, started once per rank by fork+exec (no Python runs between the two), that forks each worker from
itself, single-threaded. The price: what a worker needs (the dataset, collate_fn, worker_init_fn, a stream's
transform) is pickled to it, and the worker imports the script that started the rank (as `__mp_main__`), so
the script's top level must not start training (an `if __name__ == "__main__":` guard).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from typing import Any, Callable

from hvdp.core.clusters import unguarded

SAFE_METHODS = ("forkserver", "spawn")
GUARD_FIX = ('put the training code under `if __name__ == "__main__":` (for example in a main() called from '
             'there), so that importing the script runs only its imports and definitions')


def start_method(available: list[str] | tuple[str, ...]) -> str:
    """The start method hvdp gives worker processes: "forkserver" where the platform has it, else "spawn".

    Args:
        available: the platform's methods (multiprocessing.get_all_start_methods()).

    Raises:
        ValueError: neither is available (no platform Python supports lacks spawn).
    """
    for method in SAFE_METHODS:
        if method in available:
            return method
    raise ValueError(f"no safe start method among {list(available)}")


class _Sink(io.RawIOBase):
    """A file that keeps nothing: pickling into it costs no memory."""

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return memoryview(b).nbytes


def main_importable(main: Any) -> bool:
    """Whether a worker process can import the module `main` (sys.modules["__main__"]) to find what is defined
    there: a script file (`python train.py`) or a module (`python -m pkg.train`); not the REPL, `python -c`,
    `python - < train.py` (its __file__ is "<stdin>") nor a notebook kernel."""
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def probe(obj: Any, *, skip: Callable[[Any], bool] = lambda o: False,
          pickler: type = pickle.Pickler) -> tuple[str | None, list[str]]:
    """Pickle `obj` as a worker start will (with `pickler`, e.g. multiprocessing's ForkingPickler and the
    reductions a framework registers on it) into a sink that keeps nothing; objects for which `skip` is true
    (large arrays and tensors, which pickle by value or through shared memory) are not serialized.

    Returns:
        (the pickling error or None, the classes and functions defined in module `__main__` that it refers
        to: a worker must import the script to find them).
    """
    from_main: list[str] = []

    class Probe(pickler):
        def persistent_id(self, o):
            return id(o) if skip(o) else None

        def reducer_override(self, o):
            if callable(o) and getattr(o, "__module__", None) == "__main__":
                from_main.append(getattr(o, "__qualname__", None) or type(o).__qualname__)
            return NotImplemented

    try:
        Probe(_Sink(), None).dump(obj)  # the protocol multiprocessing uses
    except Exception as e:  # noqa: BLE001 - whatever stops pickling stops the worker start
        return f"{type(e).__name__}: {e}", sorted(set(from_main))
    return None, sorted(set(from_main))


def unpicklable(obj: Any, *, skip: Callable[[Any], bool] = lambda o: False,
                pickler: type = pickle.Pickler, interactive: bool | None = None) -> str | None:
    """Why `obj` cannot be sent to a worker process that a safe start method starts, or None when it can.

    Args:
        obj: the object (a dataset, a collate_fn, a worker_init_fn, a transform).
        skip: which objects not to serialize (default: none); see probe().
        pickler: the Pickler class to use (default pickle.Pickler).
        interactive: whether `__main__` cannot be imported by a worker (the REPL, `python -c`, `python -`, a
            notebook: not main_importable()); default None: decided from sys.modules["__main__"]. Then a class
            or function defined there pickles by name but cannot be found by the worker.

    Returns:
        None, or the reason: the pickling error, or the names defined in an unimportable `__main__`.
    """
    if interactive is None:
        interactive = not main_importable(sys.modules.get("__main__"))
    why, from_main = probe(obj, skip=skip, pickler=pickler)
    if why:
        return why
    if interactive and from_main:
        return interactive_reason(from_main)
    return None


def interactive_reason(names: list[str]) -> str:
    """Why objects defined in an unimportable `__main__` (names) cannot reach a worker, and the fix."""
    return (f"it uses {', '.join(names)}, defined in an interactive session (the REPL, `python -c`, `python -` or "
            f"a notebook), which a worker process cannot import. Fix: move {', '.join(names)} into a module file "
            f"(e.g. data.py beside the notebook or script) and import it from there")


def unpicklable_message(call: str, what: str, obj: Any, why: str, method: str) -> str:
    """The error for an object that cannot reach the worker processes.

    Args:
        call: the call that starts the workers, e.g. "shard(num_workers=2)".
        what: the argument, e.g. "dataset" or "collate_fn".
        obj: the object, for its name.
        why: what unpicklable() said.
        method: the start method.
    """
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return (f"{call}: {what} {name} cannot be sent to the DataLoader's worker processes ({why}). The workers "
            f"start with multiprocessing's {method!r} method, safe in a rank whose threads run (a forked worker "
            f"can deadlock at its first step), which pickles the {what} to each worker. Make it picklable: "
            f"define classes and functions at the top level of a module (not inside a function, not a lambda), "
            f"use functools.partial instead of a closure, and open files or connections in the worker (in "
            f"__getitem__/__iter__ or worker_init_fn) rather than in __init__; or pass num_workers=0 to read in "
            f"this process")


def guard_problem(source: str, line: int) -> bool:
    """Whether `line` of the script `source` runs when a worker process imports the script (module-level
    code outside an `if __name__ == "__main__":` block): hvdp.core.clusters.unguarded."""
    return unguarded(source, line)


def guard_message(call: str, where: str, what: str, method: str, needed: list[str] | None = None) -> str:
    """The error for a script whose top level would start training again in every worker.

    Args:
        call: the call that starts the workers, e.g. "shard(num_workers=2)".
        where: "file:line" of the unguarded line.
        what: what that line does, e.g. "hvdp.torch.init() is called".
        method: the start method.
        needed: the classes and functions defined in the script that the workers need (why they import it);
            None: not known.
    """
    why = (f"{', '.join(needed)} {'is' if len(needed) == 1 else 'are'} defined in your script, so each worker "
           f"imports the script (as module __mp_main__) to find {'it' if len(needed) == 1 else 'them'}"
           if needed else "each worker imports your script (as module __mp_main__) to find what it was sent")
    move = (f"; or move {', '.join(needed)} into a module of its own and import it (then the workers never import "
            f"the script)" if needed else "")
    return (f"{call} starts its DataLoader workers with multiprocessing's {method!r} method, and {why}; but {what} "
            f"at {where}, at the top level of the script, outside an `if __name__ == \"__main__\":` block, so "
            f"every worker would run it again (Horovod and training inside each worker). Fix: {GUARD_FIX}{move}; "
            f"or pass num_workers=0")


def helper_message(call: str, where: str) -> str:
    """The error raised when a worker process, importing the script, reaches `call` at `where`."""
    return (f"{call} was reached at {where} while a worker process (a DataLoader worker, or multiprocessing's "
            f"forkserver) imports your script as module __mp_main__: that line is at the top level of the script, "
            f"outside an `if __name__ == \"__main__\":` block. Fix: {GUARD_FIX}")


def fork_warning(origin: str, where: str | None) -> str:
    """The warning for a fork in a rank whose threads run.

    Args:
        origin: what forks, e.g. "a torch DataLoader with num_workers > 0 and the fork start method".
        where: "file:line" of the user code that led to it, or None.
    """
    at = f" (at {where})" if where else ""
    return (f"hvdp: {origin}{at} forks this rank's process while its other threads run (Horovod's background "
            f"thread, MPI's, hvdp's watchdog). A forked child can deadlock at its first step when another thread "
            f"held a lock at that moment (CPython's own fork handler waits forever), and the job then hangs "
            f"waiting for it. Fix: start child processes with 'forkserver' or 'spawn': for a DataLoader pass "
            f"multiprocessing_context='forkserver' (hvdp.torch.shard does), for multiprocessing use "
            f"multiprocessing.get_context('forkserver'), for a command use subprocess. This warning is shown once "
            f"per rank.")


__all__ = ["SAFE_METHODS", "GUARD_FIX", "start_method", "main_importable", "probe", "unpicklable",
           "interactive_reason", "unpicklable_message", "guard_problem",
           "guard_message", "helper_message", "fork_warning"]
