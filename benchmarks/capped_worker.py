"""One probe of `hvdp bench --memory-cap`: can this GPT train under a hard per-rank memory cap?

Each rank caps its own data segment (RLIMIT_DATA: the heap and every private writable mapping, what malloc and
torch's CPU allocator get memory from) at `--cap-mib` before anything is imported, builds benchmarks/models.py's
GPT with `--layers` blocks of `--width`, and trains `--steps` AdamW steps, sharded (hvdp-sharded) or not (hvdp).
An allocation past the cap fails (torch: "can't allocate memory"), the rank exits non-zero and the launcher ends
the job: the model does not fit. Every rank that finished prints `bench: {json}` with its peak resident set
(VmHWM) and data segment (VmData) at the end. A cgroup's memory.max would cap the resident set instead; this
caps what was allocated, touched or not (thread stacks and arenas included, the same in both runs).
"""

import argparse
import json
import resource
import sys
from pathlib import Path


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0]) << 10
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hvdp", "hvdp-sharded"], required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--cap-mib", type=int, default=0, help="RLIMIT_DATA per rank, MiB (0: none)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    if args.cap_mib:
        resource.setrlimit(resource.RLIMIT_DATA, (args.cap_mib << 20, args.cap_mib << 20))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.nn.functional as F

    import hvdp.torch as ht
    from models import GPT, batch

    world = ht.init(device="cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(width=args.width, layers=args.layers, heads=args.width // 64)
    optimizer = ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), lr_scaling="none",
                           shard_optimizer_state=args.impl == "hvdp-sharded")  # hvdp: 1/N of the state
    x, y = batch("gpt", args.batch, torch.Generator().manual_seed(world.rank))
    for _ in range(args.steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    now = _status()
    print("bench: " + json.dumps({"impl": args.impl, "rank": world.rank, "layers": args.layers, "width": args.width,
                                  "parameters": sum(p.numel() for p in model.parameters()), "cap_mib": args.cap_mib,
                                  "peak_rss_bytes": now["VmHWM"], "data_bytes": now["VmData"]}), flush=True)


if __name__ == "__main__":
    main()
