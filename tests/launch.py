"""Helpers to run a script under a real launcher from pytest, and to collect per-check results from it."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HOROVODRUN = str(BIN / "horovodrun")


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "examples"), e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONUNBUFFERED"] = "1"
    # A check that fails on one rank leaves its peers in the check's collectives: end such a job in two
    # minutes, with Horovod naming the missing tensors, instead of at the test's timeout.
    e.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120")
    e.update(extra)
    return e


@functools.cache
def horovod_mpi_built() -> bool | None:
    """Horovod's own answer to mpi_built() (what `horovodrun --check-build` lists as MPI), asked once per
    session in a fresh process; None when it cannot answer (no Horovod, or it fails to load)."""
    proc = subprocess.run([sys.executable, "-c", "import horovod.torch as hvd; print(bool(hvd.mpi_built()))"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    answer = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    return {"True": True, "False": False}.get(answer[0]) if answer else None


NO_MPI = ("this Horovod was built without MPI (horovod.torch.mpi_built() is False; `horovodrun --check-build` "
          "lists no MPI), so its {} launch cannot run; `make setup` builds the Horovod with MPI")


def skip_without_mpi(launcher: str) -> None:
    """Skip the calling test when `launcher` needs MPI ('mpi': horovodrun --mpi, 'mpirun') and this Horovod
    says it has none, as the CUDA build of `make setup-cuda` does. An unknown answer skips nothing: the
    launch then fails and says why."""
    if launcher in ("mpi", "mpirun") and horovod_mpi_built() is False:
        import pytest
        pytest.skip(NO_MPI.format("horovodrun --mpi" if launcher == "mpi" else "mpirun"))


def launcher_cmd(launcher: str, np: int = 2) -> list[str]:
    """The command prefix for `launcher`: 'mpi' / 'gloo' (horovodrun), 'mpirun', or 'python'. Skips the
    calling test when `launcher` needs an MPI that this Horovod was built without."""
    skip_without_mpi(launcher)
    if launcher == "python":
        return [sys.executable]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np), "-x", "PYTHONPATH",
                "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", sys.executable]
    cmd = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}"]
    return cmd + (["--gloo"] if launcher == "gloo" else ["--mpi"]) + [sys.executable]


def run(launcher: str, script: str | Path, *args: str, np: int = 2, timeout: float = 600,
        extra_env: dict | None = None, cwd: str | Path = ROOT) -> subprocess.CompletedProcess:
    cmd = launcher_cmd(launcher, np) + [str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env(**(extra_env or {})))


def result_line(output: str, prefix: str = "result: ") -> dict:
    """The JSON after the last `prefix` in the output (launchers may tag or glue lines together)."""
    at = output.rfind(prefix)
    assert at >= 0, f"no '{prefix}' in output:\n{output[-3000:]}"
    return json.JSONDecoder().raw_decode(output[at + len(prefix):])[0]


TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")


def rank_lines(output: str) -> list[tuple[int, str]]:
    """(rank, line) for each whole line a rank wrote, from a launcher's tagged output. mpirun's --tag-output tags
    each fragment as it arrives, so a rank's partial line (pytest's progress, a progress bar) is followed by
    another rank's fragment on the same line and the rest of it on a later one: fragments are joined per rank
    and stream until a newline."""
    pending: dict[tuple[int, str], str] = {}
    lines: list[tuple[int, str]] = []
    for raw in output.splitlines(keepends=True):
        tags = list(TAG.finditer(raw))
        for i, tag in enumerate(tags):
            key = (int(tag.group(1)), tag.group(2))
            text = raw[tag.end():tags[i + 1].start() if i + 1 < len(tags) else len(raw)]
            pending[key] = pending.get(key, "") + text
            if text.endswith("\n"):
                lines.append((key[0], pending.pop(key).rstrip("\n")))
    lines += [(key[0], text) for key, text in pending.items() if text]
    return lines


def run_checks(launcher: str, worker: Path, tmp: Path, np: int = 2, timeout: float = 900,
               extra_env: dict | None = None) -> dict:
    """Launch `worker` once; it runs all its checks and writes {check: {rank: 'ok' | error}} to a JSON file."""
    out = tmp / f"checks-{launcher}.json"
    proc = run(launcher, worker, str(out), str(tmp), np=np, timeout=timeout, extra_env=extra_env)
    if not out.exists():
        raise AssertionError(f"{worker.name} under {launcher} wrote no results (exit {proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())
