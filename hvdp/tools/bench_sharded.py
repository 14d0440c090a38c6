"""hvdp bench's sharded optimizer state on the GPT (issue 34): its targets over one variant's results (bench's
summary of a rotation with hvdp-sharded and ddp-zero), and its table."""

from __future__ import annotations

# Issue 34's targets at np=2: a sharded rank's optimizer state at most 1/N + 5% of the unsharded one's, and its
# samples/s at least these times the other's (ratio name -> the least).
STATE_SLACK = 0.05
THROUGHPUT = {"hvdp_sharded_vs_hvdp": 0.9, "hvdp_sharded_vs_ddp_zero": 1.0}


def targets(m: dict, np_: int) -> dict:
    """Issue 34's targets on one GPT variant's results (bench._summary's, with hvdp-sharded and ddp-zero): the
    optimizer-state and gradient bytes of each sharded implementation over its unsharded one (rank 0's), the
    state's bound (1/N + 5%), and the throughput ratios (median of rounds, its interval) against their least."""
    mem, bound = m["memory"], 1 / np_ + STATE_SLACK
    pairs = {"hvdp-sharded/hvdp": ("hvdp-sharded", "hvdp"), "ddp-zero/ddp": ("ddp-zero", "ddp")}
    state = {k: mem[a]["optimizer_state_bytes"] / mem[b]["optimizer_state_bytes"] for k, (a, b) in pairs.items()}
    return {"state_bytes_ratio": state, "state_bytes_bound": bound,
            "state_bytes_met": state["hvdp-sharded/hvdp"] <= bound,
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
    for name, r in s["throughput"].items():
        print(f"    {name} = {r['ratio']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}] (target >= "
              f"{r['least']}: {'met' if r['met'] else 'NOT met'})")
