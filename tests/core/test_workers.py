"""Worker processes started safely (issue 36), without a framework: the start method, what must pickle, the
script checks, the forkserver's preload and the warning at a fork. The DataLoader side runs under horovodrun
in tests/torch/worker_torch.py; the hang it prevents, in tests/torch/test_worker_starts.py."""

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

from hvdp import _workers
from hvdp.core.workers import (fork_warning, guard_message, helper_message, start_method, unpicklable,
                               unpicklable_message)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Plain:
    def __init__(self, value=None):
        self.value = value


class Exploding:
    def __reduce__(self):
        raise AssertionError("serialized")


@pytest.mark.parametrize("available,expected", [(["fork", "spawn", "forkserver"], "forkserver"),
                                                (["spawn"], "spawn"), (["spawn", "fork"], "spawn")])
def test_start_method_is_never_fork(available, expected):
    assert start_method(available) == expected


def test_start_method_without_a_safe_one_is_an_error():
    with pytest.raises(ValueError):
        start_method(["fork"])


def local_class():
    class Local:
        pass
    return Local()


@pytest.mark.parametrize("obj,expected", [
    (lambda x: x, "Can't pickle <function <lambda>"),
    (local_class(), "local object 'local_class.<locals>.Local'"),
    (Plain(threading.Lock()), "cannot pickle '_thread.lock' object"),
    (Plain(Exploding()), "serialized"),
])
def test_what_a_worker_cannot_receive_is_said(obj, expected):
    why = unpicklable(obj, interactive=False)
    assert why is not None and expected in why, why


@pytest.mark.parametrize("obj", [Plain([1, "a", (2.0,)]), functools.partial(print, 1), print, Plain,
                                 np.arange(10), Plain(np.zeros((1000, 1000)))])
def test_what_pickles_passes(obj):
    assert unpicklable(obj, interactive=False) is None


def test_skipped_objects_are_not_serialized():
    """Large arrays and tensors are never copied by the check: `skip` keeps them out of it."""
    assert unpicklable(Plain(Exploding()), skip=lambda o: isinstance(o, Exploding), interactive=False) is None


def test_names_defined_in_an_interactive_main_are_refused(monkeypatch):
    """A class of the REPL, `python -c` or a notebook pickles by name, but a worker cannot import it."""
    monkeypatch.setattr(sys.modules["__main__"], "Plain", Plain, raising=False)
    Plain.__module__ = "__main__"
    try:
        why = unpicklable(Plain(1), interactive=True)
        assert why is not None and "Plain" in why and "interactive session" in why, why
        assert unpicklable(Plain(1), interactive=False) is None
    finally:
        Plain.__module__ = __name__


def test_messages_name_the_object_the_method_and_the_fix():
    msg = unpicklable_message("shard(num_workers=2)", "collate_fn", lambda b: b, "PicklingError: x", "forkserver")
    assert msg.startswith("shard(num_workers=2): collate_fn ") and "<lambda>" in msg and "'forkserver'" in msg
    assert "top level of a module" in msg and "num_workers=0" in msg
    msg = guard_message("shard(num_workers=2)", "train.py:12", "hvdp.torch.init() is called", "forkserver")
    assert "hvdp.torch.init() is called at train.py:12" in msg and 'if __name__ == "__main__":' in msg
    assert "__mp_main__" in helper_message("hvdp.torch.init()", "train.py:3")
    msg = fork_warning("a torch DataLoader with num_workers > 0 and the fork start method", "train.py:40")
    assert "(at train.py:40)" in msg and "multiprocessing_context='forkserver'" in msg and "once" in msg


def test_fork_guard_warns_once_and_never_raises(monkeypatch, capsys):
    monkeypatch.setattr(_workers, "_guard_pid", os.getpid())
    monkeypatch.setattr(_workers, "_fork_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _workers._before_fork()
        _workers._before_fork()
    caught = [str(w.message) for w in caught if "forks this rank's process" in str(w.message)]
    assert len(caught) == 1 and "os.fork()" in caught[0] and "test_workers.py:" in caught[0], caught
    monkeypatch.setattr(_workers, "_fork_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error: the warning is printed instead, nothing is raised at a fork
        _workers._before_fork()
    assert "forks this rank's process" in capsys.readouterr().err
    monkeypatch.setattr(_workers, "_fork_warned", False)
    monkeypatch.setattr(_workers, "_guard_pid", os.getpid() + 1)  # a forked child: nothing to say
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _workers._before_fork()
    assert not [w for w in caught if "forks this rank's process" in str(w.message)]


def run_script(tmp_path, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def test_init_at_an_unguarded_top_level_is_refused_before_any_worker_starts(tmp_path):
    proc = run_script(tmp_path, """
        from hvdp import _workers
        _workers.note_init_site("hvdp.torch.init()")  # where init() runs: the top level, no guard

        def main():
            print("problem:", _workers.script_problem("shard(num_workers=2)", "forkserver"))
            print("fork:", _workers.script_problem("shard(num_workers=2)", "fork"))

        if __name__ == "__main__":
            main()
    """)
    assert "problem: shard(num_workers=2) starts its DataLoader workers with multiprocessing's 'forkserver'" \
        in proc.stdout and "hvdp.torch.init() is called at" in proc.stdout and "script.py:3" in proc.stdout, proc
    assert "fork: None" in proc.stdout


def test_a_guarded_script_passes(tmp_path):
    proc = run_script(tmp_path, """
        from hvdp import _workers

        def main():
            _workers.note_init_site("hvdp.torch.init()")
            print("problem:", _workers.script_problem("shard(num_workers=2)", "forkserver"))

        if __name__ == "__main__":
            main()
    """)
    assert "problem: None" in proc.stdout, proc


def test_a_worker_importing_the_script_cannot_start_horovod(tmp_path):
    """What a forkserver or a spawned worker does: import the script as __mp_main__; init() there refuses."""
    (tmp_path / "train.py").write_text("from hvdp import _workers\n_workers.refuse_helper_import('hvdp.torch.init()')\n")
    proc = run_script(tmp_path, """
        import runpy
        try:
            runpy.run_path("train.py", run_name="__mp_main__")
        except ValueError as e:
            print("refused:", e)
    """)
    assert "refused: hvdp.torch.init() was reached at" in proc.stdout and "train.py:2" in proc.stdout, proc


def test_forkserver_preload_imports_the_modules_and_the_script_once(tmp_path):
    """hvdp._preload, as the forkserver imports it: the modules, then the script as __mp_main__ (its guarded
    part not run), so that the workers forked from the forkserver import neither again."""
    script = tmp_path / "train.py"
    script.write_text("import json\nMARK = 'imported'\nif __name__ == '__main__':\n    MARK = 'ran'\n")
    spec = {"modules": ["colorsys"], "init_main_from_path": str(script)}
    proc = subprocess.run([sys.executable, "-c", "import sys, hvdp._preload; m = sys.modules['__main__']; "
                           "print(m.__name__, m.MARK, 'colorsys' in sys.modules)"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT, _workers.PRELOAD_ENV: json.dumps(spec)})
    assert proc.stdout.split() == ["__mp_main__", "imported", "True"], proc
    bad = {"modules": ["no_such_module_hvdp"], "init_main_from_path": str(tmp_path / "missing.py")}
    proc = subprocess.run([sys.executable, "-c", "import hvdp._preload; print('alive')"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT,
                                                      _workers.PRELOAD_ENV: json.dumps(bad)})
    assert proc.stdout.strip() == "alive" and "could not preload no_such_module_hvdp" in proc.stderr, proc
    assert "could not import the script" in proc.stderr


def test_a_worker_ends_when_the_process_it_follows_is_gone(tmp_path):
    """A forkserver's worker is the forkserver's child: it must end with its rank, however the rank ended."""
    proc = run_script(tmp_path, """
        import os, subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        worker = os.fork()
        if worker == 0:
            from hvdp import _workers
            _workers.follow(rank.pid)
            time.sleep(60)
            os._exit(3)
        time.sleep(0.5)
        rank.kill()
        rank.wait()
        start = time.monotonic()
        _, status = os.waitpid(worker, 0)
        print("worker ended", os.waitstatus_to_exitcode(status), round(time.monotonic() - start) < 10)
    """)
    assert "worker ended 0 True" in proc.stdout, proc
