"""hvdp bench's sharded optimizer state on the GPT (issue 34): its targets over one variant's results (bench's
summary of a rotation with hvdp-sharded and ddp-zero), and its table; and `hvdp bench --memory-cap` (issue 45):
the largest GPT that trains under a per-rank memory cap, sharded and not (benchmarks/capped_worker.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable

from hvdp.tools import rotation

# Issue 34's targets at np=2: a sharded rank's optimizer state at most 1/N + 5% of the unsharded one's, and its
# samples/s at least these times the other's (ratio name -> the least).
STATE_SLACK = 0.05
THROUGHPUT = {"hvdp_sharded_vs_hvdp": 0.9, "hvdp_sharded_vs_ddp_zero": 1.0}
# Issue 45's: the sharded GPT's peak RSS rise at most this times the unsharded one's, and under one per-rank
# memory cap, the largest GPT that trains sharded at least CAP_TARGET times the unsharded one's parameters.
PEAK_RATIO, CAP_TARGET = 0.9, 1.4


def targets(m: dict, np_: int) -> dict:
    """Issue 34's targets on one GPT variant's results (bench._summary's, with hvdp-sharded and ddp-zero): the
    optimizer-state and gradient bytes of each sharded implementation over its unsharded one (rank 0's), the
    state's bound (1/N + 5%), and the throughput ratios (median of rounds, its interval) against their least."""
    mem, bound = m["memory"], 1 / np_ + STATE_SLACK
    pairs = {"hvdp-sharded/hvdp": ("hvdp-sharded", "hvdp"), "ddp-zero/ddp": ("ddp-zero", "ddp")}
    state = {k: mem[a]["optimizer_state_bytes"] / mem[b]["optimizer_state_bytes"] for k, (a, b) in pairs.items()}
    peak = mem["hvdp-sharded"]["peak_rss_rise_bytes"] / mem["hvdp"]["peak_rss_rise_bytes"]
    return {"state_bytes_ratio": state, "state_bytes_bound": bound,
            "state_bytes_met": state["hvdp-sharded/hvdp"] <= bound,
            "peak_rss_rise_ratio": peak, "peak_rss_rise_met": peak <= PEAK_RATIO,
            "gradient_bytes_ratio": {k: mem[a]["gradient_bytes"] / mem[b]["gradient_bytes"]
                                     for k, (a, b) in pairs.items()},
            "throughput": {name: {"ratio": m["ratios"][name], "interval": m["ratio_intervals"][name],
                                  "least": least, "met": m["ratios"][name] >= least}
                           for name, least in THROUGHPUT.items()}}


def print_table(model: str, m: dict, np_: int) -> None:
    """The sharded optimizer state's table: rank 0's memory per implementation, and issue 34's targets."""
    mib = 1 << 20
    print(f"  {model}: memory of rank 0, MiB (state and gradients: the tensors that exist after a step; peak RSS "
          f"rise: the resident set's peak over the run above it before the optimizer; anon: RssAnon's rise at "
          f"the end)")
    print(f"    {'impl':<17} {'opt state':>9} {'grads':>8} {'peak RSS':>9} {'anon':>8} {'samples/s':>10}")
    for impl, mem in m["memory"].items():
        if impl in m["samples_per_sec_per_rank"]:
            print(f"    {impl:<17} {mem['optimizer_state_bytes'] / mib:9.1f} {mem['gradient_bytes'] / mib:8.1f} "
                  f"{mem['peak_rss_rise_bytes'] / mib:9.1f} {mem['anon_rise_bytes'] / mib:8.1f} "
                  f"{m['samples_per_sec_per_rank'][impl]:10.0f}")
    s = m["sharded"]
    ratio = s["state_bytes_ratio"]
    print(f"    optimizer state hvdp-sharded/hvdp = {ratio['hvdp-sharded/hvdp']:.3f} (target <= 1/{np_} + 5% = "
          f"{s['state_bytes_bound']:.3f}: {'met' if s['state_bytes_met'] else 'NOT met'}); ddp-zero/ddp = "
          f"{ratio['ddp-zero/ddp']:.3f}; gradients hvdp-sharded/hvdp = "
          f"{s['gradient_bytes_ratio']['hvdp-sharded/hvdp']:.3f}, ddp-zero/ddp = "
          f"{s['gradient_bytes_ratio']['ddp-zero/ddp']:.3f}")
    if "peak_rss_rise_ratio" in s:
        print(f"    peak RSS rise hvdp-sharded/hvdp = {s['peak_rss_rise_ratio']:.3f} (target <= {PEAK_RATIO}: "
              f"{'met' if s['peak_rss_rise_met'] else 'NOT met'})")
    for name, r in s["throughput"].items():
        print(f"    {name} = {r['ratio']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}] (target >= "
              f"{r['least']}: {'met' if r['met'] else 'NOT met'})")


def largest(fits: Callable[[int], bool], low: int, high: int) -> tuple[int, dict]:
    """The largest n in [low, high] with fits(n), by bisection (fits is taken as monotone: a model that fits
    fits with fewer layers); `low` - 1 is taken to fit. Returns (n, {n probed: fitted}); n = low - 1 when none."""
    probed, lo, hi = {}, low - 1, high + 1  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probed[mid] = fits(mid)
        lo, hi = (mid, hi) if probed[mid] else (lo, mid)
    return lo, probed


def memory_cap(cap_mib: int, np_: int, launch: Callable[[list[str]], list[str]], env: dict, *, width: int = 512,
               max_layers: int = 32, timeout: float = 900) -> dict:
    """`hvdp bench --memory-cap`: under RLIMIT_DATA = cap_mib on every rank (the same for both), the largest GPT
    (benchmarks/models.py's, `width` wide, 1..max_layers blocks, AdamW, np_ ranks) that trains 3 steps, with
    hvdp's allreduce path and with its sharded optimizer state; the sharded search starts above the largest
    unsharded fit. `launch(worker args)` is the command line (horovodrun). Each probe is a whole job."""
    runs: dict = {}

    def probe(impl: str, layers: int) -> bool:
        cmd = launch(["--impl", impl, "--layers", str(layers), "--width", str(width), "--cap-mib", str(cap_mib)])
        start = time.monotonic()
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = job.communicate(timeout=timeout)
            out, rc = stdout + stderr, job.returncode
        except subprocess.TimeoutExpired:
            # the launcher and every rank below it: a rank left behind spun at 70% of a core for 1.5 hours
            rotation.kill_tree([job.pid])
            stdout, stderr = job.communicate()
            out, rc = stdout + stderr, "timeout"
        found = []
        for chunk in out.split("bench: ")[1:]:
            try:
                found.append(json.JSONDecoder().raw_decode(chunk)[0])
            except json.JSONDecodeError:
                pass
        fitted = rc == 0 and len(found) == np_
        why = next((line.strip() for line in out.splitlines() if "allocate" in line or "MemoryError" in line), None)
        runs.setdefault(impl, []).append({"layers": layers, "fits": fitted, "rc": rc, "seconds":
                                          round(time.monotonic() - start, 1), "ranks": found,
                                          **({} if fitted else {"why": (why or out[-300:])[-300:]})})
        print(f"[bench] memory cap {cap_mib} MiB: {impl} {layers} layer(s): "
              f"{'fits' if fitted else 'does not fit'}", flush=True)
        return fitted

    plain, _ = largest(lambda n: probe("hvdp", n), 1, max_layers)
    sharded, _ = largest(lambda n: probe("hvdp-sharded", n), plain + 1, max_layers)
    out = {"cap_mib": cap_mib, "cap": "RLIMIT_DATA per rank", "np": np_, "width": width, "max_layers": max_layers,
           "largest_layers": {"hvdp": plain, "hvdp-sharded": sharded}, "runs": runs}
    counted = {r["layers"]: r["ranks"][0]["parameters"] for rs in runs.values() for r in rs if r["fits"]}
    if plain >= 1:
        out["parameters"] = {"hvdp": counted[plain], "hvdp-sharded": counted[sharded]}
        out["parameters_ratio"] = out["parameters"]["hvdp-sharded"] / out["parameters"]["hvdp"]
        out["target"], out["met"] = CAP_TARGET, out["parameters_ratio"] >= CAP_TARGET
    return out


def print_cap(m: dict) -> None:
    print(f"\nlargest GPT (width {m['width']}, AdamW, np={m['np']}) that trains under a per-rank cap of "
          f"{m['cap_mib']} MiB ({m['cap']}; probed up to {m['max_layers']} layers)")
    for impl, layers in m["largest_layers"].items():
        params = m.get("parameters", {}).get(impl)
        print(f"  {impl:<13} {layers:3d} layer(s)" + (f"  {params / 1e6:7.1f}M parameters" if params else ""))
        for r in m["runs"].get(impl, []):
            peak = max((k["peak_rss_bytes"] for k in r["ranks"]), default=0) >> 20
            print(f"    {r['layers']:3d}: {'fits' if r['fits'] else 'no  '} {r['seconds']:6.0f} s"
                  + (f"  peak RSS {peak} MiB" if r["fits"] else f"  ({r.get('why', '')[:120]})"))
    if "parameters_ratio" in m:
        print(f"  parameters hvdp-sharded/hvdp = {m['parameters_ratio']:.2f} (target >= {m['target']}: "
              f"{'met' if m['met'] else 'NOT met'})")
