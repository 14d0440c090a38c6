"""Suite-wide: where TensorFlow is not installed (.venv-cuda, `make setup-cuda`: PyTorch only), the tests that
need it skip and say so, instead of failing in their workers. Decided at collection, without importing it.

The other half of running under that build, MPI launches of a Horovod built without MPI, is decided where
the launch is made: tests/launch.py:skip_without_mpi."""

from __future__ import annotations

import importlib.util

import pytest

# Files whose every test launches TensorFlow or Keras, and the parametrization values that select it (a
# framework, or hvdp's adapter module for it).
TF_ONLY = ("tests/tensorflow/", "tests/test_examples_tf.py", "tests/test_verify_tf.py")
TF_PARAMS = {"tf", "tensorflow", "keras", "hvdp.tensorflow", "hvdp.keras"}
NO_TF = ("TensorFlow is not installed in this environment (a PyTorch-only one, such as make setup-cuda's "
         ".venv-cuda); `make setup` installs it")


def _needs_tensorflow(item: pytest.Item) -> bool:
    path = item.path.relative_to(item.config.rootpath).as_posix()
    callspec = getattr(item, "callspec", None)
    values = {v for v in callspec.params.values() if isinstance(v, str)} if callspec else set()
    return path.startswith(TF_ONLY) or bool(values & TF_PARAMS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("tensorflow") is not None:
        return
    for item in items:
        if _needs_tensorflow(item):
            item.add_marker(pytest.mark.skip(reason=NO_TF))
