"""`hvdp bench`: training throughput and all-reduce bandwidth of hvdp, raw Horovod and PyTorch DDP, side by
side in one run, on the same models, data and thread settings. The workers live in benchmarks/.

Training: every implementation's job is started at once and they take turns, one short repetition each per
round, the others stopped (hvdp.tools.rotation); each number is the median over rounds, each ratio the median
of the rounds' ratios with a confidence interval. The all-reduce and input-pipeline runs go one after another,
the median of their repetitions. The spread (min, max) is kept too.
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
import tempfile
import time
from pathlib import Path

from hvdp.core.tuning import RUNTIME_DEFAULTS
from hvdp.tools import bench_sharded, resources, rotation

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
# --keras-backend torch: in the tensorflow framework's place, hvdp.keras's fit on Keras's torch backend against
# hvdp's PyTorch adapter on the same model (models_tf.py's layers are models.py's): name -> (framework, --impl).
KERAS_TORCH = {"impls": {"hvdp-keras-torch": ("tensorflow", "hvdp-keras"), "hvdp-torch": ("torch", "hvdp")},
               "ratios": {"hvdp_keras_torch_vs_hvdp_torch": ("hvdp-keras-torch", "hvdp-torch")}}
# Training rounds of turns (hvdp.tools.rotation), by --quick; the all-reduce and input-pipeline runs, whole runs
# one after another, take OTHER_ROUNDS.
ROUNDS, OTHER_ROUNDS = {False: 15, True: 7}, {False: 3, True: 1}
SMALL_BYTES = 256 << 10  # up to here an all-reduce's latency is reported (benchmarks/allreduce_worker.py's SMALL)
ALLREDUCE_IMPLS = ("hvdp-mpi", "horovod-mpi", "hvdp-gloo", "torch-gloo", "mpi4py")
# Today's typical model (benchmarks/models.py's GPT, ~10M parameters in 76 tensors), eager and compiled,
# fp32 and bf16 autocast, against DDP and raw Horovod (each compiled the way its users do); with --quick,
# the bf16 eager one only. Steps per repetition: --steps, as the CNN's (a step takes about as long here).
# Every implementation trains it with AdamW (Adam-like state, what sharding saves; SGD before issue 34), and
# the eager variants' rotations hold two more: hvdp with its optimizer state sharded (ZeRO-1/2) and DDP with
# torch's ZeroRedundancyOptimizer (ZeRO-1), each with its memory (benchmarks/memory.py) and issue 34's
# targets (not the compiled ones: hvdp_torch.compile with sharded state is tested, not yet measured here).
GPT = {"variants": ("gpt", "gpt-bf16", "gpt-compiled", "gpt-compiled-bf16"), "quick": ("gpt-bf16",),
       "impls": ("hvdp", "horovod", "ddp"), "optimizer": "adamw",
       "ratios": {"hvdp_vs_ddp": ("hvdp", "ddp"), "hvdp_vs_horovod": ("hvdp", "horovod")},
       "sharded_impls": ("hvdp-sharded", "ddp-zero"),
       "sharded_ratios": {"hvdp_sharded_vs_hvdp": ("hvdp-sharded", "hvdp"),
                          "hvdp_sharded_vs_ddp_zero": ("hvdp-sharded", "ddp-zero")}}


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
    parser.add_argument("--keras-backend", choices=("tensorflow", "torch"), default="tensorflow",
                        help="the tensorflow framework's Keras backend (default tensorflow, whatever KERAS_BACKEND "
                             "says); torch: instead of "
                             "raw horovod.tensorflow, hvdp-keras on Keras's torch backend against hvdp's PyTorch "
                             "adapter (hvdp.torch) on the same model, side by side (keras-torch)")
    parser.add_argument("--rounds", type=int,
                        help=f"training: rounds of turns, one short repetition of every implementation each, all "
                             f"started at once (default {ROUNDS[False]}, {ROUNDS[True]} with --quick): the machine's "
                             f"slow phases hit all of them, and each ratio is a median of rounds with its interval")
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
                        help="skip the GPT-style transformer (eager and compiled, fp32 and bf16, AdamW; with hvdp's "
                             "sharded optimizer state and DDP's ZeroRedundancyOptimizer beside; torch only)")
    parser.add_argument("--skip-training", action="store_true",
                        help="measure the all-reduce bandwidth only (every impl, side by side, against memcpy)")
    parser.add_argument("--memory-cap", type=int, metavar="MIB",
                        help="instead of the rest: the largest GPT (width 512, AdamW) that trains at --np under this "
                             "per-rank cap (RLIMIT_DATA), hvdp's allreduce path against its sharded optimizer state "
                             "(bisection over layers, a whole job per probe: tens of minutes; not in make test)")


def _bin(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name) or name


def _launch(impl: str, np_: int, script: str, args: list[str], env: dict, autotune: bool = False) -> list[str]:
    worker = [sys.executable, str(BENCH_DIR / script), *args]
    if impl == "alone":
        return worker
    if impl in ("ddp", "ddp-zero", "torch-gloo"):
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


# Without --quick, the torch training also runs hvdp with one part off or on, each measuring that part's cost.
EXTRA_TORCH = ("hvdp-no-watchdog", "hvdp-no-prompt", "hvdp-timeline", "hvdp-no-accounting")


def _impl_run(impl: str) -> tuple[str, bool, dict]:
    """An implementation's name -> (the worker's --impl, with hvdp's runtime defaults?, extra environment)."""
    if impl.endswith("-tuned"):
        return impl[:-len("-tuned")], True, {}
    if impl == "horovod-autotune":
        return "horovod", False, {}
    if impl == "hvdp-no-watchdog":  # what hvdp's watchdog costs per step
        return "hvdp", False, {"HVDP_WATCHDOG": "0"}
    if impl == "hvdp-no-accounting":  # what the per-step accounting and straggler report cost (issue 47)
        return "hvdp", False, {"HVDP_STEP_ACCOUNTING": "0"}
    if impl == "hvdp-no-prompt":  # Horovod's cycle timing without fix 13 (docs/internals.md)
        return "hvdp", False, {"HVDP_PROMPT_START": "0"}
    if impl == "hvdp-timeline":  # what recording Horovod's timeline costs (its file: _train, per job directory)
        return "hvdp", False, {}
    return impl, False, {}


def _train(framework: str, model: str, args, rounds: int, steps: list[str], raw_env: dict,
           impls: tuple[str, ...] | None = None, ratios: dict | None = None) -> dict:
    """Every implementation of `framework` training `model` (or only `impls`, with `ratios`), plus one plain
    process alone and np plain processes side by side (the ceiling), all started at once and taking turns
    (hvdp.tools.rotation): `rounds` rounds of one short repetition each. Without `impls`, each distributed
    implementation at np=1 too (once, after, not with --quick)."""
    spec = FRAMEWORKS[framework]
    worker_args = _worker_args(framework, model, args, rounds, steps)
    all_impls, ratios = impls is None, ratios or spec["ratios"]
    impls = list(spec["impls"] if all_impls else impls)
    if framework == "torch" and all_impls:
        impls += (["horovod-autotune"] if args.autotune else []) + \
                 ([] if args.quick else list(EXTRA_TORCH))
    with tempfile.TemporaryDirectory(prefix="hvdp-bench-turns-") as directory:
        jobs = []
        for impl in impls:
            real, tuned, extra = _impl_run(impl)
            env = {**raw_env, **(RUNTIME_DEFAULTS if tuned else {}), **extra}
            if impl == impls[0] and args.timeline:
                env["HOROVOD_TIMELINE"] = f"{args.timeline}.{framework}.{model}.json"
            if impl == "hvdp-timeline":  # what recording Horovod's timeline costs (issue 52: fix 15)
                env["HOROVOD_TIMELINE"] = os.path.join(directory, f"timeline.{framework}.{model}.json")
            jobs.append(_job(impl, real, spec["worker"], worker_args, args, env, directory,
                             autotune=impl == "horovod-autotune"))
        jobs += _plain_jobs(spec["worker"], worker_args, args, raw_env, directory)
        rounds_of = _rotate(f"{framework} {model}", jobs, rounds, directory)
    np1 = {}
    if not args.quick and all_impls:  # each distributed implementation alone (np=1) too, once
        for impl in spec["impls"]:
            real, tuned, _ = _impl_run(impl)
            if not tuned:
                np1[impl] = _run(_launch(real, 1, spec["worker"], ["--impl", real, *worker_args], raw_env), raw_env)[0]
    return _summary(rounds_of, impls, ratios, args, np1)


def _train_keras_torch(model: str, args, rounds: int, steps: list[str], raw_env: dict) -> dict:
    """--keras-backend torch: hvdp.keras's fit on Keras's torch backend (train_worker_tf.py under
    KERAS_BACKEND=torch) against hvdp's PyTorch adapter (train_worker.py --impl hvdp) training the same model,
    plus a Keras-on-torch process alone and np of them side by side, all in one rotation as in _train. Returns
    _train's fields, and `keras_backend`: the backend each Keras job's records name (job -> "torch")."""
    keras_env = {**raw_env, "KERAS_BACKEND": "torch"}
    with tempfile.TemporaryDirectory(prefix="hvdp-bench-turns-") as directory:
        jobs = [_job(name, impl, FRAMEWORKS[framework]["worker"], _worker_args(framework, model, args, rounds, steps),
                     args, keras_env if framework == "tensorflow" else raw_env, directory)
                for name, (framework, impl) in KERAS_TORCH["impls"].items()]
        jobs += _plain_jobs(FRAMEWORKS["tensorflow"]["worker"], _worker_args("tensorflow", model, args, rounds, steps),
                            args, keras_env, directory)
        rounds_of = _rotate(f"keras-torch {model}", jobs, rounds, directory)
    result = _summary(rounds_of, list(KERAS_TORCH["impls"]), KERAS_TORCH["ratios"], args, {})
    result["keras_backend"] = {job.name: "/".join(sorted({r["keras_backend"] for rs in rounds_of[job.name]
                                                           for r in rs}))
                               for job in jobs if job.env is keras_env}
    return result


def _worker_args(framework: str, model: str, args, rounds: int, steps: list[str]) -> list[str]:
    worker_args = ["--model", model, "--threads", str(args.threads), *steps, "--reps", str(rounds)]
    return worker_args + (["--device", args.device] if framework == "torch" else [])


def _job(name: str, impl: str, worker: str, worker_args: list[str], args, env: dict, directory: str,
         autotune: bool = False) -> rotation.Job:
    """The rotation's job `name`: `worker` --impl `impl` at np ranks under that implementation's launcher."""
    cmd = _launch(impl, args.np, worker, ["--impl", impl, *worker_args, "--turns", directory, "--job", name], env,
                  autotune=autotune)
    return rotation.Job(name, [cmd], env, processes=args.np)


def _plain_jobs(worker: str, worker_args: list[str], args, env: dict, directory: str) -> list[rotation.Job]:
    """`worker`'s plain process alone, and np of them side by side, no communication (the ceiling)."""
    alone = [*_launch("alone", 1, worker, ["--impl", "alone", *worker_args], env), "--turns", directory]
    return [rotation.Job("alone", [[*alone, "--job", "alone"]], env, processes=1),
            rotation.Job("independent", [[*alone, "--job", "independent", "--instance", str(i)]
                                         for i in range(args.np)], env, processes=args.np, writers=args.np)]


def _rotate(what: str, jobs: list[rotation.Job], rounds: int, directory: str) -> dict[str, list[list[dict]]]:
    print(f"[bench] {what}: {', '.join(j.name for j in jobs)} started at once, then {rounds} "
          f"round(s) of one repetition each in turn ...", file=sys.stderr, flush=True)
    return rotation.rotate(jobs, rounds, Path(directory))


def _summary(rounds_of: dict[str, list[list[dict]]], impls: list[str], ratios: dict, args, np1: dict) -> dict:
    """A rotation's records -> each implementation's samples/s (median of rounds), next to the plain process
    alone and the independent ones (the jobs "alone" and "independent"), and each ratio (median of rounds)."""
    # samples/s per rank in each round (the independent processes: their mean)
    runs = {name: [statistics.mean(r["samples_per_sec"] for r in records) for records in per_round]
            for name, per_round in rounds_of.items()}
    # each kind of thread's CPU (cores busy) in the first writer's (rank 0's) repetitions: the median of rounds
    cpu = {name: {kind: statistics.median(r[0]["cpu_by_thread"].get(kind, 0.0) for r in per_round)
                  for kind in sorted({k for r in per_round for k in r[0]["cpu_by_thread"]})}
           for name, per_round in rounds_of.items() if "cpu_by_thread" in per_round[0][0]}

    # rank 0's memory (benchmarks/memory.py): each figure's largest over the rounds (the peak only grows)
    memory = {name: {key: max(r[0]["memory"][key] for r in per_round) for key in per_round[0][0]["memory"]}
              for name, per_round in rounds_of.items() if "memory" in per_round[0][0]}

    per_rank = {impl: statistics.median(runs[impl]) for impl in impls}
    alone, ceiling = statistics.median(runs["alone"]), statistics.median(runs["independent"])
    per_round = {name: [x / y for x, y in zip(runs[a], runs[b])] for name, (a, b) in ratios.items()}
    intervals = {name: rotation.interval(values) for name, values in per_round.items()}
    return {
        "samples_per_sec_per_rank": per_rank,
        "samples_per_sec": {k: v * args.np for k, v in per_rank.items()},
        "spread_per_rank": {impl: [min(runs[impl]), max(runs[impl])] for impl in impls},  # over rounds
        "rounds_per_rank": runs,
        "alone_samples_per_sec": alone,
        # np plain processes at once, no communication: the per-rank ceiling on this machine
        "independent_samples_per_sec_per_rank": ceiling,
        "independent_spread": [min(runs["independent"]), max(runs["independent"])],
        "fraction_of_independent": {k: v / ceiling for k, v in per_rank.items()},
        "np1_samples_per_sec": {k: v["samples_per_sec"] for k, v in np1.items()},
        "scaling_efficiency": {k: v / alone for k, v in per_rank.items()},
        # each ratio within each round (both sides seconds apart), then the median of rounds and its interval
        "ratios": {name: statistics.median(values) for name, values in per_round.items()},
        "ratios_per_round": per_round,
        "ratio_intervals": {name: [lo, hi] for name, (lo, hi, _) in intervals.items()},
        "cpu_by_thread": cpu,  # torch: benchmarks/cputhreads.py's kinds, cores busy while a repetition ran
        "interval_coverage": min(c for _, _, c in intervals.values()),
        **({"memory": memory} if memory else {}),  # torch: rank 0's, after each repetition
    }


def _pipeline(framework: str, args, rounds: int, raw_env: dict) -> dict:
    """Input-pipeline samples/s per rank of hvdp's sharded pipeline and the hand-written one, alone and at np,
    on files the worker writes once into a temporary directory (removed after)."""
    samples, reps = (2000, rounds) if args.quick else (20000, 3 * rounds)
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
    keras_torch = args.keras_backend == "torch"
    if keras_torch and "tensorflow" not in frameworks:
        print(f"hvdp bench: --keras-backend torch measures in the tensorflow framework's place; add tensorflow to "
              f"--frameworks (got {','.join(frameworks)!r})", file=sys.stderr)
        return 2
    rounds, other_rounds = args.rounds if args.rounds is not None else ROUNDS[args.quick], OTHER_ROUNDS[args.quick]
    if rounds < 1:
        print(f"hvdp bench: --rounds must be >= 1, got {rounds}", file=sys.stderr)
        return 2
    n_steps = args.steps if args.steps is not None else (10 if args.quick else 30)
    if n_steps < 1:
        print(f"hvdp bench: --steps must be >= 1, got {n_steps}", file=sys.stderr)
        return 2
    # a warm-up turn of 3 steps (10 without --quick), no more than a repetition's: a warm-up longer than the
    # timed steps only costs time (make test's --steps 2)
    warmup = str(min(3 if args.quick else 10, n_steps))
    steps = ["--warmup", warmup, "--steps", str(n_steps)]
    base_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")]),
                    PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(args.threads),
                    KERAS_BACKEND="tensorflow")  # whatever the caller's says; keras-torch's jobs set torch
    raw_env = {k: v for k, v in base_env.items() if k not in RUNTIME_DEFAULTS}  # Horovod's own defaults
    if args.memory_cap:  # issue 45: what sharding lets a user train under a fixed memory cap
        cap = bench_sharded.memory_cap(args.memory_cap, args.np, lambda a: _launch(
            "hvdp", args.np, "capped_worker.py", a, raw_env), raw_env)
        bench_sharded.print_cap(cap)
        if args.json:
            Path(args.json).write_text(json.dumps({"memory_cap": cap}, indent=1))
        return 0

    report = {"date": datetime.date.today().isoformat(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "hvdp_runtime_defaults": RUNTIME_DEFAULTS, "rounds": rounds, "steps_per_repetition": n_steps}
    if args.skip_training and args.skip_allreduce and args.skip_pipeline:
        print("hvdp bench: --skip-training, --skip-allreduce and --skip-pipeline together leave nothing to measure",
              file=sys.stderr)
        return 2
    plain = [f for f in frameworks if not (keras_torch and f == "tensorflow")]  # "training": the first's
    for framework in ([] if args.skip_training else frameworks):
        result = {"framework": framework, "np": args.np, "threads": args.threads, "models": {}}
        if keras_torch and framework == "tensorflow":
            result.update(framework="keras-torch", label="keras-torch (hvdp.keras fit on Keras's torch backend "
                                                         "against hvdp.torch; alone, independent: Keras on torch)")
        for model in args.models.split(","):
            result["models"][model] = (_train_keras_torch(model, args, rounds, steps, raw_env)
                                       if result["framework"] == "keras-torch" else
                                       _train(framework, model, args, rounds, steps, raw_env))
        first = args.models.split(",")[0]
        result.update({"model": first, "samples_per_sec": result["models"][first]["samples_per_sec"],
                       **result["models"][first]["ratios"]})
        lead = next(iter(result["models"][first]["samples_per_sec"]))  # hvdp's first implementation
        result["scaling_efficiency"] = result["models"][first]["scaling_efficiency"][lead]
        key = "training" if plain and framework == plain[0] else f"training_{result['framework'].replace('-', '_')}"
        report[key] = result

    if "torch" in frameworks and not (args.skip_training or args.skip_gpt):
        gpt_steps = n_steps
        gpt_args = ["--warmup", str(min(3, gpt_steps)), "--steps", str(gpt_steps), "--optimizer", GPT["optimizer"]]
        report["training_gpt"] = {"framework": "torch", "label": f"torch GPT-style transformer ({GPT['optimizer']})",
                                  "np": args.np, "threads": args.threads, "steps_per_repetition": gpt_steps,
                                  "optimizer": GPT["optimizer"],
                                  "models": {}}
        for v in GPT["quick" if args.quick else "variants"]:
            sharded = "compiled" not in v
            m = _train("torch", v, args, rounds, gpt_args, raw_env,
                       GPT["impls"] + (GPT["sharded_impls"] if sharded else ()),
                       {**GPT["ratios"], **(GPT["sharded_ratios"] if sharded else {})})
            if sharded:
                m["sharded"] = bench_sharded.targets(m, args.np)
            report["training_gpt"]["models"][v] = m

    for framework in ([] if args.skip_pipeline else frameworks):
        report.setdefault("pipeline", {})[framework] = _pipeline(framework, args, other_rounds, raw_env)

    if not args.skip_allreduce:
        sizes = "4096,16384,65536,262144,1048576,16777216,67108864" if args.quick else \
                ",".join(str(4096 << (2 * i)) for i in range(8))  # 4 KiB .. 64 MiB
        runs, memcpys, shared = {}, [], []
        impls = ALLREDUCE_IMPLS
        if importlib.util.find_spec("mpi4py") is None:  # hvdp[dev] has it; a user's own env may not
            print("[bench] mpi4py is not installed: its MPI baseline is left out (pip install mpi4py)",
                  file=sys.stderr, flush=True)
            impls = tuple(i for i in impls if i != "mpi4py")
        for r in range(other_rounds):  # interleaved; each (impl, size) keeps its median round (lower middle if even)
            for impl in impls:
                print(f"[bench] allreduce round {r + 1}/{other_rounds}: {impl} np={args.np} ...", file=sys.stderr, flush=True)
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
            "np": args.np, "rounds": other_rounds, "memcpy_GBps": memcpy, "memcpy_concurrent_GBps": memcpy_shared,
            "results": results, "largest_bytes": largest,
            # busbw at the largest size over memcpy bandwidth: the physical yardstick ...
            "fraction_of_memcpy": {r["impl"]: r["busbw_GBps"] / memcpy for r in results if r["bytes"] == largest},
            # ... and over what one rank gets while np ranks copy at once (an np=2 allreduce must read and
            # write every rank's whole buffer: it cannot beat this)
            "fraction_of_concurrent_memcpy": {r["impl"]: r["busbw_GBps"] / memcpy_shared for r in results
                                              if r["bytes"] == largest},
            # small messages: the time one all-reduce takes (median of its repetitions), and over mpi4py's
            "latency_us": {impl: {str(r["bytes"]): r["seconds"] * 1e6 for r in results
                                  if r["impl"] == impl and r["bytes"] <= SMALL_BYTES} for impl in impls},
        }
        if "mpi4py" in impls:
            mpi = report["allreduce"]["latency_us"]["mpi4py"]
            report["allreduce"]["latency_vs_mpi4py"] = {
                impl: {n: us / mpi[n] for n, us in by.items()} for impl, by in report["allreduce"]["latency_us"].items()}

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
              f"(samples/s per rank, median of {report['rounds']} round(s) of turns; [min-max]; efficiency = per "
              f"rank / one plain process; each ratio: median of the rounds' ratios [its confidence interval])")
        for model, m in t["models"].items():
            print(f"  {model}: alone {m['alone_samples_per_sec']:.0f}; {t['np']} independent processes side by "
                  f"side {m['independent_samples_per_sec_per_rank']:.0f} each (the ceiling per rank)")
            for impl, v in m["samples_per_sec_per_rank"].items():
                lo, hi = m["spread_per_rank"][impl]
                cpu = ", ".join(f"{k} {c:.2f}" for k, c in m.get("cpu_by_thread", {}).get(impl, {}).items() if c)
                print(f"    {impl:<17} {v:8.0f}  [{lo:.0f}-{hi:.0f}]  efficiency {m['scaling_efficiency'][impl]:.2f}"
                      f"  of ceiling {m['fraction_of_independent'][impl]:.2f}" + (f"  cores: {cpu}" if cpu else ""))
            if "keras_backend" in m:
                print("    Keras ran on: " + ", ".join(f"{job} {b}" for job, b in m["keras_backend"].items()))
            for name, value in m["ratios"].items():
                rounds = ", ".join(f"{x:.3f}" for x in m["ratios_per_round"][name])
                low, high = m["ratio_intervals"][name]
                print(f"    {name} = {value:.3f}  [{low:.3f}, {high:.3f}] at {m['interval_coverage']:.0%} "
                      f"(rounds: {rounds})")
            if "sharded" in m:
                bench_sharded.print_table(model, m, t["np"])
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
        print("  latency of one small all-reduce, us (x mpi4py's):")
        for impl, by in a["latency_us"].items():
            print("  " + impl.ljust(12) + "".join(
                f"{_human(int(n)):>6} {us:7.0f}" + (f" ({a['latency_vs_mpi4py'][impl][n]:5.1f}x)"
                                                     if "latency_vs_mpi4py" in a else "") for n, us in by.items()))


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
