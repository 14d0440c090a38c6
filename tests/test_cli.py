"""The `hvdp` command as a user runs it: doctor and verify."""

import re
import subprocess
import sys

import pytest

from tests.launch import BIN, ROOT, env, result_line

HVDP = str(BIN / "hvdp")


def hvdp(*args, timeout=300, launcher_prefix=()):
    return subprocess.run([*launcher_prefix, HVDP, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env(), timeout=timeout)


def test_doctor_explains_the_stack():
    proc = hvdp("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for expected in ("torch", "keras", "horovod", "[X] PyTorch", "[X] TensorFlow", "[X] MPI", "[X] Gloo",
                     "Launcher: python (single process)", "Verdict: OK", "horovodrun -np 8 -H host1:4,host2:4",
                     # make setup's Horovod carries hvdp's allreduce; a stock one would say "not in this Horovod"
                     "hvdp's shared-memory allreduce (one host, MPI): built in; HVDP_SHM_ALLREDUCE=1",
                     "bfloat16 tensors (torch): supported"):
        assert expected in out, f"{expected!r} missing from:\n{out}"


def test_doctor_sees_the_launcher():
    proc = hvdp("doctor", "--no-build-check",
                launcher_prefix=(str(BIN / "horovodrun"), "-np", "1", "-H", "localhost:1", "--gloo"))
    assert "Launcher: horovodrun (gloo); rank 0 of 1" in proc.stdout, proc.stdout + proc.stderr
    assert "HOROVOD_RANK=0" in proc.stdout


def _verdict(proc):
    return result_line(proc.stdout + proc.stderr, "verify: ")


@pytest.mark.parametrize("args", [
    ["--np", "2"],
    ["--np", "2", "--gloo", "--optimizer", "adam", "--accumulate", "2"],
    ["--np", "2", "--model", "tests.fixtures.models:small_cnn", "--input-shape", "1,8,8"],
])
def test_verify_passes(args):
    proc = hvdp("verify", "--framework", "torch", *args)
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"], verdict
    assert verdict["size"] == 2 and verdict["max_abs_diff"] <= 1e-5 and verdict["replicas_identical"]
    # by default the run ends with a short step the 2 ranks split unevenly (15 samples), compared too
    assert verdict["leftover"] == 15 and verdict["steps"] == 6, verdict


def test_verify_alone_with_a_short_last_accumulation():
    # One rank, 3 batches per step, and the epoch's last step a single batch of 5 samples: that step's
    # gradient must be its 5 samples' mean, not a third of it (as it was before).
    proc = hvdp("verify", "--framework", "torch", "--np", "1", "--optimizer", "adam", "--accumulate", "3",
                "--leftover", "5")
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"], verdict
    assert verdict["size"] == 1 and verdict["steps"] == 6 and verdict["max_abs_diff"] <= 1e-5, verdict


def test_verify_a_compiled_model_under_autocast():
    # The ranks train hvdp.torch.compile(model) (graph split into pieces, each compiled by inductor) under
    # bf16 autocast; the one process runs eager under the same autocast. The default tolerance is bf16's.
    proc = hvdp("verify", "--framework", "torch", "--np", "2", "--compile", "inductor", "--amp", "bf16")
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"] and verdict["replicas_identical"], verdict
    assert verdict["compile"] == "inductor" and verdict["amp"] == "bf16" and verdict["tolerance"] == 1e-3, verdict
    assert 0 < verdict["max_abs_diff"] <= 1e-3, verdict  # 0 would mean both sides ran in fp32
    assert "compiled (inductor), autocast bf16" in proc.stdout


def test_verify_catches_a_non_equivalent_model():
    # Per-rank BatchNorm statistics differ from the big batch's: verify must say so and exit non-zero, and name
    # the weight that differs most and the cause (the model's BatchNorm layer "1", and sync_batchnorm was off).
    proc = hvdp("verify", "--framework", "torch", "--np", "2", "--model", "tests.fixtures.models:with_batchnorm")
    verdict = _verdict(proc)
    assert proc.returncode != 0 and not verdict["ok"] and verdict["max_abs_diff"] > 1e-4, verdict
    assert "FAIL" in proc.stdout
    assert verdict["plain_batchnorm"] == ["1"] and verdict["data_identical"] and not verdict["data_problem"], verdict
    assert f"differs most: {verdict['worst']} (max |dw| = {verdict['max_abs_diff']:.3g})" in proc.stdout
    assert len(verdict["causes"]) == 1 and verdict["causes"][0].startswith("BatchNorm without SyncBatchNorm"), verdict
    assert "likely cause: BatchNorm without SyncBatchNorm: layer 1 normalises each rank's batch" in proc.stdout


@pytest.mark.parametrize("args,size", [(["--np", "2"], 2), (["--np", "3", "--gloo"], 3)], ids=["mpi-np2", "gloo-np3"])
def test_verify_sharded_passes(args, size):
    # One launch per world: SGD with momentum, Adam and AdamW, each through prepare(..., shard_optimizer_state=True)
    # and through the allreduce path, two param groups (lr and weight decay differ), clipping by the global norm,
    # on 763 parameters (uneven shards at 2 and 3 ranks), with the default short last step.
    proc = hvdp("verify", "--framework", "torch", "--sharded", *args)
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"] and verdict["sharded"], verdict
    assert verdict["size"] == size and verdict["parameters"] == 763 and verdict["tolerance"] == 1e-5, verdict
    assert [c["optimizer"] for c in verdict["cases"]] == ["sgd", "adam", "adamw"], verdict
    for case in verdict["cases"]:
        assert case["ok"] and case["groups"] == 2 and case["clip"] == 0.42 and case["leftover"] == 8 * size - 1
        # some steps clipped and some not: a norm per shard or gradients not averaged would change which
        assert 0 < case["clipped_steps"] < case["steps"] == 6, case
        assert case["replicas_identical"] and case["allreduce_replicas_identical"], case
        for key in ("max_abs_diff", "allreduce_max_abs_diff", "vs_allreduce_max_abs_diff"):
            assert case[key] <= 1e-5, (key, case)
    printed = [float(d) for d in re.findall(r"max \|dw\| = (\S+) sharded", proc.stdout)]
    assert len(printed) == 3 and max(printed) <= 1e-5 and proc.stdout.count("-> PASS") == 3, proc.stdout


# Not parametrized by the framework's bare name: tests/conftest.py would skip it where TensorFlow is missing,
# and the refusal must hold there too (it imports no framework).
@pytest.mark.parametrize("framework", ["--framework=tensorflow", "--framework=keras"])
def test_verify_refuses_sharded_for_tensorflow(framework, capsys):
    from hvdp.tools import cli
    assert cli.main(["verify", framework, "--sharded"]) == 2
    err = capsys.readouterr().err
    assert "--sharded is for --framework torch only" in err, err
    assert "hvdp.tensorflow and hvdp.keras do not offer it" in err, err


def test_verify_sharded_under_fp16_autocast_passes():
    # fp16 autocast with a GradScaler, unscaled after the reduce-scatter (each rank sees its own shard only): the
    # sharded optimizer makes every rank's inf/NaN check agree (tests/torch/worker_sharded.py proves the skip
    # itself). Under --amp the default optimizer is SGD: Adam's step amplifies autocast's rounding vs one process.
    proc = hvdp("verify", "--framework", "torch", "--sharded", "--amp", "fp16", "--np", "2")
    verdict = _verdict(proc)
    assert proc.returncode == 0 and verdict["ok"] and verdict["sharded"], verdict
    assert verdict["tolerance"] == 1e-4 and [c["optimizer"] for c in verdict["cases"]] == ["sgd"], verdict
    case = verdict["cases"][0]
    assert case["amp"] == "fp16" and case["replicas_identical"] and case["allreduce_replicas_identical"], case
    assert 0 < case["max_abs_diff"] <= 1e-4 and case["vs_allreduce_max_abs_diff"] <= 1e-6, case  # 0: fp32 ran
    assert 0 < case["clipped_steps"] < case["steps"], case
    assert "autocast fp16" in proc.stdout and proc.stdout.count("-> PASS") == 1, proc.stdout


def test_verify_rejects_a_bad_clip(capsys):
    from hvdp.tools import cli
    assert cli.main(["verify", "--clip", "0"]) == 2
    assert "--clip must be > 0, got 0.0" in capsys.readouterr().err
    assert cli.main(["verify", "--framework", "keras", "--clip", "1"]) == 2
    assert "--clip is for --framework torch only" in capsys.readouterr().err


def test_verify_rejects_bad_arguments():
    proc = hvdp("verify", "--steps", "0")
    assert proc.returncode == 2 and "--steps must be >= 1, got 0" in proc.stderr
    proc = hvdp("verify", "--model", "nocolon")
    assert proc.returncode != 0
    proc = hvdp("verify", "--leftover", "-1")
    assert proc.returncode == 2 and "--leftover must be >= 0, got -1" in proc.stderr
    for flag, value in (("--compile", "inductor"), ("--amp", "fp16")):
        proc = hvdp("verify", "--framework", "tensorflow", flag, value)
        assert proc.returncode == 2 and f"{flag} is for --framework torch only" in proc.stderr, proc.stderr
    proc = hvdp("verify", "--amp", "fp8")
    assert proc.returncode == 2 and "invalid choice: 'fp8'" in proc.stderr


def test_cli_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "hvdp.tools.cli", "--help"], capture_output=True, text=True)
    assert "doctor" in proc.stdout and "verify" in proc.stdout
