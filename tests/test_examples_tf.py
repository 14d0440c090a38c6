"""examples/train_keras.py (model.fit) and examples/train_tf.py (custom loop) end to end on the digits data."""

import pytest

from tests.launch import ROOT, result_line, run

SCRIPTS = {"keras": ROOT / "examples" / "train_keras.py", "tensorflow": ROOT / "examples" / "train_tf.py"}
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _result(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return result_line(proc.stdout)


# Each example under one launcher: both adapters run under MPI and Gloo in tests/tensorflow/test_tf.py.
@pytest.mark.parametrize("framework,launcher", [("keras", "mpi"), ("tensorflow", "gloo")])
def test_example_reaches_accuracy(framework, launcher, tmp_path):
    logdir = tmp_path / "tb"
    result = _result(run(launcher, SCRIPTS[framework], "--logdir", str(logdir), timeout=300, extra_env=QUIET))
    assert result["framework"] == framework and result["world_size"] == 2
    assert result["test_accuracy"] >= 0.97, result
    assert result["test_samples"] == 359  # every test sample counted once, whatever the world size
    assert {"epochs", "samples_per_sec", "seconds", "test_loss"} <= result.keys()
    if framework == "keras":
        assert result["keras_backend"] == "tensorflow", result
    # the straggler report's last period (issue 47): from fit's steps, or the custom loop's (its shard() dataset
    # closes each step; its DistributedOptimizer marks the all-reduce and the update)
    times = result["step_times_ms"]
    assert set(times) == {"0", "1"} and all(row["compute"] > 0 and row["optimizer"] > 0 for row in times.values()), \
        times
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(logdir)).Reload().Tags()  # tf.summary's scalars are stored as tensors
    written = set(tags["scalars"]) | set(tags["tensors"])
    assert {f"step_ms/{p}/rank{r}" for p in ("input", "compute", "wait", "optimizer") for r in (0, 1)} <= written, \
        written  # each rank's step times, written by rank 0 (hvdp.straggler_scalars())


def test_keras_example_on_the_torch_backend():
    """--keras-backend torch: the same example on Keras's PyTorch backend (hvdp.keras through horovod.torch),
    the flag winning over a KERAS_BACKEND in the environment; the same accuracy and test set as on TensorFlow."""
    proc = run("gloo", SCRIPTS["keras"], "--keras-backend", "torch", timeout=300,
               extra_env={**QUIET, "KERAS_BACKEND": "tensorflow"})
    result = _result(proc)
    assert result["keras_backend"] == "torch", result
    assert "Keras on torch" in proc.stdout, proc.stdout[-2000:]
    assert result["framework"] == "keras" and result["world_size"] == 2, result
    assert result["test_accuracy"] >= 0.97, result
    assert result["test_samples"] == 359, result  # every test sample counted once, as on TensorFlow
    times = result["step_times_ms"]  # the straggler report's last period (issue 47): both ranks', from fit
    assert set(times) == {"0", "1"} and all(row["compute"] > 0 for row in times.values()), times


def test_adasum_is_refused_with_the_fix():
    proc = run("python", SCRIPTS["tensorflow"], "--adasum", "--epochs", "1", np=1, timeout=120, extra_env=QUIET)
    assert proc.returncode != 0 and "PyTorch adapter only" in proc.stderr


def test_training_from_tfrecords_is_the_in_memory_run_and_resumes_exactly(tmp_path):
    """--files: the samples as TFRecord files, read by position; the same run as from memory, resumed too."""
    files, ckpt = str(tmp_path / "records"), str(tmp_path / "ckpt")
    keras = SCRIPTS["keras"]
    in_memory = _result(run("mpi", keras, "--epochs", "3", timeout=300, extra_env=QUIET))
    _result(run("mpi", keras, "--epochs", "2", "--files", files, "--checkpoint-dir", ckpt, timeout=300,
                extra_env=QUIET))
    assert len(list((tmp_path / "records").glob("train-*.tfrecord"))) == 4
    resumed = run("mpi", keras, "--epochs", "3", "--files", files, "--checkpoint-dir", ckpt, timeout=300,
                  extra_env=QUIET)
    assert "resum" in resumed.stdout + resumed.stderr, resumed.stdout[-2000:]
    assert _result(resumed)["test_loss"] == in_memory["test_loss"], (_result(resumed), in_memory)
    loop = SCRIPTS["tensorflow"]
    tf_memory = _result(run("gloo", loop, "--epochs", "2", timeout=300, extra_env=QUIET))
    tf_files = _result(run("gloo", loop, "--epochs", "2", "--files", files, timeout=300, extra_env=QUIET))
    assert tf_files["test_loss"] == tf_memory["test_loss"], (tf_files, tf_memory)
