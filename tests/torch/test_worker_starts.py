"""Hundreds of DataLoader worker start-ups in ranks whose threads run (worker_starts.py), under a time limit.

Before issue 36's fix shard() forked its workers every epoch from a rank running Horovod's, MPI's and the
watchdog's threads; at np=2 under MPI that hung at epoch 245 of 400 (about 1,600 forks per rank): one worker
stuck in CPython's fork handler (PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept, waiting for a lock
another thread held at the fork), its rank waiting for a batch, the other in the epoch's allgather, and no
watchdog message. Now the workers start by forkserver, and map-style loaders keep theirs for the run.

`make soak` runs it with HVDP_SOAK_EPOCHS=400 per launch (about 3 minutes each at np=2); the default here is
30 epochs per launch (about 130 start-ups per rank).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import ROOT, env, launcher_cmd, result_line

WORKER = Path(__file__).with_name("worker_starts.py")
ANYHOW = Path(__file__).with_name("worker_anyhow.py")
EPOCHS = int(os.environ.get("HVDP_SOAK_EPOCHS", "30"))


def expected_starts(epochs: int) -> int:
    """Worker start-ups per rank: 2 for the kept loader, 2 per epoch for the per-epoch loader and the stream,
    2 for each loader built anew every 4th epoch (kept for its one epoch)."""
    return 2 + 2 * epochs + 2 * epochs + 2 * (epochs // 4)


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_many_worker_start_ups_never_hang_and_read_every_sample_once(launcher, tmp_path):
    limit = 90 + 3 * EPOCHS  # ~1 s per epoch measured at np=2 on 2 shared cores; a hang waits forever
    out = tmp_path / "starts.json"
    cmd = launcher_cmd(launcher) + [str(WORKER), str(out), str(tmp_path), str(EPOCHS)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(WORKER)])  # Gloo's ranks run in sessions of their own
        output, _ = proc.communicate()
        pytest.fail(f"hung: still running after {limit} s ({time.monotonic() - start:.0f} s), "
                    f"{[len(p.read_text().splitlines()) for p in sorted(tmp_path.glob('starts-*'))]} worker "
                    f"start-ups per rank so far:\n{output[-3000:]}")
    stalled = "Horovod has been shut down" in output or "Missing ranks:" in output
    assert proc.returncode == 0 and out.exists(), (("hung: Horovod's stall shutdown ended it. " if stalled else "")
                                                   + output[-3000:])
    result = json.loads(out.read_text())
    assert result["wrong"] == 0, result["errors"]
    assert result["starts"] == [expected_starts(EPOCHS)] * 2, result
    assert "forks this rank's process" not in output, output[-3000:]  # hvdp itself never forks a threaded rank


# --- issue 46: every way people run Python -------------------------------------------------------------------
# worker_anyhow.py has no main guard and sends the workers only importable objects (TensorDataset). On the old
# code the file was refused (init() at the unguarded top level) and `python -` failed with "DataLoader worker
# (pid(s) ...) exited unexpectedly" (the workers imported "<stdin>"); `python -c` and the notebook worked.
REFERENCE = [0.954257071018219, 1.7847117185592651, -0.8875531554222107]  # one process, any way it is run


def _notebook(cells: list[str]) -> list[tuple[str, str | None]]:
    """Each cell's (stdout, error) in a fresh ipykernel, executed through jupyter_client as a notebook does."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=120, cwd=str(ROOT), env=env())
    try:
        results = []
        for code in cells:
            msg_id, out, error = client.execute(code), [], None
            while True:
                msg = client.get_iopub_msg(timeout=180)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream" and content["name"] == "stdout":
                    out.append(content["text"])
                elif kind == "error":
                    error = f"{content['ename']}: {content['evalue']}"
                elif kind == "status" and content["execution_state"] == "idle":
                    break
            results.append(("".join(out), error))
        return results
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("how", ["stdin", "-c", "notebook"])
def test_workers_start_from_stdin_c_and_a_notebook(how):
    code = ANYHOW.read_text()
    local = code.replace('os.environ.get("HVDP_TEST_LOCAL_DATASET") == "1"', "True")
    if how == "notebook":
        (out, error), (_, refused) = _notebook([code, local])
    else:
        argv = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", code]
        proc = subprocess.run(argv, input=code if how == "stdin" else None, capture_output=True, text=True,
                              cwd=ROOT, env=env(), timeout=180)
        out, error = proc.stdout, (proc.stderr[-3000:] if proc.returncode else None)
        argv = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", local]
        proc = subprocess.run(argv, input=local if how == "stdin" else None, capture_output=True, text=True,
                              cwd=ROOT, env=env(), timeout=180)
        refused = proc.stderr if proc.returncode else None
    assert error is None, error
    result = result_line(out)
    assert result["workers"] == 2 and result["weights"] == pytest.approx(REFERENCE, abs=1e-6), result
    # a dataset class defined in the session: refused before the first batch, naming it and the fix
    assert refused and "ConfigError" in refused and "dataset Pairs cannot be sent" in refused, refused
    assert "defined in an interactive session" in refused and "move Pairs into a module file" in refused, refused


def test_workers_start_from_a_script_without_a_main_guard_under_horovodrun(tmp_path):
    proc = subprocess.run(launcher_cmd("gloo") + [str(ANYHOW)], capture_output=True, text=True, cwd=tmp_path,
                          env=env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line.split("result: ", 1)[1]) for line in proc.stdout.splitlines() if "result: " in line]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["workers"] == 2 for r in results), results
    assert results[0]["weights"] == results[1]["weights"], results
    # a dataset class defined in the unguarded script: the workers would import it and run init() again
    proc = subprocess.run([sys.executable, str(ANYHOW)], capture_output=True, text=True, cwd=tmp_path,
                          env=env(HVDP_TEST_LOCAL_DATASET="1"), timeout=180)
    assert proc.returncode != 0 and "Pairs is defined in your script" in proc.stderr, proc.stderr[-3000:]
    assert f"{ANYHOW}:" in proc.stderr and "move Pairs into a module of its own" in proc.stderr, proc.stderr[-3000:]
