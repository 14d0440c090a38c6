"""Keras backends: hvdp.tensorflow (custom TensorFlow loops) refuses a non-TensorFlow Keras backend at init, on
every rank, at any np; hvdp.keras accepts TensorFlow and PyTorch (tests/tensorflow/test_keras_torch.py) and
refuses any other backend (JAX, NumPy) naming the ones that work."""

from pathlib import Path

import pytest

from tests.launch import result_line, run

WORKER = Path(__file__).with_name("worker_backend.py")


@pytest.mark.parametrize("launcher,np", [("python", 1), ("gloo", 2)])
def test_tensorflow_init_refuses_a_non_tensorflow_keras_backend(launcher, np):
    proc = run(launcher, WORKER, np=np, timeout=300, extra_env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = result_line(proc.stdout)
    assert result["size"] == np and sorted(r["rank"] for r in result["ranks"]) == list(range(np))
    for r in result["ranks"]:
        message = r["tensorflow"]
        for part in (f"[rank {r['rank']}]", "'torch' backend", "KERAS_BACKEND=tensorflow", "hvdp.keras", "hvdp.torch"):
            assert part in message, r


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_keras_refuses_other_backends_naming_those_that_work(monkeypatch, backend):
    import hvdp.keras as hk
    from hvdp import _keras_backend
    from hvdp.core.errors import ConfigError

    monkeypatch.setattr(_keras_backend, "name", lambda: backend)
    with pytest.raises(ConfigError) as e:
        hk.init()
    for part in (f"{backend!r} backend", "'tensorflow'", "'torch'", "KERAS_BACKEND=torch"):
        assert part in str(e.value), str(e.value)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_accepts_tensorflow_and_torch(monkeypatch, backend):
    from hvdp import _keras_backend

    monkeypatch.setattr(_keras_backend, "name", lambda: backend)
    _keras_backend.check()  # no error
    assert _keras_backend.horovod().__name__ == f"horovod.{backend}"
