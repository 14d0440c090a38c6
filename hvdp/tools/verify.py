"""`hvdp verify`: prove on this machine that N ranks with batch b take the same steps as 1 process with N*b.

It launches N ranks (horovodrun on localhost, or runs directly when already started by a launcher). Each
rank initialises its model from a *different* seed, so the broadcast from rank 0 is tested too. Rank 0
also trains a private copy of the model as one plain process (no Horovod, no hvdp) on the union of the
ranks' batches, with the learning rate the scaling rule gives. After `--steps` optimizer steps it
compares the weights and prints the largest difference; the replicas must also be bit-identical.

`--sharded` (torch) runs the experiment through prepare(..., shard_optimizer_state=True) for SGD with
momentum, Adam and AdamW in one launch, each with two param groups and clipping by the global norm, and
through the allreduce path beside it: the sharded run must meet the same tolerance against one process. With
--amp fp16 both use a GradScaler, whose skip decisions the sharded optimizer makes agree across the ranks.

`--framework keras --keras-backend torch` runs hvdp.keras's model.fit on Keras's PyTorch backend (gradients through
horovod.torch), the one-process reference on the same backend.

`--model`'s random layers (Dropout, stochastic depth, random augmentation) are made deterministic for the check,
and the output says which and why (equivalence.deterministic_torch / deterministic_keras). A FAIL names the
weight that differs most and the likely causes the run can see (equivalence.explain). `--zoo` runs the
experiment on a model zoo instead (hvdp.tools.zoo).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

FRAMEWORKS = ("torch", "tensorflow", "keras", "lightning")
KERAS_BACKENDS = ("tensorflow", "torch")  # hvdp._keras_backend.BACKENDS (not imported here: it imports Keras)
OPTIMIZERS = ("sgd", "adam", "adamw")
TOLERANCE = 1e-5
# --sharded's default --clip: within the default model's gradient norms (0.32-0.63 over the 6 steps at np=2 and 3;
# each optimizer's smallest at np=2 is at most 0.403, its largest at np=3 at least 0.439),
# so some steps clip and some do not: a norm taken per shard (too small: nothing clips) and gradients summed
# instead of averaged (too large: every step clips) both move the weights.
SHARDED_CLIP = 0.42
# Under autocast the two sides round differently: one process's matmul over N*b samples against N matmuls
# over b, each rounded to the low precision, then averaged. Measured on the default model (5 steps and a
# short one, np=2): bf16 8.5e-5, fp16 9.3e-6 (fp32 1.5e-8); the defaults leave a factor of about 10, and a
# real mistake (an unscaled learning rate, a wrong weight) moves the weights by 1e-2 or more.
AMP_TOLERANCE = {"bf16": 1e-3, "fp16": 1e-4}
# Those were measured with SGD. Adam and AdamW divide each element's step by its gradient's running magnitude, so
# where that magnitude is tiny the two sides' rounding moves the weights by a good part of the learning rate:
# measured with --sharded, 1.0e-4-5.9e-2 under fp16 (np=2 and 3) and 1.1e-3-3.7e-2 under bf16 (np=2), the
# allreduce path as much, the sharded run within 5e-8 of it (2e-2 without --sharded, fp16 Adam, np=2). --sharded
# --amp therefore runs SGD by default; --optimizer adam or adamw needs a --tolerance of that size.
AMP_SHARDED_OPTIMIZERS = ("sgd",)


def add_arguments(parser) -> None:
    parser.add_argument("--framework", choices=FRAMEWORKS,
                        help="torch (default), tensorflow, keras or lightning (a LightningModule fit by the Trainer "
                             "on strategy='hvdp'; --model may return a LightningModule); with --zoo, the zoo's cases "
                             "of that framework only (default: all but lightning; lightning: the torch cases "
                             "through the Trainer)")
    parser.add_argument("--zoo", action="store_true",
                        help="run the model zoo (text CNN, GRU, transformer, mixture-of-experts, fine-tuning, "
                             "SyncBatchNorm, Adafactor, accumulation; torch on both paths, and Keras's cases): one "
                             "line per case, exit 1 if any fails; takes --np, --gloo, --framework, --keras-backend")
    parser.add_argument("--np", type=int, default=2, help="ranks to launch (default 2)")
    parser.add_argument("--gloo", action="store_true", help="use the Gloo controller instead of MPI")
    parser.add_argument("--model", metavar="MODULE:FACTORY",
                        help="your model: FACTORY() returns an untrained model (default: a small MLP)")
    parser.add_argument("--data", metavar="MODULE:FACTORY",
                        help="torch: your data: FACTORY() returns (inputs, targets) as arrays or tensors with the "
                             "samples first, or a map-style Dataset of (input, target) pairs; the first samples "
                             "the run needs are used (default: random inputs of --input-shape)")
    parser.add_argument("--input-shape", default="20", metavar="D[,D...]",
                        help="shape of one input sample for --model, e.g. 3,32,32 (default 20)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS,
                        help="sgd (momentum 0.9), adam or adamw (default sgd; with --sharded, all three, "
                             "with --sharded --amp sgd)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch b (default 8)")
    parser.add_argument("--accumulate", type=int, default=1, help="backward passes per step (default 1)")
    parser.add_argument("--leftover", type=int, metavar="L",
                        help="L more samples, so that the last step is short and its last global batch "
                             "partial, split unevenly among the ranks (default N*b - 1; 0 for whole steps only)")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="torch: the ranks train hvdp.torch.compile(model, backend=BACKEND), e.g. inductor; "
                             "the one process stays eager")
    parser.add_argument("--amp", choices=AMP_TOLERANCE,
                        help="torch: both sides under torch.autocast of this dtype (fp16 with a GradScaler)")
    parser.add_argument("--stream", type=int, metavar="WORKERS",
                        help="torch: the ranks read the data as a stream (an IterableDataset of unknown length) "
                             "with this many DataLoader workers (0: none)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="torch: where the ranks and the one process compute (default: HVDP_DEVICE, else auto: "
                             "each rank's own GPU when torch sees GPUs, else the CPU)")
    parser.add_argument("--sharded", action="store_true",
                        help="torch: the ranks train with prepare(..., shard_optimizer_state=True) (ZeRO-1/2), "
                             "with two param groups (different lr and weight decay) and --clip, beside the "
                             "allreduce path; each --optimizer (default: sgd, adam and adamw; with --amp sgd) "
                             "in one launch")
    parser.add_argument("--clip", type=float, metavar="MAX_NORM",
                        help=f"torch: both sides clip the gradients to this global norm before each step "
                             f"(default: none; with --sharded {SHARDED_CLIP:g})")
    parser.add_argument("--keras-backend", choices=KERAS_BACKENDS,
                        help="keras: the Keras backend both sides run on (default tensorflow, whatever KERAS_BACKEND "
                             "says); torch: fit's gradients go through horovod.torch")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--tolerance", type=float,
                        help="max |weight difference| allowed (default 1e-5; with --amp " +
                             ", ".join(f"{k} {v:g}" for k, v in AMP_TOLERANCE.items()) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse_suppress())
    parser.add_argument("--zoo-part", choices=("torch", "keras", "lightning"), default="torch", help=argparse_suppress())


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


def run(args) -> int:
    if args.zoo:
        return _zoo(args)
    args.framework = args.framework or "torch"
    for name in ("np", "steps", "batch_size", "accumulate"):
        if getattr(args, name) < 1:
            print(f"hvdp verify: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.leftover is not None and args.leftover < 0:
        print(f"hvdp verify: --leftover must be >= 0, got {args.leftover}", file=sys.stderr)
        return 2
    if args.stream is not None and args.stream < 0:
        print(f"hvdp verify: --stream must be >= 0, got {args.stream}", file=sys.stderr)
        return 2
    if args.sharded and args.framework not in ("torch", "lightning"):
        print(f"hvdp verify: --sharded is for --framework torch only (and lightning: HorovodStrategy("
              f"shard_optimizer_state=True)), got --framework {args.framework}: sharded "
              f"optimizer state (prepare(..., shard_optimizer_state=True)) exists in hvdp.torch only; "
              f"hvdp.tensorflow and hvdp.keras do not offer it", file=sys.stderr)
        return 2
    if args.clip is not None and not args.clip > 0:
        print(f"hvdp verify: --clip must be > 0, got {args.clip}", file=sys.stderr)
        return 2
    for name in ("compile", "amp", "stream", "device", "clip", "data"):
        if getattr(args, name) not in (None, False) and args.framework != "torch" and not (
                args.framework == "lightning" and name == "clip"):
            print(f"hvdp verify: --{name} is for --framework torch only", file=sys.stderr)
            return 2
    if args.keras_backend is not None and args.framework != "keras":
        print(f"hvdp verify: --keras-backend is for --framework keras only, got --framework {args.framework}",
              file=sys.stderr)
        return 2
    if args.sharded and args.clip is None:
        args.clip = SHARDED_CLIP
    if args.tolerance is None:
        args.tolerance = AMP_TOLERANCE[args.amp] if args.amp else TOLERANCE
    if args.worker or _launched():
        return _worker(args)
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}"]
    if args.gloo:
        cmd.append("--gloo")
    cmd += [sys.executable, "-m", "hvdp.tools.cli", "verify", "--worker"] + _forward(args)
    print("hvdp verify: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def _zoo(args) -> int:
    from hvdp.tools import zoo
    if args.np < 1:
        print(f"hvdp verify: --np must be >= 1, got {args.np}", file=sys.stderr)
        return 2
    given = [f"--{name.replace('_', '-')}" for name in ("model", "data", "optimizer", "sharded", "compile", "amp",
                                                          "stream", "clip", "tolerance", "leftover")
             if getattr(args, name) not in (None, False)]
    if given:
        print(f"hvdp verify: --zoo runs its own models, optimizers and tolerance ({zoo.TOLERANCE:g}); it takes "
              f"--np, --gloo, --framework and --keras-backend, not {', '.join(given)}", file=sys.stderr)
        return 2
    if args.keras_backend is not None and args.framework not in (None, "keras"):
        print(f"hvdp verify: --keras-backend is for --framework keras only, got --framework {args.framework}",
              file=sys.stderr)
        return 2
    if args.worker or _launched():
        return zoo.worker(args.zoo_part)
    return zoo.run(args)


def _launched() -> bool:
    return any(v in os.environ for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def _forward(args) -> list[str]:
    out = ["--framework", args.framework, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--accumulate", str(args.accumulate), "--lr", str(args.lr),
           "--tolerance", str(args.tolerance), "--seed", str(args.seed), "--input-shape", args.input_shape]
    out += ["--optimizer", args.optimizer] if args.optimizer else []
    out += ["--sharded"] if args.sharded else []
    out += ["--clip", repr(args.clip)] if args.clip is not None else []
    out += ["--leftover", str(args.leftover)] if args.leftover is not None else []
    out += ["--compile", args.compile] if args.compile else []
    out += ["--amp", args.amp] if args.amp else []
    out += ["--stream", str(args.stream)] if args.stream is not None else []
    out += ["--device", args.device] if args.device else []
    out += ["--keras-backend", args.keras_backend] if args.keras_backend else []
    out += ["--data", args.data] if args.data else []
    return out + (["--model", args.model] if args.model else [])


def load_factory(spec: str, flag: str = "--model"):
    """'package.module:function' -> the function."""
    import importlib
    module, sep, name = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"hvdp verify: {flag} must look like module:factory, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"hvdp verify: cannot load {flag} {spec!r}: {e}")


def _deterministic(factory, framework: str, changed: list):
    """`factory` whose models have their random layers made deterministic; `changed` gets what was changed."""
    from hvdp.tools import equivalence
    calm = equivalence.deterministic_torch if framework in ("torch", "lightning") else equivalence.deterministic_keras

    def build():
        model = factory()
        changed[:] = calm(model)
        return model
    return build


def _worker(args) -> int:
    from hvdp.tools import equivalence
    if args.device:
        os.environ["HVDP_DEVICE"] = args.device  # before hvdp.torch.init() chooses the rank's device
    if args.framework in ("keras", "tensorflow"):
        # Before Keras is imported (nothing here has imported it yet): the custom loop is TensorFlow's; fit runs
        # on --keras-backend, tensorflow unless asked, whatever the caller's KERAS_BACKEND says.
        os.environ["KERAS_BACKEND"] = args.keras_backend or "tensorflow"
    shape = tuple(int(d) for d in args.input_shape.split(","))
    changed: list[str] = []
    factory = _deterministic(load_factory(args.model), args.framework, changed) if args.model else None
    common = dict(steps=args.steps, batch_size=args.batch_size, accumulate=args.accumulate, lr=args.lr,
                  seed=args.seed, factory=factory, input_shape=shape, leftover=args.leftover)
    if args.framework == "torch":
        common.update(compile=args.compile, amp=args.amp, stream=args.stream, clip=args.clip,
                      data=load_factory(args.data, "--data") if args.data else None)
    if args.framework == "lightning":
        return _lightning_worker(args, factory, shape, changed)
    if args.sharded:
        return _sharded_worker(args, equivalence.sharded(
            optimizers=_sharded_optimizers(args), groups=2, **common), changed)
    optimizer = args.optimizer or "sgd"
    result = equivalence.run(args.framework, optimizer=optimizer, **common)
    return _report(args, result, changed, _setup(args, result, optimizer))


def _report(args, result: dict, changed: list[str], setup: str) -> int:
    """Rank 0 prints the verdict line (`setup`: what was compared) and the `verify: {json}` line; every rank
    returns the exit status (0: PASS)."""
    ok = result["max_abs_diff"] <= args.tolerance and result["replicas_identical"]
    if result["rank"] == 0:
        _print_deterministic(changed)
        print(f"{setup}: max |dw| = {result['max_abs_diff']:.3g} (tolerance {args.tolerance:g}); replicas "
              f"identical: {result['replicas_identical']} -> {'PASS' if ok else 'FAIL'}")
        causes = [] if ok else _print_failure(result)
        print("verify: " + json.dumps({**result, "tolerance": args.tolerance, "ok": ok,
                                       "deterministic_layers": changed, "causes": causes}, sort_keys=True),
              flush=True)
    return 0 if ok else 1


def _lightning_worker(args, factory, shape: tuple, changed: list[str]) -> int:
    """--framework lightning: the Trainer on strategy='hvdp' (HorovodStrategy(shard_optimizer_state=--sharded),
    gradient_clip_val=--clip) against one plain process; one line and one JSON line, as the torch experiment."""
    from hvdp.lightning import verify as lightning_verify
    optimizer = args.optimizer or "sgd"
    result = lightning_verify.run(optimizer=optimizer, steps=args.steps, batch_size=args.batch_size,
                                  accumulate=args.accumulate, lr=args.lr, seed=args.seed, factory=factory,
                                  input_shape=shape, leftover=args.leftover, shard=args.sharded, clip=args.clip)
    label = "its configure_optimizers" if result["lightning_module"] else optimizer
    return _report(args, result, changed, f"{_setup(args, result, label)}, Lightning's Trainer")


def _print_deterministic(changed: list[str]) -> None:
    from hvdp.tools.equivalence import RANDOM_LAYERS_WHY
    if changed:
        print(f"note: random layers made deterministic for the check: {', '.join(changed)}. Why: "
              f"{RANDOM_LAYERS_WHY}.")


def _print_failure(result: dict) -> list[str]:
    """A FAIL's explanation: the weight that differs most, then the likely causes; returns the causes."""
    from hvdp.tools.equivalence import explain
    if result.get("worst"):
        print(f"differs most: {result['worst']} (max |dw| = {result['max_abs_diff']:.3g})")
    causes = explain(result)
    for cause in causes:
        print(f"likely cause: {cause}")
    if not causes:
        print("likely cause: none that hvdp verify can see (per-rank data, BatchNorm without SyncBatchNorm, "
              "parameters unfrozen or added after prepare(), parameters without a gradient: none found); "
              "look for code that depends on the batch size or the rank")
    return causes


def _setup(args, result: dict, optimizer: str) -> str:
    """What was compared, in words: '2 ranks x batch 8 (x1 accumulated) vs 1 process x batch 16, sgd, ...'."""
    tail = f" + a last step of {result['leftover']} samples" if result.get("leftover") else ""
    tail += f", compiled ({result['compile']})" if result.get("compile") else ""
    tail += f", autocast {result['amp']}" if result.get("amp") else ""
    tail += f", read as a stream ({result['stream']} workers)" if result.get("stream") is not None else ""
    tail += f", on {result['device']}" if result.get("device", "cpu") != "cpu" else ""
    tail += f", Keras on {result['keras_backend']}" if result.get("keras_backend") else ""
    if result.get("clip") is not None:
        tail += f", clipped to norm {result['clip']:g} ({result['clipped_steps']} of {result['steps']} steps)"
    if result.get("sharded"):
        tail = (f", sharded state (ZeRO-1/2) over {result['parameters']} parameters in {result['groups']} "
                f"param groups" + tail)
    return (f"{result['size']} ranks x batch {args.batch_size} (x{args.accumulate} accumulated) vs 1 process x "
            f"batch {result['size'] * args.batch_size * args.accumulate}, {optimizer}, {args.steps} steps{tail}")


def _sharded_optimizers(args) -> tuple[str, ...]:
    """The optimizers --sharded runs: --optimizer, else all (SGD only under --amp: AMP_SHARDED_OPTIMIZERS)."""
    if args.optimizer:
        return (args.optimizer,)
    return AMP_SHARDED_OPTIMIZERS if args.amp else OPTIMIZERS


def _sharded_worker(args, outcome: dict, changed: list[str]) -> int:
    """One line per optimizer, then one JSON line: the largest sharded difference, and every case."""
    for case in outcome["cases"]:
        case["ok"] = case["max_abs_diff"] <= args.tolerance and case["replicas_identical"]
    ok = all(case["ok"] for case in outcome["cases"])
    if outcome["rank"] == 0:
        _print_deterministic(changed)
        for case in outcome["cases"]:
            print(f"{_setup(args, case, case['optimizer'])}: max |dw| = {case['max_abs_diff']:.3g} sharded, "
                  f"{case['allreduce_max_abs_diff']:.3g} allreduce path, {case['vs_allreduce_max_abs_diff']:.3g} "
                  f"between them (tolerance {args.tolerance:g}); replicas identical: {case['replicas_identical']}"
                  f" -> {'PASS' if case['ok'] else 'FAIL'}")
            case["causes"] = [] if case["ok"] else _print_failure(case)
        first = outcome["cases"][0]
        summary = {"rank": 0, "size": outcome["size"], "framework": "torch", "sharded": True,
                   "optimizers": [c["optimizer"] for c in outcome["cases"]],
                   "steps": first["steps"], "leftover": first["leftover"], "clip": first["clip"],
                   "parameters": first["parameters"],
                   "max_abs_diff": max(c["max_abs_diff"] for c in outcome["cases"]),
                   "replicas_identical": all(c["replicas_identical"] for c in outcome["cases"]),
                   "cases": outcome["cases"], "tolerance": args.tolerance, "ok": ok, "deterministic_layers": changed}
        print("verify: " + json.dumps(summary, sort_keys=True), flush=True)
    return 0 if ok else 1
