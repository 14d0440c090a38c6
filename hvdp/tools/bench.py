"""`hvdp bench`: training throughput and all-reduce bandwidth of hvdp, raw Horovod and PyTorch DDP, side by
side in one run, on the same models, data and thread settings. The workers live in benchmarks/.

Each number is the median over repetitions after warm-up steps; the spread (min, max) is kept too.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hvdp.core.tuning import RUNTIME_DEFAULTS
from hvdp.tools import resources

BENCH_DIR = resources.path("benchmarks")  # inside the installed package, or a checkout's benchmarks/
# framework -> its worker, the implementations measured side by side, and the ratios reported (a / b).
# An implementation ending in -tuned is the one before it run with hvdp's runtime defaults (raw Horovod
# "tuned the same way"); every other one runs with the library's own defaults (hvdp applies its own).
FRAMEWORKS = {
    "torch": {"worker": "train_worker.py", "impls": ("hvdp", "horovod", "horovod-tuned", "ddp"),
              "ratios": {"hvdp_vs_ddp": ("hvdp", "ddp"), "hvdp_vs_horovod_tuned": ("hvdp", "horovod-tuned")}},
    "tensorflow": {"worker": "train_worker_tf.py", "impls": ("hvdp-keras", "hvdp-tf", "horovod-tf", "horovod-tf-tuned"),
                   "ratios": {"hvdp_keras_vs_horovod_tf_tuned": ("hvdp-keras", "horovod-tf-tuned"),
                              "hvdp_tf_vs_horovod_tf_tuned": ("hvdp-tf", "horovod-tf-tuned")}},
}
ALLREDUCE_IMPLS = ("hvdp-mpi", "horovod-mpi", "hvdp-gloo", "torch-gloo", "mpi4py")
# Today's typical model (benchmarks/models.py's GPT, ~10M parameters in 76 tensors), eager and compiled,
# fp32 and bf16 autocast, against DDP and raw Horovod (each compiled the way its users do); with --quick,
# the bf16 eager one only. Steps per repetition: a third of --steps (a step is ~50x the CNN's here).
GPT = {"variants": ("gpt", "gpt-bf16", "gpt-compiled", "gpt-compiled-bf16"), "quick": ("gpt-bf16",),
       "impls": ("hvdp", "horovod", "ddp"),
       "ratios": {"hvdp_vs_ddp": ("hvdp", "ddp"), "hvdp_vs_horovod": ("hvdp", "horovod")}}


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes, one round: about 3 minutes here")
    parser.add_argument("--np", type=int, default=2, help="ranks for the distributed runs (default 2)")
    parser.add_argument("--steps", type=int,
                        help="timed training steps per repetition (3 repetitions per run; default 30, 10 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch/TF threads per rank, for every impl")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="torch training: where each rank computes, for every impl (default auto: each rank's "
                             "own GPU when torch sees GPUs, else the CPU)")
    parser.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn (compute-bound), mlp (6.4M)")
    parser.add_argument("--frameworks",
                        help="comma-separated: torch (hvdp vs raw Horovod vs DDP), tensorflow (hvdp-keras and "
                             "hvdp-tf vs raw horovod.tensorflow); the first gives the summary numbers "
                             "(default torch,tensorflow; torch with --quick)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds of every implementation (default 3, 1 with --quick): the "
                             "machine's slow phases then hit all of them, and each ratio is a median of rounds")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="FILE.png", help="plot busbw vs size and throughput per impl")
    parser.add_argument("--timeline", metavar="PATH",
                        help="also record Horovod's timeline of the hvdp run here (Chrome trace)")
    parser.add_argument("--autotune", action="store_true",
                        help="also measure raw Horovod with horovodrun --autotune")
    parser.add_argument("--skip-allreduce", action="store_true", help="measure training throughput only")
    parser.add_argument("--skip-pipeline", action="store_true",
                        help="skip the input-pipeline throughput (hvdp's sharded pipelines against hand-written ones)")
    parser.add_argument("--skip-gpt", action="store_true",
                        help="skip the GPT-style transformer (eager and compiled, fp32 and bf16; torch only)")
    parser.add_argument("--skip-training", action="store_true",
                        help="measure the all-reduce bandwidth only (every impl, side by side, against memcpy)")


def _bin(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name) or name


def _launch(impl: str, np_: int, script: str, args: list[str], env: dict, autotune: bool = False) -> list[str]:
    worker = [sys.executable, str(BENCH_DIR / script), *args]
    if impl == "alone":
        return worker
    if impl in ("ddp", "torch-gloo"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={np_}", *worker[1:]]
    if impl == "mpi4py":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ["mpirun", *root, "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH", *worker]
    cmd = [_bin("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}"]
    if impl == "hvdp-gloo":
        cmd.append("--gloo")
    if autotune:
        cmd += ["--autotune", "--autotune-warmup-samples", "2", "--autotune-steps-per-sample", "5"]
    return cmd + worker


def _run(cmd: list[str], env: dict, timeout: float = 600) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    found = []
    for chunk in (proc.stdout + proc.stderr).split("bench: ")[1:]:
        try:
            found.append(json.JSONDecoder().raw_decode(chunk)[0])
        except json.JSONDecodeError:
            pass
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"benchmark failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return found


def _run_side_by_side(cmd: list[str], env: dict, n: int, timeout: float = 600) -> dict:
    """`n` copies of a single-process run at once, no communication: the most each rank of an n-rank job
    could reach on this machine (they share its cores, caches and memory bandwidth)."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(n)]
    rates = []
    for proc in procs:
        out = proc.communicate(timeout=timeout)[0]
        at = out.rfind("bench: ")
        if proc.returncode != 0 or at < 0:
            raise RuntimeError(f"benchmark failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
        rates.append(json.JSONDecoder().raw_decode(out[at + len("bench: "):])[0]["samples_per_sec"])
    return {"samples_per_sec": statistics.mean(rates), "spread": [min(rates), max(rates)]}


def memcpy_gbps(nbytes: int = 64 << 20, reps: int = 10, copies: int = 1) -> float:
    """This machine's memory copy bandwidth (bytes copied per second), the physical reference.

    With `copies` > 1, that many processes copy at the same time, each its own buffer, and the result is
    what one of them gets (the median over processes of each one's median): a rank's share of the memory
    bandwidth while every rank moves its buffer, the ceiling of an allreduce that must read and write each
    rank's whole buffer.
    """
    if copies == 1:
        return _copy_rate(nbytes, reps)
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(copies), ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(nbytes, reps, start, results)) for _ in range(copies)]
    for proc in procs:
        proc.start()
    rates = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
    return statistics.median(rates)


def _copy_rate(nbytes: int, reps: int, start=None) -> float:
    import numpy as np
    src, dst = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        if start is not None:
            start.wait()
        begin = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - begin)
    return nbytes / statistics.median(times) / 1e9


def _copy_worker(nbytes: int, reps: int, start, results) -> None:
    results.put(_copy_rate(nbytes, reps, start))


def _impl_run(impl: str) -> tuple[str, bool, dict]:
    """An implementation's name -> (the worker's --impl, with hvdp's runtime defaults?, extra environment)."""
    if impl.endswith("-tuned"):
        return impl[:-len("-tuned")], True, {}
    if impl == "horovod-autotune":
        return "horovod", False, {}
    if impl == "hvdp-no-watchdog":  # what hvdp's watchdog costs per step
        return "hvdp", False, {"HVDP_WATCHDOG": "0"}
    return impl, False, {}


def _train(framework: str, model: str, args, rounds: int, steps: list[str], raw_env: dict,
           impls: tuple[str, ...] | None = None, ratios: dict | None = None) -> dict:
    """Every implementation of `framework` training `model` (or only `impls`, with `ratios`), in `rounds`
    interleaved rounds, plus one plain process alone and np plain processes side by side (the ceiling) in
    each round; without `impls`, each distributed implementation at np=1 too (once, not with --quick)."""
    spec = FRAMEWORKS[framework]
    worker_args = ["--model", model, "--threads", str(args.threads), *steps]
    if framework == "torch":
        worker_args += ["--device", args.device]
    all_impls, ratios = impls is None, ratios or spec["ratios"]
    impls = list(spec["impls"] if all_impls else impls)
    if framework == "torch" and all_impls:
        impls += (["horovod-autotune"] if args.autotune else []) + ([] if args.quick else ["hvdp-no-watchdog"])
    runs: dict[str, list[dict]] = {impl: [] for impl in impls + ["alone", "independent"]}
    for r in range(rounds):
        for impl in impls:
            real, tuned, extra = _impl_run(impl)
            env = {**raw_env, **(RUNTIME_DEFAULTS if tuned else {}), **extra}
            if impl == impls[0] and args.timeline and r == 0:
                env["HOROVOD_TIMELINE"] = f"{args.timeline}.{framework}.{model}.json"
            cmd = _launch(real, args.np, spec["worker"], ["--impl", real, *worker_args], env,
                          autotune=impl == "horovod-autotune")
            print(f"[bench] {framework} {model} round {r + 1}/{rounds}: {impl} np={args.np} ...",
                  file=sys.stderr, flush=True)
            runs[impl].append(_run(cmd, env)[0])
        alone_cmd = _launch("alone", 1, spec["worker"], ["--impl", "alone", *worker_args], raw_env)
        runs["alone"].append(_run(alone_cmd, raw_env)[0])
        print(f"[bench] {framework} {model} round {r + 1}/{rounds}: {args.np} independent processes side by "
              f"side ...", file=sys.stderr, flush=True)
        runs["independent"].append(_run_side_by_side(alone_cmd, raw_env, args.np))
    np1 = {}
    if not args.quick and all_impls:  # each distributed implementation alone (np=1) too, once
        for impl in spec["impls"]:
            real, tuned, _ = _impl_run(impl)
            if not tuned:
                np1[impl] = _run(_launch(real, 1, spec["worker"], ["--impl", real, *worker_args], raw_env), raw_env)[0]

    def median(impl):  # the median over rounds of each round's median
        return statistics.median(run["samples_per_sec"] for run in runs[impl])

    per_rank = {impl: median(impl) for impl in impls}
    alone, ceiling = median("alone"), median("independent")
    return {
        "samples_per_sec_per_rank": per_rank,
        "samples_per_sec": {k: v * args.np for k, v in per_rank.items()},
        # min and max over every repetition of every round
        "spread_per_rank": {impl: [min(run["spread"][0] for run in runs[impl]),
                                   max(run["spread"][1] for run in runs[impl])] for impl in impls},
        "rounds_per_rank": {impl: [run["samples_per_sec"] for run in runs[impl]] for impl in runs},
        "alone_samples_per_sec": alone,
        # np plain processes at once, no communication: the per-rank ceiling on this machine
        "independent_samples_per_sec_per_rank": ceiling,
        "independent_spread": [min(run["spread"][0] for run in runs["independent"]),
                               max(run["spread"][1] for run in runs["independent"])],
        "fraction_of_independent": {k: v / ceiling for k, v in per_rank.items()},
        "np1_samples_per_sec": {k: v["samples_per_sec"] for k, v in np1.items()},
        "scaling_efficiency": {k: v / alone for k, v in per_rank.items()},
        # each ratio within each round (both sides measured minutes apart at most), then the median of rounds
        "ratios": {name: statistics.median(x["samples_per_sec"] / y["samples_per_sec"]
                                           for x, y in zip(runs[a], runs[b]))
                   for name, (a, b) in ratios.items()},
        "ratios_per_round": {name: [x["samples_per_sec"] / y["samples_per_sec"] for x, y in zip(runs[a], runs[b])]
                             for name, (a, b) in ratios.items()},
    }


def _pipeline(framework: str, args, rounds: int, raw_env: dict) -> dict:
    """Input-pipeline samples/s per rank of hvdp's sharded pipeline and the hand-written one, alone and at np,
    on files the worker writes once into a temporary directory (removed after)."""
    import tempfile

    samples, reps = (4000, rounds) if args.quick else (20000, 3 * rounds)
    with tempfile.TemporaryDirectory(prefix=f"hvdp-bench-{framework}-") as directory:
        out = {}
        for np_ in (1, args.np):
            print(f"[bench] {framework} input pipeline np={np_} ...", file=sys.stderr, flush=True)
            extra = ["--compare-starts"] if framework == "torch" and not args.quick else []
            cmd = _launch("hvdp", np_, "pipeline_worker.py", ["--framework", framework, "--dir", directory,
                                                              "--samples", str(samples), "--reps", str(reps), *extra],
                          raw_env)
            result = _run(cmd, raw_env)[0]
            rates = result["samples_per_sec_per_rank"]
            ratios = [a / b for a, b in zip(rates["hvdp"], rates["hand"])]
            out[str(np_)] = {"samples_per_sec_per_rank": {k: statistics.median(v) for k, v in rates.items()},
                             "reps_per_rank": rates, "hvdp_vs_hand": statistics.median(ratios),
                             "hvdp_vs_hand_per_rep": ratios,
                             # epochs read again because a loader's forked workers deadlocked (issue 36)
                             "hangs": result["hangs"]}
            if "startup_s" in result:  # PyTorch: each epoch's start-up, and the first one (workers started)
                out[str(np_)].update({"startup_s": {k: statistics.median(v) for k, v in result["startup_s"].items()},
                                      "startup_s_per_rep": result["startup_s"],
                                      "first_startup_s": result["first_startup_s"]})
    return {"framework": framework, "samples": samples, "by_np": out}


def run(args) -> int:
    if not (BENCH_DIR / "train_worker.py").is_file():
        print(f"hvdp bench: the benchmark workers are not at {BENCH_DIR}; reinstall hvdp "
              f"(pip install --force-reinstall /path/to/hvdp, or from a checkout)", file=sys.stderr)
        return 2
    if args.np < 2:
        print(f"hvdp bench: --np must be >= 2, got {args.np}", file=sys.stderr)
        return 2
    frameworks = (args.frameworks or ("torch" if args.quick else "torch,tensorflow")).split(",")
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or not frameworks:
        print(f"hvdp bench: --frameworks takes {', '.join(FRAMEWORKS)}, got {','.join(frameworks)!r}", file=sys.stderr)
        return 2
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        print(f"hvdp bench: --rounds must be >= 1, got {rounds}", file=sys.stderr)
        return 2
    n_steps = args.steps if args.steps is not None else (10 if args.quick else 30)
    if n_steps < 1:
        print(f"hvdp bench: --steps must be >= 1, got {n_steps}", file=sys.stderr)
        return 2
    steps = ["--warmup", "3" if args.quick else "10", "--steps", str(n_steps), "--reps", "3"]
    base_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")]),
                    PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(args.threads))
    raw_env = {k: v for k, v in base_env.items() if k not in RUNTIME_DEFAULTS}  # Horovod's own defaults

    report = {"date": datetime.date.today().isoformat(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "hvdp_runtime_defaults": RUNTIME_DEFAULTS, "rounds": rounds, "steps_per_repetition": n_steps}
    if args.skip_training and args.skip_allreduce and args.skip_pipeline:
        print("hvdp bench: --skip-training, --skip-allreduce and --skip-pipeline together leave nothing to measure",
              file=sys.stderr)
        return 2
    for framework in ([] if args.skip_training else frameworks):
        result = {"framework": framework, "np": args.np, "threads": args.threads, "models": {}}
        for model in args.models.split(","):
            result["models"][model] = _train(framework, model, args, rounds, steps, raw_env)
        first = args.models.split(",")[0]
        result.update({"model": first, "samples_per_sec": result["models"][first]["samples_per_sec"],
                       **result["models"][first]["ratios"]})
        result["scaling_efficiency"] = result["models"][first]["scaling_efficiency"][FRAMEWORKS[framework]["impls"][0]]
        report["training" if framework == frameworks[0] else f"training_{framework}"] = result

    if "torch" in frameworks and not (args.skip_training or args.skip_gpt):
        gpt_steps = max(2, n_steps // 3)
        gpt_args = ["--warmup", "3", "--steps", str(gpt_steps), "--reps", "3"]
        report["training_gpt"] = {"framework": "torch", "label": "torch GPT-style transformer", "np": args.np,
                                  "threads": args.threads, "steps_per_repetition": gpt_steps,
                                  "models": {v: _train("torch", v, args, rounds, gpt_args, raw_env, GPT["impls"],
                                                       GPT["ratios"])
                                             for v in GPT["quick" if args.quick else "variants"]}}

    for framework in ([] if args.skip_pipeline else frameworks):
        report.setdefault("pipeline", {})[framework] = _pipeline(framework, args, rounds, raw_env)

    if not args.skip_allreduce:
        sizes = "4096,65536,1048576,16777216,67108864" if args.quick else \
                ",".join(str(4096 << (2 * i)) for i in range(8))  # 4 KiB .. 64 MiB
        runs, memcpys, shared = {}, [], []
        impls = ALLREDUCE_IMPLS
        if importlib.util.find_spec("mpi4py") is None:  # hvdp[dev] has it; a user's own env may not
            print("[bench] mpi4py is not installed: its MPI baseline is left out (pip install mpi4py)",
                  file=sys.stderr, flush=True)
            impls = tuple(i for i in impls if i != "mpi4py")
        for r in range(rounds):  # interleaved like training; each (impl, size) keeps its median round (lower middle if even)
            for impl in impls:
                print(f"[bench] allreduce round {r + 1}/{rounds}: {impl} np={args.np} ...", file=sys.stderr, flush=True)
                cmd = _launch(impl, args.np, "allreduce_worker.py",
                              ["--impl", impl, "--sizes", sizes, "--reps", "5" if args.quick else "10"], raw_env)
                for one in _run(cmd, raw_env):
                    runs.setdefault((impl, one["bytes"]), []).append(one)
            memcpys.append(memcpy_gbps())
            shared.append(memcpy_gbps(copies=args.np))
        results = []
        for (impl, nbytes), rs in runs.items():
            middle = sorted(rs, key=lambda one: one["busbw_GBps"])[(len(rs) - 1) // 2]
            results.append({**{k: middle[k] for k in ("impl", "bytes", "busbw_GBps", "algbw_GBps", "seconds")},
                            "busbw_GBps_rounds": [one["busbw_GBps"] for one in rs]})
        memcpy, memcpy_shared = statistics.median(memcpys), statistics.median(shared)
        largest = max(r["bytes"] for r in results)
        report["allreduce"] = {
            "np": args.np, "memcpy_GBps": memcpy, "memcpy_concurrent_GBps": memcpy_shared, "results": results,
            "largest_bytes": largest,
            # busbw at the largest size over memcpy bandwidth: the physical yardstick ...
            "fraction_of_memcpy": {r["impl"]: r["busbw_GBps"] / memcpy for r in results if r["bytes"] == largest},
            # ... and over what one rank gets while np ranks copy at once (an np=2 allreduce must read and
            # write every rank's whole buffer: it cannot beat this)
            "fraction_of_concurrent_memcpy": {r["impl"]: r["busbw_GBps"] / memcpy_shared for r in results
                                              if r["bytes"] == largest},
        }

    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0


def _training_sections(report: dict) -> list[tuple[str, dict]]:
    """(framework, its training results) in the order measured; "training" holds the first framework's."""
    return [(t["framework"], t) for key, t in report.items() if key == "training" or key.startswith("training_")]


def _print(report: dict) -> None:
    for framework, t in _training_sections(report):
        print(f"\n{t.get('label', framework)} training throughput, np={t['np']}, {t['threads']} thread(s)/rank "
              f"(samples/s per rank, median of {report['rounds']} interleaved round(s); efficiency = per rank / one "
              f"plain process)")
        for model, m in t["models"].items():
            print(f"  {model}: alone {m['alone_samples_per_sec']:.0f}; {t['np']} independent processes side by "
                  f"side {m['independent_samples_per_sec_per_rank']:.0f} each (the ceiling per rank)")
            for impl, v in m["samples_per_sec_per_rank"].items():
                lo, hi = m["spread_per_rank"][impl]
                print(f"    {impl:<17} {v:8.0f}  [{lo:.0f}-{hi:.0f}]  efficiency {m['scaling_efficiency'][impl]:.2f}"
                      f"  of ceiling {m['fraction_of_independent'][impl]:.2f}")
            for name, value in m["ratios"].items():
                rounds = ", ".join(f"{x:.3f}" for x in m["ratios_per_round"][name])
                print(f"    {name} = {value:.3f}  (rounds: {rounds})")
    for framework, p in report.get("pipeline", {}).items():
        print(f"\n{framework} input pipeline, {p['samples']} files' samples (samples/s per rank, median; hvdp's "
              f"shard against the hand-written pipeline)")
        for np_, m in p["by_np"].items():
            rates = m["samples_per_sec_per_rank"]
            reps = ", ".join(f"{x:.3f}" for x in m["hvdp_vs_hand_per_rep"])
            print(f"  np={np_}: hvdp {rates['hvdp']:.0f}  hand {rates['hand']:.0f}  hvdp_vs_hand = "
                  f"{m['hvdp_vs_hand']:.3f}  (reps: {reps})")
            for impl in (k for k in rates if k not in ("hvdp", "hand")):
                print(f"    {impl} {rates[impl]:.0f}")
            for impl, n in m["hangs"].items():
                print(f"    {impl}: {n} epoch(s) read again, their workers deadlocked in fork (issue 36)")
            if "startup_s" in m:
                print("    epoch start-up, s to the first batch (median of later epochs; first epoch): " + ", ".join(
                    f"{k} {v:.3f} ({m['first_startup_s'][k]:.2f})" for k, v in m["startup_s"].items()))
    if "allreduce" in report:
        a = report["allreduce"]
        print(f"\nallreduce busbw (GB/s), np={a['np']}; memcpy {a['memcpy_GBps']:.2f} GB/s alone, "
              f"{a['memcpy_concurrent_GBps']:.2f} GB/s each with {a['np']} copying at once")
        sizes = sorted({r["bytes"] for r in a["results"]})
        print("  " + "impl".ljust(12) + "".join(f"{_human(s):>9}" for s in sizes))
        for impl in dict.fromkeys(r["impl"] for r in a["results"]):
            by = {r["bytes"]: r["busbw_GBps"] for r in a["results"] if r["impl"] == impl}
            print("  " + impl.ljust(12) + "".join(f"{by.get(s, float('nan')):9.3f}" for s in sizes)
                  + f"   {a['fraction_of_memcpy'][impl]:.2f}x memcpy, "
                    f"{a['fraction_of_concurrent_memcpy'][impl]:.2f}x concurrent memcpy at {_human(a['largest_bytes'])}")


def _human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6))
    if "allreduce" in report:
        a = report["allreduce"]
        for impl in dict.fromkeys(r["impl"] for r in a["results"]):
            rs = [r for r in a["results"] if r["impl"] == impl]
            left.plot([r["bytes"] for r in rs], [r["busbw_GBps"] for r in rs], marker="o", label=impl)
        left.axhline(a["memcpy_GBps"], color="grey", linestyle="--", label="memcpy")
        left.set_xscale("log", base=2)
        left.set_xlabel("message size (bytes)")
        left.set_ylabel("busbw (GB/s)")
        left.set_title(f"allreduce, np={a['np']}")
        left.legend()
    labels, values, colors = [], [], []
    for framework, t in _training_sections(report):
        for model, m in t["models"].items():
            for impl, v in [*m["samples_per_sec_per_rank"].items(), ("alone (np=1)", m["alone_samples_per_sec"])]:
                labels.append(f"{framework} {model}: {impl}")
                values.append(v)
                colors.append("grey" if impl.startswith("alone") else "C0" if framework == "torch" else "C1")
    right.barh(range(len(values)), values, color=colors)
    right.set_yticks(range(len(labels)), labels, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("samples/s per rank")
    right.set_title(f"training, np={report['training']['np']}" if "training" in report else "training: not measured")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
