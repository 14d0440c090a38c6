"""`hvdp verify --zoo`: the N x b == 1 x N*b experiment on the models and recipes people train.

Each case is trained by N ranks through hvdp and by one plain process with the global batch at N*k times the
rate (equivalence.compare_torch: same initial weights, same samples, a plain torch optimizer, plain BatchNorm,
the fine-tuning calls made by the one process at the same step), and passes when the largest weight difference
is within TOLERANCE and the replicas are bit-identical. PyTorch cases run twice, through the allreduce path and
with prepare(..., shard_optimizer_state=True); all of them in ONE launch (a launch's cost is starting
processes that import torch). The Keras and TensorFlow cases are hvdp.tools.zoo_keras's CASES, when that module
exists, one launch on the TensorFlow backend and one on Keras's torch backend for those that apply.

The parent (run) starts the launches and prints one line per case; the workers (worker) train and print one
"zoo-case: {json}" record per case on rank 0. No framework is imported in the parent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# What "exact" means here (docs/verify.md): the two sides add the same numbers in another order (N partial sums
# of b samples averaged, against one sum over N*b), so float32 rounding leaves differences of 1e-8 to 1e-7
# after a few steps, and adaptive optimizers (Adam divides by the gradient's running magnitude) amplify them
# somewhat; a real mistake (a local gradient, an unscaled rate, a decayed frozen weight) moves weights by 1e-3
# or more. The same tolerance as `hvdp verify`'s default.
TOLERANCE = 1e-5
STEPS = 4          # whole optimizer steps per case, then the epoch's short last step (N*b - 1 samples)
BATCH_SIZE = 8     # per rank
# One launch's limit: the torch launch takes about 20 s at np=2 on 2 CPU cores, Keras's on TensorFlow about 50.
LAUNCH_TIMEOUT = 300
RECORD = "zoo-case: "
SUMMARY = "verify-zoo: "


@dataclass(frozen=True, slots=True)
class Case:
    """One torch zoo case: what compare_torch needs, what it proves, and a check that it still tests that."""
    name: str
    proves: str
    build: Callable
    optimizer: Callable              # (model, lr) -> a torch optimizer
    data: Callable                   # (n, model) -> tensors, target last
    lr: float
    loss: Callable | None = None     # (model, inputs, target) -> the batch's mean loss
    accumulate: int = 1
    sync_batchnorm: bool = False
    before_step: Callable | None = None
    exercised: Callable | None = None  # (result) -> None, or why the run did not exercise what the case proves
    paths: tuple[str, ...] = ("allreduce", "sharded")


# ------------------------------------------------------------------------------------------------ the cases
VOCAB, SEQ, CLASSES = 40, 10, 3


def _tokens(n: int, seed: int = 7):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n, SEQ), generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _features(n: int, shape=(12,), seed: int = 7):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _text_cnn():
    import torch
    from torch import nn

    class TextCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 12)
            self.conv = nn.Conv1d(12, 16, 3, padding=1)
            self.out = nn.Linear(16, CLASSES)

        def forward(self, tokens):
            h = torch.relu(self.conv(self.emb(tokens).transpose(1, 2)))
            return self.out(h.amax(dim=2))

    return TextCNN()


def _gru():
    from torch import nn

    class GRUClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 12)
            self.rnn = nn.GRU(12, 16, batch_first=True)
            self.out = nn.Linear(16, CLASSES)

        def forward(self, tokens):
            _, h = self.rnn(self.emb(tokens))
            return self.out(h[-1])

    return GRUClassifier()


def _tiny_lm():
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """One pre-norm transformer layer, causal attention over a padded batch, output tied to the input embedding."""
        def __init__(self, d: int = 16):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.1)
            self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, norm_first=True, bias=False)
            self.out = nn.Linear(d, VOCAB, bias=False)
            self.out.weight = self.emb.weight  # tied

        def forward(self, tokens, lengths):
            causal = torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1)
            padding = torch.arange(SEQ)[None, :] >= lengths[:, None]
            h = self.layer(self.emb(tokens) + self.pos, src_mask=causal, src_key_padding_mask=padding)
            return self.out(h)

    return TinyLM()


def _lm_data(n: int, model):
    import torch
    tokens, _ = _tokens(n)
    lengths = torch.randint(4, SEQ + 1, (n,), generator=torch.Generator().manual_seed(8))
    tokens[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # the padding token
    return tokens, lengths, lengths  # inputs (tokens, lengths); the target is in the tokens, lengths a stand-in


def _lm_loss(model, inputs, _):
    """Next-token loss, each sample's mean over its own positions, then the mean over samples: so that a batch's
    loss is the mean of its samples' and N ranks' average is one process's (a mean over all the batch's tokens
    would weigh a rank's tokens by its padding, which no data-parallel run can match)."""
    import torch
    import torch.nn.functional as F
    tokens, lengths = inputs
    logits = model(tokens, lengths)[:, :-1]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                                reduction="none").view(len(tokens), SEQ - 1)
    valid = (torch.arange(SEQ - 1)[None, :] < (lengths[:, None] - 1)).float()
    return ((per_token * valid).sum(1) / valid.sum(1)).mean()


EXPERTS = 4


def _moe():
    import torch
    from torch import nn

    class MoE(nn.Module):
        """Top-1 routing of each sample to one of EXPERTS experts, the output scaled by its gate; the last
        expert's router bias makes it rare, so in some steps no sample of the global batch reaches it."""
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(12, EXPERTS)
            self.experts = nn.ModuleList(nn.Linear(12, CLASSES) for _ in range(EXPERTS))
            with torch.no_grad():
                self.router.bias.copy_(torch.tensor([0.0] * (EXPERTS - 1) + [-0.8]))

        def forward(self, x):
            gates = torch.softmax(self.router(x), dim=-1)
            choice = gates.argmax(dim=-1)
            out = x.new_zeros(len(x), CLASSES)
            for e, expert in enumerate(self.experts):
                chosen = choice == e
                if chosen.any():
                    out[chosen] = expert(x[chosen]) * gates[chosen, e:e + 1]
            return out

    return MoE()


def _moe_exercised(result) -> str | None:
    unused = result.get("no_grad", {}).get(f"experts.{EXPERTS - 1}.weight", 0)
    if 0 < unused < result["steps"]:
        return None
    return (f"expert {EXPERTS - 1} got no gradient in {unused} of {result['steps']} steps of one process: the case "
            f"needs some steps with and some without it (change the router bias or the data)")


def _finetune():
    from torch import nn
    model = nn.Sequential()
    model.add_module("backbone", nn.Linear(12, 16))
    model.add_module("act1", nn.ReLU())
    model.add_module("mid", nn.Linear(16, 16))
    model.add_module("act2", nn.ReLU())
    model.add_module("adapter", nn.Linear(16, 16))
    model.add_module("act3", nn.ReLU())
    model.add_module("head", nn.Linear(16, CLASSES))
    for part in (model.backbone, model.mid, model.head):
        part.requires_grad_(False)
    return model


def _finetune_optimizer(model, lr):
    import torch
    # The head is in the optimizer from the start (frozen: no gradient, skipped); `mid` joins it at step 3.
    return torch.optim.AdamW([*model.adapter.parameters(), *model.head.parameters()], lr=lr, weight_decay=0.01)


def _unfreeze(step, model, optimizer, lr):
    """The two unfreezing recipes, at the same step on every side: the head with requires_grad_(True) at step 2,
    `mid` at step 3 with add_param_group at half the (base) rate."""
    if step == 2:
        model.head.requires_grad_(True)
    if step == 3:
        model.mid.requires_grad_(True)
        optimizer.add_param_group({"params": list(model.mid.parameters()), "lr": lr / 2})


def _bn_cnn():
    from torch import nn
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, CLASSES))


def _small_cnn():
    from torch import nn
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, CLASSES))


def _mlp():
    from torch import nn
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _adam(model, lr):
    import torch
    return torch.optim.Adam(model.parameters(), lr=lr)


def _adamw(model, lr):
    import torch
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _sgd(model, lr):
    import torch
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _adafactor(model, lr):
    import torch
    return torch.optim.Adafactor(model.parameters(), lr=lr)


def torch_cases() -> list[Case]:
    """The torch zoo, in the order it runs and prints."""
    def tokens(n, model):
        return _tokens(n)

    def features(n, model):
        return _features(n)

    return [
        Case("text-cnn", "nn.Embedding's dense gradient (rows of tokens absent from a rank's batch are zeros there) "
             "averaged as one process's, with Adam", _text_cnn, _adam, tokens, lr=0.005),
        Case("gru", "a recurrent layer over embeddings (Adam)", _gru, _adam, tokens, lr=0.005),
        Case("tiny-transformer", "tied input/output embeddings (one parameter, two uses), a causal and a "
             "padding mask, AdamW", _tiny_lm, _adamw, _lm_data, lr=0.005, loss=_lm_loss),
        Case("moe", "experts no rank routed to in a step stay untouched (grad None: AdamW neither decays nor "
             "moves them), experts some ranks used are averaged", _moe, _adamw, features, lr=0.005,
             exercised=_moe_exercised),
        Case("finetune", "a frozen backbone; the head unfrozen with requires_grad_(True) at step 2 and a layer "
             "added with add_param_group at step 3 train on the averaged gradient, at the scaled rate", _finetune,
             _finetune_optimizer, features, lr=0.005, before_step=_unfreeze),
        Case("syncbn", "prepare(sync_batchnorm=True): BatchNorm statistics and running buffers of the global "
             "batch, against plain nn.BatchNorm2d on it", _bn_cnn, _sgd,
             lambda n, model: _features(n, (2, 6, 6)), lr=0.02, sync_batchnorm=True),
        Case("adafactor", "torch.optim.Adafactor (row/column factored, shape-dependent): sharded state must keep "
             "each matrix whole", _mlp, _adafactor, features, lr=0.01),
        Case("accumulate", "backward_passes_per_step=2 with a short last step of one partial batch (AdamW)",
             _small_cnn, _adamw, lambda n, model: _features(n, (1, 6, 6)), lr=0.005, accumulate=2),
    ]


def expected_records(framework: str | None = None, keras_backend: str | None = None) -> list[tuple[str, str, str]]:
    """(framework, path, name) of every case line `hvdp verify --zoo` must print here."""
    return [record for part, backend in launches(framework, keras_backend) for record in _expected(part, backend)]


# ----------------------------------------------------------------------------------------------- the workers
def worker(part: str, steps: int = STEPS, batch_size: int = BATCH_SIZE) -> int:
    """Run one launch's cases on this rank: part 'torch', or 'keras' (Keras's backend is KERAS_BACKEND, set by
    the parent). Rank 0 prints one RECORD per case as it finishes. Exit status 0 (the parent judges)."""
    if part == "torch":
        return _torch_worker(steps, batch_size)
    if part == "lightning":
        from hvdp.lightning.verify import zoo_worker
        return zoo_worker(steps, batch_size)
    return _keras_worker(steps, batch_size)


def _torch_worker(steps: int, batch_size: int) -> int:
    import hvdp.torch as ht
    from hvdp.tools import equivalence

    world = ht.init()
    for case in torch_cases():
        for path in case.paths:
            def compute(case=case, path=path):
                result = equivalence.compare_torch(
                    build=case.build, optimizer=case.optimizer, data=case.data, loss=case.loss, lr=case.lr,
                    steps=steps, batch_size=batch_size, accumulate=case.accumulate, seed=0,
                    shard=path == "sharded", sync_batchnorm=case.sync_batchnorm, before_step=case.before_step)
                not_exercised = case.exercised(result) if case.exercised else None
                ok = result["max_abs_diff"] <= TOLERANCE and result["replicas_identical"] and not not_exercised
                return {"max_abs_diff": result["max_abs_diff"], "worst": result["worst"], "ok": ok,
                        "replicas_identical": result["replicas_identical"], "steps": result["steps"],
                        "causes": [] if ok else equivalence.explain(result), "not_exercised": not_exercised}
            _one(world.rank, {"name": case.name, "framework": "torch", "path": path}, compute)
    return 0


def _keras_worker(steps: int, batch_size: int) -> int:
    import hvdp.keras as hk
    from hvdp import _keras_backend
    from hvdp.tools import zoo_keras

    world = hk.init()
    backend = _keras_backend.name()
    for name, case in zoo_keras.CASES.items():
        if _applies(zoo_keras, name, backend):
            def compute(case=case):
                diff = float(case(steps=steps, batch_size=batch_size))
                return {"max_abs_diff": diff, "ok": diff <= TOLERANCE}
            framework = getattr(zoo_keras, "FRAMEWORKS", {}).get(name, "keras")
            _one(world.rank, {"name": name, "framework": framework, "path": backend}, compute)
    return 0


def _one(rank: int, record: dict, compute: Callable[[], dict]) -> None:
    """Run one case on this rank: `record` updated with compute()'s fields (or the error it raised: a case that
    raises on every rank is a FAIL, and the launch goes on to the next), printed on rank 0 as a line and a RECORD."""
    started = time.monotonic()
    record["tolerance"] = TOLERANCE
    try:
        record.update(compute())
    except Exception as e:  # noqa: BLE001 - whatever the case raised, the zoo reports it and goes on
        record.update(ok=False, error=_error(e))
    record["seconds"] = round(time.monotonic() - started, 2)
    if rank == 0:
        print(format_line(record), flush=True)  # for a launch made by hand; the parent prints its own
        print(RECORD + json.dumps(record, sort_keys=True), flush=True)


def _error(e: BaseException) -> str:
    """'Type: message (at file.py:line in function)': where it was raised, for the line and the report."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {str(e)[:400]}{where}"


def _applies(module, name: str, backend: str) -> bool:
    """Whether zoo_keras's case `name` runs on Keras `backend`: its FRAMEWORKS[name] ("keras": on either backend,
    "tensorflow": a TensorFlow loop, on TensorFlow only) or BACKENDS[name] (a tuple of backends) when the module
    says, else every case on TensorFlow and on torch those not named for TensorFlow ("tf" in the name)."""
    said = getattr(module, "BACKENDS", {}).get(name)
    if said is not None:
        return backend in said
    framework = getattr(module, "FRAMEWORKS", {}).get(name)
    if framework is not None:
        return framework == "keras" or backend == "tensorflow"
    return backend == "tensorflow" or not any(part in ("tf", "tensorflow") for part in name.replace("-", "_").split("_"))


# ------------------------------------------------------------------------------------------------ the parent
def keras_zoo_present() -> bool:
    """Whether hvdp.tools.zoo_keras exists and Keras can run here (found, not imported)."""
    return all(importlib.util.find_spec(m) is not None for m in ("hvdp.tools.zoo_keras", "keras"))


def keras_cases() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{case name: (its framework, "keras" or "tensorflow"; the Keras backends it runs on)} of hvdp.tools.zoo_keras,
    read from its source without importing it (that would import Keras): CASES's string keys when it is a dict literal, else its `case_<name>` functions;
    FRAMEWORKS and BACKENDS when they are literals (see _applies)."""
    import ast
    spec = importlib.util.find_spec("hvdp.tools.zoo_keras")
    if spec is None or not spec.origin:
        return {}
    tree = ast.parse(Path(spec.origin).read_text())
    names, said = [], {}
    for node in tree.body:
        targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if "CASES" in targets and isinstance(node.value, ast.Dict):
            names = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        for attribute in ("BACKENDS", "FRAMEWORKS"):
            if attribute in targets:
                try:
                    said[attribute] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    if not names:
        names = [n.name[len("case_"):] for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("case_")]

    module = type("Said", (), said)  # what _applies reads of the module
    return {name: (said.get("FRAMEWORKS", {}).get(name, "keras"),
                   tuple(b for b in ("tensorflow", "torch") if _applies(module, name, b))) for name in names}


def launches(framework: str | None, keras_backend: str | None) -> list[tuple[str, str | None]]:
    """(part, KERAS_BACKEND) of each launch `hvdp verify --zoo` makes for --framework and --keras-backend:
    torch's, then Keras's on TensorFlow (where TensorFlow is installed) and on torch, each where a case applies."""
    out = []
    if framework in (None, "torch"):
        out.append(("torch", None))
    if framework == "lightning":  # the torch cases through Lightning's Trainer: asked for by name only
        out.append(("lightning", None))
    if framework in (None, "keras", "tensorflow") and keras_zoo_present():
        backends = (keras_backend,) if keras_backend else ("tensorflow",) if framework == "tensorflow" else \
            ("tensorflow", "torch")
        installed = {b for b in backends if importlib.util.find_spec(b) is not None}
        applying = {b for _, bs in keras_cases().values() for b in bs}
        out += [("keras", b) for b in backends if b in installed and b in applying]
    return out


def run(args) -> int:
    """`hvdp verify --zoo`: the launches, one line per case, a summary and a JSON line; 1 if any case failed."""
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    records, failed_launches = [], []
    planned = launches(args.framework, args.keras_backend)
    if args.framework in ("keras", "tensorflow") and not planned:
        print("hvdp verify --zoo: no Keras cases in this hvdp (hvdp.tools.zoo_keras is missing)", file=sys.stderr)
        return 2
    for part, backend in planned:
        cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}"] + (["--gloo"] if args.gloo else [])
        cmd += [sys.executable, "-m", "hvdp.tools.cli", "verify", "--zoo", "--worker", "--zoo-part", part]
        env = dict(os.environ)
        if backend:
            env["KERAS_BACKEND"] = backend
        label = part if part in ("torch", "lightning") else f"keras on {backend}"
        print(f"hvdp verify --zoo ({label}): " + " ".join(cmd), flush=True)
        started, mine, tail = time.monotonic(), [], []
        env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120")  # a rank left in a collective: end the job
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        # A launch that hangs outside Horovod's collectives is ended too: its remaining cases print "no result".
        timer = threading.Timer(LAUNCH_TIMEOUT, _end, (proc,))
        timer.start()
        for line in proc.stdout:
            at = line.find(RECORD)
            if at >= 0:
                record = json.JSONDecoder().raw_decode(line[at + len(RECORD):])[0]
                mine.append(record)
                print(format_line(record), flush=True)
            else:
                tail = (tail + [line.rstrip("\n")])[-40:]
        code = proc.wait()
        timer.cancel()
        elapsed = time.monotonic() - started
        if elapsed >= LAUNCH_TIMEOUT:
            tail.append(f"hvdp verify --zoo: ended after {LAUNCH_TIMEOUT} s (zoo.LAUNCH_TIMEOUT)")
        expected = _expected(part, backend)
        missing = [e for e in expected if e not in {(r["framework"], r["path"], r["name"]) for r in mine}]
        for framework, path, name in missing:  # the launch ended before these (a crash, a hang the watchdog ended)
            record = {"name": name, "framework": framework, "path": path, "ok": False,
                      "tolerance": TOLERANCE, "error": f"no result: the launch ended (exit {code}) before this case"}
            mine.append(record)
            print(format_line(record), flush=True)
        if code != 0 or missing:
            failed_launches.append(label)
            print(f"hvdp verify --zoo ({label}): the launch exited {code}; its last lines:\n" + "\n".join(tail),
                  flush=True)
        print(f"hvdp verify --zoo ({label}): {len(mine)} cases in {elapsed:.1f} s", flush=True)
        records += mine
    passed = sum(r["ok"] for r in records)
    ok = passed == len(records) and not failed_launches
    print(f"hvdp verify --zoo: {passed} of {len(records)} cases PASS at np={args.np} "
          f"({'Gloo' if args.gloo else 'MPI'}); tolerance {TOLERANCE:g} -> {'PASS' if ok else 'FAIL'}")
    print(SUMMARY + json.dumps({"size": args.np, "gloo": args.gloo, "ok": ok, "cases": records,
                                "failed_launches": failed_launches}, sort_keys=True), flush=True)
    return 0 if ok else 1


def _end(proc) -> None:
    """End a launch that ran past LAUNCH_TIMEOUT: its whole process group (horovodrun and the ranks)."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _expected(part: str, backend: str | None) -> list[tuple[str, str, str]]:
    """The (framework, path, name) records a launch must print; for Keras whatever zoo_keras says applies."""
    if part == "torch":
        return [("torch", p, c.name) for c in torch_cases() for p in c.paths]
    if part == "lightning":
        return [("lightning", p, c.name) for c in torch_cases() for p in c.paths]
    return [(framework, backend, name) for name, (framework, backends) in keras_cases().items() if backend in backends]


def format_line(record: dict) -> str:
    """'torch/sharded   moe               max |dw| 8.9e-02  tolerance 1e-05  FAIL  (worst: ...; cause)'."""
    where = f"{record['framework']}/{record['path']}"
    if "max_abs_diff" in record:
        figure = f"max |dw| {record['max_abs_diff']:.2e}"
    else:
        figure = "max |dw| -       "
    verdict = "PASS" if record["ok"] else "FAIL"
    line = f"{where:<21} {record['name']:<18} {figure}  tolerance {record['tolerance']:g}  {verdict}"
    notes = []
    if record.get("error"):
        notes.append(record["error"])
    if not record["ok"] and record.get("worst"):
        notes.append(f"differs most: {record['worst']}")
    if record.get("replicas_identical") is False:
        notes.append("replicas differ")
    if record.get("not_exercised"):
        notes.append(f"case not exercised: {record['not_exercised']}")
    notes += [c.split(":")[0] for c in record.get("causes", [])]
    return line + (f"  ({'; '.join(notes)})" if notes else "")
