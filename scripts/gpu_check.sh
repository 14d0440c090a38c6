#!/usr/bin/env bash
# The GPU check (docs/gpus.md): run from a checkout of hvdp on a machine with one NVIDIA GPU, Python 3.12 and
# torch 2.11 (CUDA 13), no MPI and no network. It installs what `make gpu-wheels` put in build/gpu-wheels
# (the CUDA + NCCL Horovod wheel built here, the few pure dependencies, the digits data) without network,
# then prints one `gpu-check: {json}` line per check and a last line with the total time.
#
#   bash scripts/gpu_check.sh [WHEEL_DIR]
#
# Environment: PYTHON (default python3); GPU_CHECK_DEVICE=cpu runs the same checks on the CPU (a dry run of
# the script itself, on any machine); GPU_CHECK_INSTALL=0 skips the install (an environment that has it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="${1:-$root/build/gpu-wheels}"
PY="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
export PYTHONPATH="$root:$root/examples:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=60
say() { echo "gpu-check: $1"; }
bin="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
# The JSON after the last "PREFIX" in file $2 ($1: the prefix), or {} when there is none.
last_json() { "$PY" - "$1" "$2" <<'EOF'
import json, sys
text = open(sys.argv[2], errors="replace").read()
at = text.rfind(sys.argv[1])
print(json.dumps(json.JSONDecoder().raw_decode(text[at + len(sys.argv[1]):])[0]) if at >= 0 else "{}")
EOF
}
tail_of() { tail -c 400 "$1" | tr '\n"' ' \047'; }

# 0. Install, offline: Horovod's wheel and its dependencies (hvdp itself runs from this checkout).
if [[ "${GPU_CHECK_INSTALL:-1}" == 1 ]]; then
    if "$PY" -m pip install -q --no-index --no-deps "$wheels"/*.whl >"$work/install.log" 2>&1; then
        say "{\"check\": \"install\", \"ok\": true, \"seconds\": $(( $(date +%s) - started ))}"
    else
        say "{\"check\": \"install\", \"ok\": false, \"detail\": \"$(tail_of "$work/install.log")\"}"
    fi
fi

# 1. The build: Horovod with PyTorch, Gloo and NCCL; the GPU torch sees.
"$PY" - "$DEVICE" >"$work/device.log" 2>&1 <<'EOF'
import json, sys
import torch
import hvdp.torch as ht
world = ht.init(device=sys.argv[1])
built = {k: bool(getattr(ht.hvd, k + "_built")()) for k in ("nccl", "gloo", "mpi", "cuda")}
print("gpu-check: " + json.dumps({
    "check": "build_and_device", "ok": built["nccl"] and ht.device().type == sys.argv[1], "horovod": built,
    "device": str(ht.device()), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "torch": torch.__version__, "cuda": torch.version.cuda}))
EOF
grep -h "^gpu-check: " "$work/device.log" || say "{\"check\": \"build_and_device\", \"ok\": false, \"detail\": \"$(tail_of "$work/device.log")\"}"

# 2. The main job on the GPU at np=1 (the bundled digits, carried as .npz: no scikit-learn needed there).
data="$wheels/digits.npz"
if [[ ! -f "$data" ]]; then  # no gpu-wheels: made here, where scikit-learn is installed
    data="$work/digits.npz"
    "$PY" -c "from sklearn.datasets import load_digits; import numpy as np
d = load_digits(); np.savez('$data', x=d.images[:, None] / 16.0, y=d.target)" 2>/dev/null
fi
t=$(date +%s)
"$PY" "$root/examples/train_torch.py" --device "$DEVICE" --data "$data" >"$work/train.log" 2>&1
r="$(last_json "result: " "$work/train.log")"
"$PY" -c "import json, sys; r = json.loads(sys.argv[1]); print('gpu-check: ' + json.dumps({'check': 'train_np1',
    'ok': r.get('test_accuracy', 0) >= 0.97, 'test_accuracy': r.get('test_accuracy'), 'seconds': $(date +%s) - $t}))" "$r"

# 3. hvdp verify on the GPU: 1 rank x batch 8 x 2 accumulated == 1 process x batch 16, with a short last step.
"$bin/horovodrun" -np 1 -H localhost:1 --gloo "$PY" -m hvdp.tools.cli verify --worker --framework torch \
    --device "$DEVICE" --accumulate 2 --optimizer adam --lr 0.005 >"$work/verify.log" 2>&1
say "$(last_json "verify: " "$work/verify.log" | "$PY" -c "import json, sys; v = json.load(sys.stdin)
print(json.dumps({'check': 'verify_np1', 'ok': bool(v.get('ok')), 'max_abs_diff': v.get('max_abs_diff'),
                  'device': v.get('device')}))")"

# 4. np=2 on the one GPU: NCCL refuses two ranks on one GPU; reported as it comes out.
HVDP_SHARE_GPUS=1 timeout 120 "$bin/horovodrun" -np 2 -H localhost:2 --gloo "$PY" -m hvdp.tools.cli verify --worker \
    --framework torch --device "$DEVICE" >"$work/np2.log" 2>&1
rc=$?
v="$(last_json "verify: " "$work/np2.log")"
"$PY" -c "import json, sys; v = json.loads(sys.argv[1]); print('gpu-check: ' + json.dumps({'check': 'np2_one_gpu',
    'outcome': ('pass' if v.get('ok') else 'fail') if v else 'refused', 'exit': $rc, 'max_abs_diff': v.get('max_abs_diff'),
    'detail': None if v else sys.argv[2]}))" "$v" "$(grep -m1 -iE "nccl|error" "$work/np2.log" | tr '"' "'" | cut -c1-300)"

# 5. The helpers on the device: SyncBatchNorm (np=1: BatchNorm's own path), evaluate with CPU data, bf16
#    autocast, and a checkpoint round trip that resumes bit-identically (the CUDA RNG of dropout included).
"$PY" - "$DEVICE" "$work/ckpt" >"$work/helpers.log" 2>&1 <<'EOF'
import json, sys
import torch, torch.nn.functional as F
import hvdp.torch as ht
ht.init(device=sys.argv[1])
dev = ht.device()
torch.manual_seed(0)
def build():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)).to(dev)
model = build()
opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), sync_batchnorm=True)
data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
loader = ht.shard(data, batch_size=32, seed=1, pin_memory=dev.type == "cuda")
def train(steps):
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        ht.check_finite(loss, i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
train(5)
ht.save_checkpoint(sys.argv[2], model, opt, epoch=1, step=0, global_step=5)
train(5)
after = [p.detach().clone() for p in model.parameters()]
ht.load_checkpoint(sys.argv[2], model, opt, loader)
train(5)
same = all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
metrics = ht.evaluate(model, data)
print("gpu-check: " + json.dumps({"check": "helpers", "ok": same and 0 <= metrics["accuracy"] <= 1,
      "resume_bit_identical": same, "evaluate": metrics, "sync_batchnorm": type(model[1]).__name__,
      "device": str(next(model.parameters()).device)}))
EOF
grep -h "^gpu-check: " "$work/helpers.log" || say "{\"check\": \"helpers\", \"ok\": false, \"detail\": \"$(tail_of "$work/helpers.log")\"}"

# 5b. 16-bit collectives on the GPU through NCCL. A prescale makes Horovod scale on the device, in the bf16
#     kernels csrc/horovod/patches/bfloat16.patch adds (one tensor: ScaleBufferCudaImpl; a fused group: the
#     batched scaled copy); each result is compared bit for bit with the scale done in float32, rounded once.
"$PY" - "$DEVICE" >"$work/bf16.log" 2>&1 <<'EOF'
import json, sys
import torch
import hvdp.torch as ht
ht.init(device=sys.argv[1])
hvd, dev = ht.hvd, ht.device()
torch.manual_seed(0)
results = {}
for dtype in (torch.bfloat16, torch.float16):
    xs = [torch.randn(n, device=dev).to(dtype) for n in (1001, 4096, 70001)]
    want = [(x.float() * 0.5).to(dtype) for x in xs]
    name = str(dtype).split(".")[1]
    one = hvd.allreduce(xs[0], op=hvd.Sum, prescale_factor=0.5, name=f"one.{name}")
    group = hvd.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=0.5, name=f"group.{name}")
    avg = hvd.allreduce(xs[1], op=hvd.Average, name=f"avg.{name}")
    bcast = hvd.broadcast(xs[2], root_rank=0, name=f"bcast.{name}")
    gathered = hvd.allgather(xs[0], name=f"gather.{name}")
    results[name] = {"single_scaled": torch.equal(one, want[0]), "grouped_scaled": all(map(torch.equal, group, want)),
                     "average": torch.equal(avg, xs[1]), "broadcast": torch.equal(bcast, xs[2]),
                     "allgather": torch.equal(gathered, xs[0]), "on": str(one.device)}
ok = all(v for r in results.values() for k, v in r.items() if k != "on")
print("gpu-check: " + json.dumps({"check": "collectives_16bit", "ok": ok, **results}))
EOF
grep -h "^gpu-check: " "$work/bf16.log" || say "{\"check\": \"collectives_16bit\", \"ok\": false, \"detail\": \"$(tail_of "$work/bf16.log")\"}"

# 6. Throughput: hvdp against plain PyTorch on the one GPU (the bench's GPT-style transformer, bf16 autocast).
for impl in hvdp alone; do
    "$PY" "$root/benchmarks/train_worker.py" --impl "$impl" --model gpt-bf16 --device "$DEVICE" --batch 32 \
        --threads "$OMP_NUM_THREADS" --warmup 5 --steps 20 --reps 3 >"$work/bench-$impl.log" 2>&1
done
"$PY" - "$(last_json "bench: " "$work/bench-hvdp.log")" "$(last_json "bench: " "$work/bench-alone.log")" <<'EOF'
import json, sys
h, a = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ok = bool(h and a)
print("gpu-check: " + json.dumps({"check": "throughput_gpt_bf16", "ok": ok, "hvdp_samples_per_sec": h.get("samples_per_sec"),
      "plain_torch_samples_per_sec": a.get("samples_per_sec"), "device": h.get("device"),
      "hvdp_vs_plain": h["samples_per_sec"] / a["samples_per_sec"] if ok else None}))
EOF
say "{\"check\": \"total\", \"seconds\": $(( $(date +%s) - started ))}"
