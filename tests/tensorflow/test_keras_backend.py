"""hvdp.keras / hvdp.tensorflow under a non-TensorFlow Keras backend fail at init, on every rank, at any np."""

from pathlib import Path

import pytest

from tests.launch import result_line, run

WORKER = Path(__file__).with_name("worker_backend.py")


@pytest.mark.parametrize("launcher,np", [("python", 1), ("gloo", 2)])
def test_init_refuses_a_non_tensorflow_keras_backend(launcher, np):
    proc = run(launcher, WORKER, np=np, timeout=300, extra_env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = result_line(proc.stdout)
    assert result["size"] == np and sorted(r["rank"] for r in result["ranks"]) == list(range(np))
    for r in result["ranks"]:
        for name in ("keras", "tensorflow"):
            message = r[name]
            for part in (f"[rank {r['rank']}]", "'torch' backend", "KERAS_BACKEND=tensorflow", "hvdp.torch"):
                assert part in message, (name, r)
