"""`hvdp bench`: training throughput and all-reduce bandwidth of hvdp, raw Horovod and PyTorch DDP, side by
side in one run, on the same models, data and thread settings. The workers live in benchmarks/.

Each number is the median over repetitions after warm-up steps; the spread (min, max) is kept too.
"""

from __future__ import annotations

import datetime
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

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
TRAIN_IMPLS = ("hvdp", "horovod", "horovod-tuned", "ddp")
ALLREDUCE_IMPLS = ("hvdp-mpi", "horovod-mpi", "hvdp-gloo", "torch-gloo", "mpi4py")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes: about 3 minutes here")
    parser.add_argument("--np", type=int, default=2, help="ranks for the distributed runs (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, for every impl")
    parser.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn (compute-bound), mlp (6.4M)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON here")
    parser.add_argument("--plot", metavar="FILE.png", help="plot busbw vs size and throughput per impl")
    parser.add_argument("--timeline", metavar="PATH",
                        help="also record Horovod's timeline of the hvdp run here (Chrome trace)")
    parser.add_argument("--autotune", action="store_true",
                        help="also measure raw Horovod with horovodrun --autotune")
    parser.add_argument("--skip-allreduce", action="store_true")


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


def memcpy_gbps(nbytes: int = 64 << 20, reps: int = 10) -> float:
    """This machine's memory copy bandwidth (bytes copied per second), the physical reference."""
    import numpy as np
    src, dst = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def run(args) -> int:
    if not (BENCH_DIR / "train_worker.py").is_file():
        print(f"hvdp bench: the benchmark workers are not at {BENCH_DIR}; run it from a checkout of hvdp",
              file=sys.stderr)
        return 2
    if args.np < 2:
        print(f"hvdp bench: --np must be >= 2, got {args.np}", file=sys.stderr)
        return 2
    steps = ["--warmup", "3", "--steps", "10", "--reps", "3"] if args.quick else \
            ["--warmup", "10", "--steps", "30", "--reps", "5"]
    base_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")]),
                    PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(args.threads))
    raw_env = {k: v for k, v in base_env.items() if k not in RUNTIME_DEFAULTS}  # Horovod's own defaults
    tuned_env = {**raw_env, **RUNTIME_DEFAULTS}
    envs = {"hvdp": raw_env, "horovod": raw_env, "horovod-tuned": tuned_env, "ddp": raw_env, "alone": raw_env}

    report = {"date": datetime.date.today().isoformat(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "hvdp_runtime_defaults": RUNTIME_DEFAULTS, "training": {"np": args.np, "threads": args.threads,
                                                                      "models": {}}}
    for model in args.models.split(","):
        worker_args = ["--model", model, "--threads", str(args.threads), *steps]
        rows: dict[str, dict] = {}
        impls = list(TRAIN_IMPLS) + (["horovod-autotune"] if args.autotune else []) + \
            ([] if args.quick else ["hvdp-no-watchdog"])
        for impl in impls:
            real = {"horovod-tuned": "horovod", "horovod-autotune": "horovod", "hvdp-no-watchdog": "hvdp"}.get(impl, impl)
            env = dict(envs.get(impl, raw_env))
            if impl == "hvdp-no-watchdog":  # what hvdp's watchdog costs per step
                env["HVDP_WATCHDOG"] = "0"
            if impl == "hvdp" and args.timeline:
                env["HOROVOD_TIMELINE"] = f"{args.timeline}.{model}.json"
            cmd = _launch(real, args.np, "train_worker.py", ["--impl", real, *worker_args], env,
                          autotune=impl == "horovod-autotune")
            print(f"[bench] {model}: {impl} np={args.np} ...", file=sys.stderr, flush=True)
            rows[impl] = _run(cmd, env)[0]
        alone_cmd = _launch("alone", 1, "train_worker.py", ["--impl", "alone", *worker_args], raw_env)
        alone = _run(alone_cmd, raw_env)[0]
        print(f"[bench] {model}: {args.np} independent processes side by side ...", file=sys.stderr, flush=True)
        ceiling = _run_side_by_side(alone_cmd, raw_env, args.np)
        if not args.quick:  # each implementation alone (np=1) too, not only the plain process
            for impl in ("hvdp", "horovod", "ddp"):
                one = _run(_launch(impl, 1, "train_worker.py", ["--impl", impl, *worker_args], raw_env), raw_env)[0]
                rows[f"{impl}@np1"] = one
        per_rank = {k: v["samples_per_sec"] for k, v in rows.items() if "@" not in k}
        report["training"]["models"][model] = {
            "samples_per_sec_per_rank": per_rank,
            "samples_per_sec": {k: v * args.np for k, v in per_rank.items()},
            "spread_per_rank": {k: v["spread"] for k, v in rows.items()},
            "alone_samples_per_sec": alone["samples_per_sec"],
            # np plain processes at once, no communication: the per-rank ceiling on this machine
            "independent_samples_per_sec_per_rank": ceiling["samples_per_sec"],
            "independent_spread": ceiling["spread"],
            "fraction_of_independent": {k: v / ceiling["samples_per_sec"] for k, v in per_rank.items()},
            "np1_samples_per_sec": {k.split("@")[0]: v["samples_per_sec"] for k, v in rows.items() if "@" in k},
            "scaling_efficiency": {k: v / alone["samples_per_sec"] for k, v in per_rank.items()},
        }
    first = report["training"]["models"][args.models.split(",")[0]]
    report["training"].update({
        "model": args.models.split(",")[0],
        "samples_per_sec": first["samples_per_sec"],
        "scaling_efficiency": first["scaling_efficiency"]["hvdp"],
        "hvdp_vs_ddp": first["samples_per_sec"]["hvdp"] / first["samples_per_sec"]["ddp"],
        "hvdp_vs_horovod_tuned": first["samples_per_sec"]["hvdp"] / first["samples_per_sec"]["horovod-tuned"],
    })

    if not args.skip_allreduce:
        sizes = "4096,65536,1048576,16777216,67108864" if args.quick else \
                ",".join(str(4096 << (2 * i)) for i in range(8))  # 4 KiB .. 64 MiB
        results = []
        for impl in ALLREDUCE_IMPLS:
            print(f"[bench] allreduce: {impl} np={args.np} ...", file=sys.stderr, flush=True)
            cmd = _launch(impl, args.np, "allreduce_worker.py",
                          ["--impl", impl, "--sizes", sizes, "--reps", "5" if args.quick else "10"], raw_env)
            results += [{k: r[k] for k in ("impl", "bytes", "busbw_GBps", "algbw_GBps", "seconds")}
                        for r in _run(cmd, raw_env)]
        memcpy = memcpy_gbps()
        largest = max(r["bytes"] for r in results)
        report["allreduce"] = {
            "np": args.np, "memcpy_GBps": memcpy, "results": results, "largest_bytes": largest,
            # busbw at the largest size over memcpy bandwidth: the physical yardstick
            "fraction_of_memcpy": {r["impl"]: r["busbw_GBps"] / memcpy for r in results if r["bytes"] == largest},
        }

    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0


def _print(report: dict) -> None:
    t = report["training"]
    print(f"\ntraining throughput, np={t['np']}, {t['threads']} thread(s)/rank (samples/s per rank; "
          f"efficiency = per rank / one plain process)")
    for model, m in t["models"].items():
        print(f"  {model}: alone {m['alone_samples_per_sec']:.0f}; {t['np']} independent processes side by side "
              f"{m['independent_samples_per_sec_per_rank']:.0f} each (the ceiling per rank)")
        for impl, v in m["samples_per_sec_per_rank"].items():
            lo, hi = m["spread_per_rank"][impl]
            print(f"    {impl:<17} {v:8.0f}  [{lo:.0f}-{hi:.0f}]  efficiency {m['scaling_efficiency'][impl]:.2f}"
                  f"  of ceiling {m['fraction_of_independent'][impl]:.2f}")
    print(f"  hvdp / ddp = {t['hvdp_vs_ddp']:.2f}, hvdp / horovod-tuned = {t['hvdp_vs_horovod_tuned']:.3f} ({t['model']})")
    if "allreduce" in report:
        a = report["allreduce"]
        print(f"\nallreduce busbw (GB/s), np={a['np']}; memcpy {a['memcpy_GBps']:.2f} GB/s")
        sizes = sorted({r["bytes"] for r in a["results"]})
        print("  " + "impl".ljust(12) + "".join(f"{_human(s):>9}" for s in sizes))
        for impl in dict.fromkeys(r["impl"] for r in a["results"]):
            by = {r["bytes"]: r["busbw_GBps"] for r in a["results"] if r["impl"] == impl}
            print("  " + impl.ljust(12) + "".join(f"{by.get(s, float('nan')):9.3f}" for s in sizes)
                  + f"   {a['fraction_of_memcpy'][impl]:.2f}x memcpy at {_human(a['largest_bytes'])}")


def _human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
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
    models = report["training"]["models"]
    impls = list(next(iter(models.values()))["samples_per_sec_per_rank"])
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        right.bar([j + i * width for j in range(len(models))],
                  [m["samples_per_sec_per_rank"][impl] for m in models.values()], width, label=impl)
    right.bar([j + len(impls) * width for j in range(len(models))],
              [m["alone_samples_per_sec"] for m in models.values()], width, label="alone (np=1)", color="grey")
    right.set_xticks([j + 0.4 for j in range(len(models))], list(models))
    right.set_ylabel("samples/s per rank")
    right.set_title(f"training, np={report['training']['np']}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
