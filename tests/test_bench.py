"""`hvdp bench --quick` runs end to end and writes the JSON other tools read and a PNG. No speed thresholds:
the machines are shared and noisy; numbers are for docs/benchmarks.md, not for pass/fail."""

import ast
import json
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.launch import BIN, ROOT, env, result_line, run


def test_bench_quick_writes_json_and_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run([str(BIN / "hvdp"), "bench", "--quick", "--steps", "2", "--rounds", "2", "--models", "cnn",
                           "--frameworks", "torch,tensorflow",
                           "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, cwd=ROOT, env=env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    training = report["training"]
    assert training["np"] == 2
    assert set(training["samples_per_sec"]) >= {"hvdp", "ddp", "horovod"}
    assert all(v > 0 for v in training["samples_per_sec"].values())
    assert 0 < training["scaling_efficiency"] < 2
    cnn = training["models"]["cnn"]
    assert cnn["independent_samples_per_sec_per_rank"] > 0
    assert cnn["fraction_of_independent"]["hvdp"] == (cnn["samples_per_sec_per_rank"]["hvdp"]
                                                      / cnn["independent_samples_per_sec_per_rank"])
    assert report["steps_per_repetition"] == 2
    # every job took 2 turns (the fewest a median and an interval are made of: hvdp.tools.rotation's tests take
    # the statistics at other sizes); each ratio is the median of the rounds' ratios, with its interval around it
    assert report["rounds"] == 2 and all(len(v) == 2 for v in cnn["rounds_per_rank"].values())
    per_round = cnn["ratios_per_round"]["hvdp_vs_ddp"]
    assert per_round == [a / b for a, b in zip(cnn["rounds_per_rank"]["hvdp"], cnn["rounds_per_rank"]["ddp"])]
    assert training["hvdp_vs_ddp"] == statistics.median(per_round)
    low, high = cnn["ratio_intervals"]["hvdp_vs_ddp"]
    assert (low, high) == (min(per_round), max(per_round)) and cnn["interval_coverage"] == 0.5  # n=2: 1 - 2/4
    assert cnn["samples_per_sec_per_rank"]["hvdp"] == statistics.median(cnn["rounds_per_rank"]["hvdp"])

    keras = report["training_tensorflow"]  # hvdp-keras and hvdp-tf against raw horovod.tensorflow
    assert keras["framework"] == "tensorflow" and keras["np"] == 2
    rates = keras["models"]["cnn"]["samples_per_sec_per_rank"]
    assert set(rates) == {"hvdp-keras", "hvdp-tf", "horovod-tf", "horovod-tf-tuned"}
    assert all(v > 0 for v in rates.values())
    keras_rounds = keras["models"]["cnn"]["rounds_per_rank"]
    assert keras["hvdp_keras_vs_horovod_tf_tuned"] == statistics.median(
        a / b for a, b in zip(keras_rounds["hvdp-keras"], keras_rounds["horovod-tf-tuned"]))
    assert 0 < keras["scaling_efficiency"] < 2
    allreduce = report["allreduce"]
    assert allreduce["memcpy_GBps"] > 0
    impls = {r["impl"] for r in allreduce["results"]}
    assert impls == {"hvdp-mpi", "horovod-mpi", "hvdp-gloo", "torch-gloo", "mpi4py"}
    assert {r["bytes"] for r in allreduce["results"]} >= {4096, 64 << 20}
    assert all(r["busbw_GBps"] > 0 for r in allreduce["results"])
    largest = {r["impl"]: r["busbw_GBps"] for r in allreduce["results"] if r["bytes"] == 64 << 20}
    assert allreduce["largest_bytes"] == 64 << 20
    assert allreduce["fraction_of_memcpy"] == {k: v / allreduce["memcpy_GBps"] for k, v in largest.items()}
    assert allreduce["memcpy_concurrent_GBps"] > 0  # one rank's share while both copy: the np=2 ceiling
    assert allreduce["fraction_of_concurrent_memcpy"] == {k: v / allreduce["memcpy_concurrent_GBps"]
                                                          for k, v in largest.items()}
    assert all(r["busbw_GBps_rounds"] == [r["busbw_GBps"]] for r in allreduce["results"])  # one round
    small = {4096, 16384, 65536, 262144}  # each one's latency, and over mpi4py's
    assert {impl: set(by) for impl, by in allreduce["latency_us"].items()} == {i: {str(n) for n in small} for i in impls}
    assert all(allreduce["latency_vs_mpi4py"][i][str(n)] == allreduce["latency_us"][i][str(n)] /
               allreduce["latency_us"]["mpi4py"][str(n)] for i in impls for n in small)
    assert "latency of one small all-reduce" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "allreduce busbw" in proc.stdout and "concurrent memcpy at 64M" in proc.stdout
    assert "hvdp_vs_ddp" in proc.stdout
    assert "tensorflow training throughput" in proc.stdout
    gpt = report["training_gpt"]  # the transformer: with --quick its bf16-autocast eager variant only
    assert gpt["framework"] == "torch" and set(gpt["models"]) == {"gpt-bf16"} and gpt["optimizer"] == "adamw"
    rates = gpt["models"]["gpt-bf16"]["samples_per_sec_per_rank"]
    sharded_impls = {"hvdp", "ddp", "hvdp-sharded", "ddp-zero"}  # issue 34: in the same rotation, 2 turns each
    assert set(rates) == sharded_impls | {"horovod"} and all(v > 0 for v in rates.values())
    assert all(len(gpt["models"]["gpt-bf16"]["rounds_per_rank"][i]) == 2 for i in sharded_impls)
    memory = gpt["models"]["gpt-bf16"]["memory"]  # rank 0's, measured: the tensors that exist after a step
    assert set(memory) == sharded_impls | {"horovod", "alone", "independent"}
    assert all(set(m) >= {"optimizer_state_bytes", "gradient_bytes", "peak_rss_rise_bytes", "anon_rise_bytes"}
               and m["peak_rss_rise_bytes"] > 0 for m in memory.values()), memory
    from benchmarks import models  # torch: imported here, not when the file is collected
    adamw = 2 * 4 * models.parameters("gpt")  # exp_avg and exp_avg_sq in fp32, one step scalar per tensor
    assert adamw <= memory["hvdp"]["optimizer_state_bytes"] < adamw + 4096, memory["hvdp"]
    assert memory["ddp"]["optimizer_state_bytes"] == memory["hvdp"]["optimizer_state_bytes"]
    assert memory["hvdp"]["gradient_bytes"] == memory["ddp"]["gradient_bytes"] == 4 * models.parameters("gpt")
    sharded = gpt["models"]["gpt-bf16"]["sharded"]  # deterministic: the shard holds 1/N of the elements' state
    assert sharded["state_bytes_bound"] == 1 / 2 + 0.05 and sharded["state_bytes_met"] is True, sharded
    assert sharded["state_bytes_ratio"]["hvdp-sharded/hvdp"] == (memory["hvdp-sharded"]["optimizer_state_bytes"]
                                                                 / memory["hvdp"]["optimizer_state_bytes"])
    # 1/2 of the elements' moments (rank 0 holds one more per odd bucket), one step count per bucket, not per tensor
    assert abs(sharded["state_bytes_ratio"]["hvdp-sharded/hvdp"] - 0.5) < 0.001, sharded
    assert abs(sharded["gradient_bytes_ratio"]["hvdp-sharded/hvdp"] - 0.5) < 0.001, sharded  # ZeRO-2
    assert sharded["gradient_bytes_ratio"]["ddp-zero/ddp"] == 1.0  # ZeRO-1: DDP keeps every gradient
    assert 0 < sharded["state_bytes_ratio"]["ddp-zero/ddp"] < 1, sharded
    assert set(sharded["throughput"]) == {"hvdp_sharded_vs_hvdp", "hvdp_sharded_vs_ddp_zero"}
    assert all(r["met"] == (r["ratio"] >= r["least"]) for r in sharded["throughput"].values()), sharded
    assert "optimizer state hvdp-sharded/hvdp = 0.50" in proc.stdout and "hvdp_sharded_vs_ddp_zero = " in proc.stdout
    gpt_rounds = gpt["models"]["gpt-bf16"]["rounds_per_rank"]
    assert gpt["models"]["gpt-bf16"]["ratios"]["hvdp_vs_ddp"] == statistics.median(
        a / b for a, b in zip(gpt_rounds["hvdp"], gpt_rounds["ddp"]))
    cpu = gpt["models"]["gpt-bf16"]["cpu_by_thread"]  # per kind of thread, rank 0's cores busy in its turns
    assert set(cpu) == sharded_impls | {"horovod", "alone", "independent"} and cpu["hvdp"]["main"] > 0.1, cpu
    assert cpu["hvdp"].get("engine", 0) > 0 and "engine" not in cpu["ddp"] and "engine" not in cpu["alone"], cpu
    assert "torch GPT-style transformer (adamw) training throughput" in proc.stdout
    for framework in ("torch", "tensorflow"):  # hvdp's sharded input pipeline against a hand-written one
        pipeline = report["pipeline"][framework]
        assert pipeline["samples"] == 2000 and set(pipeline["by_np"]) == {"1", "2"}
        for m in pipeline["by_np"].values():
            rates = m["samples_per_sec_per_rank"]
            impls = {"hvdp", "hand", "hvdp-fork"} if framework == "torch" else {"hvdp", "hand"}  # fork: as before #36
            assert set(rates) == impls and all(v > 0 for v in rates.values())
            assert set(m["hangs"]) <= impls - {"hvdp"}  # only the loaders that fork every epoch may deadlock
            assert m["hvdp_vs_hand_per_rep"] == [rates["hvdp"] / rates["hand"]] == [m["hvdp_vs_hand"]]
            if framework == "torch":  # each epoch's start-up (its first batch), and the warm-up epoch's
                assert set(m["startup_s"]) == set(m["first_startup_s"]) == impls
                assert all(0 < v < 120 for v in [*m["startup_s"].values(), *m["first_startup_s"].values()]), m
    assert "input pipeline" in proc.stdout


def test_bench_keras_backend_torch_puts_hvdp_keras_on_torch_beside_hvdp_torch(tmp_path):
    """--keras-backend torch (issue 35): in the tensorflow framework's place, hvdp.keras's fit on Keras's torch
    backend against hvdp's PyTorch adapter on the same model, with a Keras-on-torch process alone and two side
    by side, all in one rotation."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([str(BIN / "hvdp"), "bench", "--quick", "--steps", "2", "--rounds", "2", "--models", "cnn",
                           "--frameworks", "tensorflow", "--keras-backend", "torch", "--skip-gpt", "--skip-pipeline",
                           "--skip-allreduce", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "training" not in report and "training_tensorflow" not in report  # replaced, not beside
    section = report["training_keras_torch"]
    assert section["framework"] == "keras-torch" and section["np"] == 2
    cnn = section["models"]["cnn"]
    rates, rounds = cnn["samples_per_sec_per_rank"], cnn["rounds_per_rank"]
    assert set(rates) == {"hvdp-keras-torch", "hvdp-torch"} and all(v > 0 for v in rates.values())
    assert set(rounds) == {"hvdp-keras-torch", "hvdp-torch", "alone", "independent"}  # one rotation, 2 turns each
    assert all(len(v) == 2 for v in rounds.values())
    assert section["hvdp_keras_torch_vs_hvdp_torch"] == statistics.median(
        a / b for a, b in zip(rounds["hvdp-keras-torch"], rounds["hvdp-torch"]))
    # every repetition of every Keras job named Keras's torch backend; the torch job is train_worker.py (its
    # records carry the CPU by thread, the Keras worker's do not)
    assert cnn["keras_backend"] == {"hvdp-keras-torch": "torch", "alone": "torch", "independent": "torch"}
    assert set(cnn["cpu_by_thread"]) == {"hvdp-torch"}
    assert "keras-torch (hvdp.keras fit on Keras's torch backend" in proc.stdout
    assert "hvdp_keras_torch_vs_hvdp_torch" in proc.stdout


def test_a_deadlocked_fork_in_the_pipeline_bench_is_read_again_not_waited_on(tmp_path):
    """The bench's fork-every-epoch loaders (`hand`, `hvdp-fork`) can deadlock in a threaded rank (issue 36); it
    hung `make test` for 15 minutes once. Rank 1's `hand` workers made to wait forever in epoch 1, as a
    deadlocked fork does: that rank is unblocked after HVDP_BENCH_FORK_WAIT, both ranks read the epoch again,
    and the report counts it. Without the loader's timeout this run waits until the test's own."""
    proc = run("mpi", ROOT / "benchmarks" / "pipeline_worker.py", "--framework", "torch", "--dir", str(tmp_path),
               "--samples", "512", "--reps", "2", timeout=300,
               extra_env={"HVDP_BENCH_STALL": "hand:1:1", "HVDP_BENCH_FORK_WAIT": "5"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = result_line(proc.stdout, "bench: ")
    # the stall made; a fork-every-epoch loader may also deadlock by itself (or, under load, miss the 5 s)
    assert report["hangs"].get("hand", 0) >= 1 and set(report["hangs"]) <= {"hand", "hvdp-fork"}, report["hangs"]
    assert all(len(reps) == 2 and all(r > 0 for r in reps) for reps in report["samples_per_sec_per_rank"].values())
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"workers left running: {left}"  # the stalled ones were killed, not orphaned


def test_the_step_accounting_cost_script_times_every_part():
    """benchmarks/step_accounting.py (docs/benchmarks.md's per-step cost of the straggler accounting): each
    figure measured, the TensorFlow loop's marks and hooks timed against the same step without them, and the
    torch hooks' steps really closed (a hook that did nothing would cost ~0)."""
    proc = subprocess.run([str(BIN / "python"), str(ROOT / "benchmarks" / "step_accounting.py"), "--steps", "50"],
                          capture_output=True, text=True, cwd=ROOT, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["torch_hooks_us"] > 0.5, figures
    loop = figures["tensorflow_loop"]
    assert set(loop) == {"step_us", "marks_us", "marks_and_hooks_us"} and loop["step_us"] > 0, loop
    assert figures["steps_closed"] == {"torch": 50 * 20 * 5, "tensorflow": 50 * 5}, figures


@pytest.mark.parametrize("args, message", [
    (["--np", "1"], "--np must be >= 2, got 1"),
    (["--frameworks", "torch,jax"], "--frameworks takes torch, tensorflow, got 'torch,jax'"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--frameworks", "torch", "--keras-backend", "torch"], "add tensorflow to --frameworks (got 'torch')"),
    (["--skip-training", "--skip-allreduce", "--skip-pipeline"], "leave nothing to measure"),
])
def test_bench_rejects_bad_arguments(args, message):
    proc = subprocess.run([str(BIN / "hvdp"), "bench", *args], capture_output=True, text=True, cwd=ROOT, env=env(),
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_memory_counts_each_storage_once_and_the_peak_from_the_start():
    """benchmarks/memory.py, in-process: AdamW's state and the gradients of a model whose output layer shares
    the embedding (one parameter reached twice: from the model and from the optimizer), each storage counted
    once; the peak RSS rise is this run's, not an earlier peak of the process (VmHWM reset at the start)."""
    import torch

    from benchmarks import memory

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False))
    model[1].weight = model[0].weight  # tied, as the GPT's head
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert memory.held(model, optimizer) == {"optimizer_state_bytes": 0, "gradient_bytes": 0}
    model(torch.randint(0, 1000, (8,))).sum().backward()
    optimizer.step()
    numel = 1000 * 64
    assert memory.held(model, optimizer) == {"optimizer_state_bytes": 2 * 4 * numel + 4,  # 2 moments, the step
                                             "gradient_bytes": 4 * numel}
    # sizes above glibc's largest mmap threshold (32 MiB): fresh pages, whatever this process freed before
    earlier = torch.ones(128 << 20, dtype=torch.uint8)  # an earlier 128 MiB peak, freed before the run starts
    del earlier
    rise = memory.Rise(torch.device("cpu"))
    held = torch.ones(48 << 20, dtype=torch.uint8)  # 48 MiB, touched
    report = rise.report()
    assert report["peak_reset"] and 48 << 20 <= report["peak_rss_rise_bytes"] < 80 << 20, report
    assert 48 << 20 <= report["anon_rise_bytes"] < 80 << 20, report
    del held


def test_a_memory_cap_probe_past_its_limit_leaves_no_process_behind(tmp_path):
    """`hvdp bench --memory-cap`'s probes are whole jobs: one that runs past its limit is ended with every
    process below it. A rank left running by a killed launcher spun at 70% of a core for 1.5 hours here (the
    sharded 20-block probe at 1,300 MiB), slowing everything run after it."""
    import os
    import sys

    from hvdp.tools import bench_sharded, rotation

    pids = tmp_path / "pids"
    job = ("import os, subprocess, sys, time\n"  # a launcher with a rank below it, both waiting forever
           "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
           f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{rank.pid}} ')\n"
           "time.sleep(300)\n")
    result = bench_sharded.memory_cap(100, 2, lambda args: [sys.executable, "-c", job], dict(os.environ),
                                      max_layers=1, timeout=3)
    started = [int(p) for p in pids.read_text().split()]
    # checked at once: memory_cap returns only when the killed processes have ended (a rank still running for a
    # moment after its SIGKILL failed this test 1 time in CI)
    assert len(started) >= 2 and not [p for p in started if rotation.running(p)], started
    assert all(r["rc"] == "timeout" and not r["fits"] for runs in result["runs"].values() for r in runs), result


def test_every_torch_implementation_runs_a_worker_impl_with_its_part_switched():
    # The full bench's hvdp-timeline row started the worker with --impl hvdp-timeline, which it refuses: the
    # whole non-quick run died at its first rotation (issue 52's timeline cost was never measured).
    from hvdp.tools import bench
    source = (ROOT / "benchmarks" / "train_worker.py").read_text()
    accepted = set(ast.literal_eval(source.split('p.add_argument("--impl", choices=', 1)[1].split("]", 1)[0] + "]"))
    names = [*bench.FRAMEWORKS["torch"]["impls"], *bench.EXTRA_TORCH, "horovod-autotune"]
    assert {name: bench._impl_run(name)[0] in accepted for name in names} == {name: True for name in names}
    assert bench._impl_run("hvdp-no-accounting")[2] == {"HVDP_STEP_ACCOUNTING": "0"}
    assert bench._impl_run("hvdp-no-watchdog")[2] == {"HVDP_WATCHDOG": "0"}
    assert bench._impl_run("hvdp-timeline")[:2] == ("hvdp", False)  # _train sets HOROVOD_TIMELINE for its job
