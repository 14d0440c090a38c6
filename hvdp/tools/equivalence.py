"""The N x b == 1 x N*b experiment behind `hvdp verify` and the equivalence tests.

Runs inside a launched job. Every rank builds the model from a different seed (so the broadcast is
exercised), trains `steps` optimizer steps through the hvdp adapter on its shard, and rank 0 replays the
same steps as one plain process on the union batches. Returns a dict on every rank:
{"rank", "size", "framework", "optimizer", "steps", "max_abs_diff", "replicas_identical"}. sharded() runs the
torch experiment with sharded optimizer state and through the allreduce path, per optimizer (`hvdp verify
--sharded`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hvdp._horovod import gather_or_raise
from hvdp.core.scaling import lr_multiplier
from hvdp.core.sharding import ShardPlan


def synthetic_data(n: int, input_shape: tuple[int, ...], classes: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *input_shape)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


# The optimizers `hvdp verify` compares (torch), by --optimizer name; each takes param_groups() and nothing else.
WEIGHT_DECAY = 0.01  # the first param group's, with groups=2


def _sgd(groups):
    import torch
    return torch.optim.SGD(groups, momentum=0.9)


def _adam(groups):
    import torch
    return torch.optim.Adam(groups)


def _adamw(groups):
    import torch
    return torch.optim.AdamW(groups)


OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def param_groups(module, lr: float, groups: int = 1) -> list[dict]:
    """One group at `lr`, or 2 as a fine-tuning recipe makes them: the matrices (dim >= 2) at `lr` with weight
    decay WEIGHT_DECAY, the biases and other vectors at lr / 2 without (an empty group is left out)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if groups == 1:
        return [{"params": params, "lr": lr}]
    out = [{"params": [p for p in params if p.dim() >= 2], "lr": lr, "weight_decay": WEIGHT_DECAY},
           {"params": [p for p in params if p.dim() < 2], "lr": lr / 2, "weight_decay": 0.0}]
    return [g for g in out if g["params"]]


def default_torch_model(input_shape: tuple[int, ...]):
    """The torch experiment's model when the user gives none: a small MLP of `input_shape` to 4 classes."""
    import torch
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def run(framework: str, **kw) -> dict:
    return {"torch": _torch, "tensorflow": _tensorflow, "keras": _keras}[framework](**kw)


def _leftover(leftover: int | None, size: int, batch_size: int) -> int:
    """How many samples the data has beyond whole steps: a last step of fewer than `accumulate` batches, its
    last global batch partial and split unevenly among the ranks (by default N*b - 1 samples: N ranks cannot
    split it evenly), which hvdp weights so that the step is one process's (ShardPlan.gradient_weight)."""
    if leftover is None:
        return size * batch_size - 1 if size > 1 else 0
    return leftover


def compare_torch(*, build, optimizer, data, lr: float, steps: int, batch_size: int, accumulate: int = 1,
                  leftover: int | None = None, seed: int = 0, loss=None, shard: bool = False,
                  sync_batchnorm: bool = False, before_step=None, compile: str | None = None,
                  amp: str | None = None, stream: int | None = None, clip: float | None = None,
                  keep: list | None = None) -> dict:
    """N ranks training `build()` through hvdp.torch against one plain torch process with the global batch.

    The one function behind `hvdp verify` (torch) and the torch cases of `hvdp verify --zoo`. Every rank builds
    the model from its own seed (the broadcast in prepare() is tested), trains `steps` optimizer steps of
    `accumulate` batches of `batch_size` on its shard, plus a short last step of `leftover` samples (default
    N*b - 1); rank 0 replays the same steps as one process on a deep copy of its initial model, with a plain
    torch optimizer at N*k times the rate (the linear rule, written out here) and nothing of hvdp's.

    build(): a new model. optimizer(model, lr): a new torch optimizer over it at base rate lr.
    data(n, model): n samples as tensors (or arrays) with the samples on the first axis, the target last; every
    rank must make the same (a digest of them is compared). loss(model, inputs, target): the batch's mean loss
    (default: cross-entropy of model(*inputs)). before_step(step, model, optimizer, lr): called on both sides
    before each optimizer step's first forward pass, with that side's model, optimizer and base rate (what a
    fine-tuning recipe does: requires_grad_(True), add_param_group). sync_batchnorm and shard: prepare()'s
    sync_batchnorm and shard_optimizer_state. compile, amp, stream, clip: see _torch. keep: a list the
    ranks' trained model is appended to.

    Returns on every rank: {"rank", "size", "steps", "max_abs_diff", "worst" (the state_dict entry that differs
    most), "replicas_identical", ...} and what explain() reads: "data_identical", "data_problem",
    "no_grad" ({parameter: steps in which one process's backward gave it no gradient}), "unfrozen_after_prepare",
    "added_after_prepare", "plain_batchnorm"."""
    import copy

    import torch

    import hvdp.torch as ht
    from hvdp.core.errors import DivergenceError

    world = ht.init()
    torch.manual_seed(seed + 1000 * world.rank + 1)  # deliberately different initial weights per rank
    model = build()
    leftover = _leftover(leftover, world.size, batch_size)
    n = steps * accumulate * world.size * batch_size + leftover
    tensors = tuple(torch.as_tensor(t) for t in data(n, model))
    digest = _digest(t.cpu().numpy() for t in tensors)
    digests = ht.hvd.allgather_object(digest, name="hvdp.verify.digest") if world.size > 1 else [digest]
    common = {"rank": world.rank, "size": world.size, "framework": "torch", "accumulate": accumulate,
              "leftover": leftover, "compile": compile, "amp": amp, "stream": stream, "sharded": shard, "clip": clip,
              "sync_batchnorm": sync_batchnorm, "parameters": sum(p.numel() for p in model.parameters()),
              "data_identical": len(set(digests)) == 1}
    if not common["data_identical"]:  # per-rank data: no step of theirs is one process's; nothing to compare
        other = [r for r, d in enumerate(digests) if d != digests[0]]
        if keep is not None:
            keep.append(model)
        return {**common, "steps": 0, "device": "cpu", "clipped_steps": 0, "max_abs_diff": float("inf"),
                "worst": None, "replicas_identical": False, "no_grad": {}, "unfrozen_after_prepare": [],
                "added_after_prepare": [], "plain_batchnorm": [],
                "data_problem": f"rank(s) {', '.join(map(str, other))} made other data than rank 0; nothing was trained"}
    where = ht.device()  # the rank's GPU when there is one: both sides compute there
    model.to(where)
    # Rank 0's initial weights are what every rank holds after the broadcast in prepare().
    reference = copy.deepcopy(model) if world.rank == 0 else None
    loss = loss or _cross_entropy
    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]

    def loss_of(module, batch):
        with torch.autocast(where.type, dtype=dtype, enabled=dtype is not None):
            return loss(module, tuple(t.to(where) for t in batch[:-1]), batch[-1].to(where))

    def scaler():  # fp16 gradients underflow without loss scaling; bf16 and fp32 need none
        return torch.amp.GradScaler(where.type, enabled=amp == "fp16")

    inner = optimizer(model, lr)
    in_optimizer, groups = [p for g in inner.param_groups for p in g["params"]], len(inner.param_groups)
    dist = ht.prepare(model, inner, backward_passes_per_step=accumulate, shard_optimizer_state=shard,
                      sync_batchnorm=sync_batchnorm)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    forward = ht.compile(model, backend=compile) if compile else model
    indexed = (torch.arange(n), *tensors)  # which samples each rank trains on, checked against one process's
    if stream is None:
        loader = ht.shard(torch.utils.data.TensorDataset(*indexed), batch_size=batch_size, seed=seed)
        batches = len(loader)
    else:
        loader = ht.shard(_pair_stream(*indexed), batch_size=batch_size, seed=seed, num_workers=stream)
        batches = None  # unknown until the stream ends: the short last step comes after the loop
    scale, i, clipped, seen = scaler(), -1, [], []

    def clip_(module, opt):  # the global norm of the averaged gradients, as one process clips its own
        if clip is None:
            return
        norm = opt.clip_grad_norm_(clip) if shard and opt is dist else \
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        if opt is dist:
            clipped.append(float(norm) > clip)

    def step():
        if scale.is_enabled() or (clip is not None and not shard):
            dist.synchronize()  # the all-reduce first, then unscale: every rank sees the same inf/NaN
            scale.unscale_(dist)
            clip_(model, dist)
            with dist.skip_synchronize():
                scale.step(dist)
            scale.update()
        else:
            clip_(model, dist)  # sharded: reduce-scatter, then the norm across the shards
            dist.step()
        dist.zero_grad()

    later = set()  # parameters trainable at some step that were not at prepare()
    for i, (index, *batch) in enumerate(loader):
        if i % accumulate == 0:
            if before_step is not None:
                before_step(len(seen), model, dist, lr)
            later |= {name for name, p in model.named_parameters() if p.requires_grad} - trainable
            seen.append([])
        seen[-1] += index.tolist()
        scale.scale(loss_of(forward, batch)).backward()
        if (i + 1) % accumulate == 0 or i + 1 == batches:
            step()
    if batches is None and (i + 1) % accumulate:
        step()

    try:
        ht.check_consistency(model)
        identical = True
    except DivergenceError:
        identical = False
    # Parameters that joined the optimizer after prepare(): those training now that were not in it then, when it
    # has more param groups than then (the sharded layout keeps flat shards in its groups: not looked into).
    known = {id(p) for p in in_optimizer}
    added = sorted(name for name, p in model.named_parameters() if p.requires_grad and id(p) not in known) \
        if len(dist.param_groups) > groups else []
    plain_bn = sorted(name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      and not isinstance(m, (ht.SyncBatchNorm, torch.nn.SyncBatchNorm)))

    def reference_run():  # rank 0 alone: one process with the global batch, from the same initial weights
        gathered = ht.hvd.allgather_object(seen, name="hvdp.verify.seen") if world.size > 1 else [seen]
        if reference is None:
            return None
        rate = lr * world.size * accumulate  # one process at N*k times the rate: the linear rule
        ref_opt = optimizer(reference, rate)
        plan = ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed, shuffle=stream is None)
        ref_scale, no_grad, global_batches = scaler(), {}, list(plan.batches(epoch=0))
        ref_params = dict(reference.named_parameters())
        for s, idx in enumerate(global_batches):
            if before_step is not None:
                before_step(s, reference, ref_opt, rate)
            idx = torch.from_numpy(idx)
            ref_scale.scale(loss_of(reference, tuple(t[idx] for t in tensors))).backward()
            for name, p in ref_params.items():
                if p.requires_grad and p.grad is None:
                    no_grad[name] = no_grad.get(name, 0) + 1
            ref_scale.unscale_(ref_opt)
            clip_(reference, ref_opt)
            ref_scale.step(ref_opt)
            ref_scale.update()
            ref_opt.zero_grad()
        ours, theirs = model.state_dict(), reference.state_dict()
        diffs = {k: float((v.double() - theirs[k].double()).abs().max()) if v.numel() else 0.0
                 for k, v in ours.items()}
        worst = max(diffs, key=diffs.get)
        return {"max_abs_diff": diffs[worst], "worst": worst, "no_grad": no_grad,
                "data_problem": _data_problem(gathered, global_batches, n)}

    # An error in rank 0's reference run is raised on every rank (the others would wait for its result).
    outcome = gather_or_raise(ht.hvd, reference_run, name="hvdp.verify.diff", operation="hvdp verify")[0]
    if keep is not None:
        keep.append(model)
    return {**common, "steps": len(seen), "device": str(where), "clipped_steps": sum(clipped),
            "replicas_identical": identical, "unfrozen_after_prepare": sorted(later), "added_after_prepare": added,
            "plain_batchnorm": plain_bn, **outcome}


def explain(result: dict) -> list[str]:
    """The likely causes of a FAIL that the run can see, each "cause: why, and the fix", most likely first:
    per-rank data, the samples trained on, plain BatchNorm, parameters unfrozen or added after prepare(), and
    parameters that got no gradient in some steps. Empty when it sees none. Reads compare_torch's (and
    _keras_result's) fields; a result without one of them says nothing about that cause."""
    out = []
    if result.get("data_identical") is False:
        out.append("per-rank data: the training data differs between the ranks (its digest on some rank is not "
                   "rank 0's), so they do not train on the one data set one process reads; build it from a fixed "
                   "seed on every rank (torch.manual_seed / np.random.default_rng(seed) before making it)")
    if result.get("data_problem"):
        out.append(f"the samples: {result['data_problem']}")
    if result.get("plain_batchnorm") and result.get("size", 1) > 1:
        layers = result["plain_batchnorm"]
        which = f"layer {layers[0]} normalises" if len(layers) == 1 else f"layers {', '.join(layers[:4])} normalise"
        out.append(f"BatchNorm without SyncBatchNorm: {which} each rank's batch on its own, one process the global "
                   f"batch; use prepare(..., sync_batchnorm=True) (Keras: hvdp.keras.SyncBatchNormalization)")
    if result.get("unfrozen_after_prepare"):
        names = ", ".join(result["unfrozen_after_prepare"][:4])
        out.append(f"a parameter without a gradient hook: {names} began to require gradients after prepare() "
                   f"(requires_grad_(True) later), and prepare() set up the gradient averaging for the parameters "
                   f"that required them at the call")
    if result.get("added_after_prepare"):
        names = ", ".join(result["added_after_prepare"][:4])
        out.append(f"a parameter added after prepare(): {names} joined the optimizer with add_param_group() after "
                   f"prepare()")
    if result.get("no_grad"):
        names = ", ".join(f"{k} ({v} of {result.get('steps', '?')} steps)" for k, v in list(result["no_grad"].items())[:4])
        out.append(f"a parameter that got no gradient: in one process {names}: its optimizer skips a parameter "
                   f"whose grad is None (no decay, no moment update); N ranks must skip it too")
    return out


# Why `hvdp verify --model` makes random layers deterministic (printed with the layers it changed).
RANDOM_LAYERS_WHY = ("their masks and noise are drawn on each rank from its own random stream, so no data-parallel "
                     "run can match one process bit for bit with them on; the check proves the rest of the "
                     "training step, and a random layer is per-sample (nothing in it is averaged across ranks)")


def deterministic_torch(model) -> list[str]:
    """Make `model`'s random layers deterministic for the check, in place; return "name (Class: what)" for each.

    Dropout layers (nn.Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout) with p > 0 and stochastic
    depth (torchvision's StochasticDepth, timm's DropPath) go to eval mode; a recurrent layer's or
    MultiheadAttention's dropout becomes 0; a random augmentation module without parameters (a torchvision
    transform named Random*) becomes the identity."""
    import torch
    changed = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.eval()
            changed.append(f"{name} ({kind} p={m.p:g}: eval mode)")
        elif kind in ("StochasticDepth", "DropPath"):
            m.eval()
            changed.append(f"{name} ({kind}: eval mode)")
        elif isinstance(m, (torch.nn.RNNBase, torch.nn.MultiheadAttention)) and getattr(m, "dropout", 0) > 0:
            changed.append(f"{name} ({kind} dropout={m.dropout:g}: 0)")
            m.dropout = 0.0
        elif kind.startswith(("Random", "RandAugment", "AutoAugment", "TrivialAugment", "AugMix")) and \
                not any(True for _ in m.parameters()):
            m.forward = _identity
            changed.append(f"{name} ({kind}: the identity)")
    return changed


def _identity(x, *args, **kwargs):
    return x


def deterministic_keras(model) -> list[str]:
    """deterministic_torch for a Keras model: Dropout, SpatialDropout*, GaussianDropout and AlphaDropout get
    rate 0, GaussianNoise stddev 0, and the random augmentation layers (Random*, RandAugment, AugMix) become
    the identity. Call it before compile() and fit (they trace the layers' calls then)."""
    changed = []
    for layer in _keras_layers(model):
        kind = type(layer).__name__
        if hasattr(layer, "rate") and ("Dropout" in kind) and layer.rate > 0:
            changed.append(f"{layer.name} ({kind} rate={layer.rate:g}: 0)")
            layer.rate = 0.0
        elif kind == "GaussianNoise" and layer.stddev > 0:
            changed.append(f"{layer.name} ({kind} stddev={layer.stddev:g}: 0)")
            layer.stddev = 0.0
        elif kind.startswith(("Random", "RandAugment", "AugMix")):
            layer.call = _identity
            changed.append(f"{layer.name} ({kind}: the identity)")
    return changed


def _keras_layers(model):
    """Every layer inside `model`, nested models' and custom layers' sublayers included."""
    return model._flatten_layers(include_self=False, recursive=True)


def user_data(made, n: int):
    """The first `n` samples of `hvdp verify --data`'s FACTORY() result: (inputs, targets) as arrays or tensors with
    the samples first, or a map-style Dataset of (input, target) pairs."""
    import torch
    if isinstance(made, (tuple, list)) and len(made) == 2:
        inputs, targets = (torch.as_tensor(t) for t in made)
    else:
        size = len(made)
        pairs = [made[i] for i in range(min(n, size))]
        inputs = torch.stack([torch.as_tensor(p[0]) for p in pairs]) if pairs else torch.zeros(0)
        targets = torch.as_tensor([int(p[1]) for p in pairs]) if pairs else torch.zeros(0)
    if len(inputs) < n:
        raise ValueError(f"--data has {len(inputs)} samples and the run needs {n} (steps x accumulate x ranks x "
                         f"batch size, plus --leftover): lower --steps or --batch-size, or give more data")
    return inputs[:n], targets[:n]


def _cross_entropy(model, inputs, target):
    import torch.nn.functional as F
    return F.cross_entropy(model(*inputs), target)


def _digest(arrays) -> str:
    import hashlib
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _data_problem(seen: list[list[list[int]]], global_batches: list, n: int) -> str | None:
    """What is wrong with the samples the ranks trained on (seen[rank][step]: sample indices), against one
    process's global batches; None when every step's samples are its global batch's. A sample a rank repeats in
    the last step to top up a global batch smaller than the world counts once (hvdp weighs it 0)."""
    steps = {len(s) for s in seen}
    if steps != {len(global_batches)}:
        return (f"the ranks took {'/'.join(str(len(s)) for s in seen)} optimizer steps, one process "
                f"{len(global_batches)}")
    for s, expected in enumerate(global_batches):
        got = set().union(*(set(r[s]) for r in seen))
        if got != set(expected.tolist()):
            missing, extra = sorted(set(expected.tolist()) - got), sorted(got - set(expected.tolist()))
            return (f"in step {s} the ranks trained on samples one process's batch does not hold ({extra[:5]}) "
                    f"or missed some of its samples ({missing[:5]})")
    return None


def _torch(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
           factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None,
           compile: str | None = None, amp: str | None = None, stream: int | None = None,
           shard: bool = False, clip: float | None = None, groups: int = 1, keep: list | None = None,
           data=None) -> dict:
    """`hvdp verify`'s torch experiment: `factory()` (default a small MLP) on synthetic data of `input_shape`
    (or `data()`'s: see user_data), trained with `optimizer` (OPTIMIZERS) over `groups` param groups.
    `compile`: the ranks train hvdp.torch.compile(model, backend=compile), the reference stays eager.
    `amp` ("bf16" or "fp16"): both sides run the forward pass under torch.autocast of that dtype, fp16 with
    a GradScaler (the recipe of docs/pytorch.md: unscale after the all-reduce).
    `stream` (a number of DataLoader workers, 0 for none): the ranks read the data as a stream of unknown
    length (an IterableDataset) and step after the loop for a short last accumulation; the reference reads
    it in the stream's order.
    `shard`: the ranks train with prepare(..., shard_optimizer_state=True) (ZeRO-1/2).
    `clip`: both sides clip the (averaged) gradients to this global norm before each step (the sharded
    optimizer's clip_grad_norm_, else torch.nn.utils.clip_grad_norm_ after synchronize()).
    `keep`: a list the trained model is appended to (every rank), for a comparison between runs."""
    import torch

    def build():
        return factory() if factory is not None else default_torch_model(input_shape)

    def samples(n, model):
        if data is not None:
            return user_data(data(), n)
        with torch.no_grad():
            classes = model(torch.zeros(2, *input_shape)).shape[-1]  # before the model moves to the rank's device
        return synthetic_data(n, input_shape, classes, seed)

    result = compare_torch(build=build, optimizer=lambda module, rate: OPTIMIZERS[optimizer](
                               param_groups(module, rate, groups)),
                           data=samples, lr=lr, steps=steps, batch_size=batch_size, accumulate=accumulate,
                           leftover=leftover, seed=seed, shard=shard, compile=compile, amp=amp, stream=stream,
                           clip=clip, keep=keep)
    return {**result, "optimizer": optimizer, "groups": groups}


def _uneven_mlp(input_shape: tuple[int, ...]):
    """--sharded's default model: 763 parameters at input 20, divisible by neither 2 nor 3. Under
    param_groups(..., 2) the matrices' bucket (725 elements) splits unevenly among 2 and 3 ranks (363/362,
    242/242/241), the vectors' (38) among 3 (13/13/12)."""
    import torch
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 19), torch.nn.Tanh(),
                               torch.nn.Linear(19, 15), torch.nn.Tanh(), torch.nn.Linear(15, 4))


def sharded(*, optimizers: tuple[str, ...], **kw) -> dict:
    """`hvdp verify --sharded`: for each optimizer, the same run through prepare(..., shard_optimizer_state=True)
    and through the allreduce path, from the same initial weights and data, each compared with one process
    (two param groups, clipping when kw has a clip). Returns {"rank", "size", "cases": [...]}: per optimizer
    the sharded run's result, with "allreduce_max_abs_diff" (the allreduce path against one process) and
    "vs_allreduce_max_abs_diff" (the two runs' weights against each other, on this rank)."""
    if kw.get("factory") is None:
        kw["factory"] = functools.partial(_uneven_mlp, kw.get("input_shape", (20,)))
    cases = []
    for name in optimizers:
        trained: list = []
        plain = _torch(optimizer=name, shard=False, keep=trained, **kw)
        result = _torch(optimizer=name, shard=True, keep=trained, **kw)
        unsharded, zero = (m.state_dict().values() for m in trained)
        result["allreduce_max_abs_diff"] = plain["max_abs_diff"]
        result["allreduce_replicas_identical"] = plain["replicas_identical"]
        result["vs_allreduce_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(zero, unsharded))
        cases.append(result)
    return {"rank": cases[0]["rank"], "size": cases[0]["size"], "cases": cases}


def _pair_stream(*tensors):
    """(t[i] for t in tensors) for i in order, as a stream: an IterableDataset without len()."""
    return __getattr__("_PairStream")(*tensors)


def __getattr__(name: str):
    # _PairStream is made on first use (this module imports torch only when the torch experiment runs), and
    # found by name, as pickle finds it in the DataLoader's worker processes that shard() starts by forkserver.
    if name != "_PairStream":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    class _PairStream(torch.utils.data.IterableDataset):
        def __init__(self, *tensors):
            self.tensors = tensors

        def __iter__(self):
            return zip(*self.tensors)

    _PairStream.__module__, _PairStream.__qualname__ = __name__, "_PairStream"
    globals()["_PairStream"] = _PairStream
    return _PairStream


def _keras_setup(framework: str, *, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float,
                 seed: int, factory, input_shape: tuple[int, ...], leftover: int | None):
    """What the TensorFlow and Keras experiments share: rank-dependent model, data, rank 0's reference copy.
    "keras" runs on Keras's backend (KERAS_BACKEND: TensorFlow or torch, the ranks and the reference alike)."""
    import keras

    if framework == "keras":
        import hvdp.keras as hk
        world = hk.init()  # horovod.torch on Keras's torch backend, horovod.tensorflow on TensorFlow
    else:
        import hvdp.tensorflow as htf
        world = htf.init()

    def build():
        if factory is not None:
            return factory()
        return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                                 keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])

    makers = {"sgd": lambda rate: keras.optimizers.SGD(rate, momentum=0.9), "adam": keras.optimizers.Adam,
              "adamw": keras.optimizers.AdamW}  # hvdp verify's OPTIMIZERS; AdamW with Keras's weight decay

    def make_optimizer(rate):
        return makers[optimizer](rate)

    keras.utils.set_random_seed(seed + 1000 * world.rank + 1)  # deliberately different weights (and TF seed) per rank
    model = build()
    classes = int(model.output_shape[-1])
    leftover = _leftover(leftover, world.size, batch_size)
    n = steps * accumulate * world.size * batch_size + leftover
    x, y = synthetic_data(n, input_shape, classes, seed)
    reference = None
    if world.rank == 0:  # rank 0's initial weights are what every rank holds after the broadcast
        reference = build()
        reference.set_weights(model.get_weights())
    multiplier = lr_multiplier("linear", world.size, backward_passes_per_step=accumulate)
    return world, model, reference, make_optimizer, x, y, n, multiplier, leftover


def _keras_result(framework, world, model, reference, x, y, n, *, batch_size, accumulate, optimizer,
                  optimizer_class, steps, seed, leftover, replay) -> dict:
    import numpy as np_

    import hvdp.tensorflow as htf
    from hvdp import _keras_backend
    from hvdp.core.errors import DivergenceError

    try:
        htf.check_consistency(model)
        identical = True
    except DivergenceError:
        identical = False
    def reference_diff():  # rank 0 alone; an error there is raised on every rank
        if reference is None:
            return None
        plan = ShardPlan(n=n, batch_size=batch_size * world.size * accumulate, seed=seed)
        for idx in plan.batches(epoch=0):
            replay(x[idx], y[idx])
        diffs = [float(np_.max(np_.abs(np_.asarray(a) - np_.asarray(b)))) if np_.size(a) else 0.0
                 for a, b in zip(model.get_weights(), reference.get_weights())]
        worst = int(np_.argmax(diffs))
        return {"max_abs_diff": diffs[worst], "worst": getattr(model.weights[worst], "path", model.weights[worst].name)}

    # hvdp.keras's Horovod is the one of Keras's backend (horovod.torch on torch); the custom loop's is TensorFlow's.
    horovod = _keras_backend.horovod() if framework == "keras" else htf.hvd
    outcome = gather_or_raise(horovod, reference_diff, name="hvdp.verify.diff", operation="hvdp verify")[0]
    extra = {"keras_backend": _keras_backend.name()} if framework == "keras" else {}
    import keras
    plain_bn = sorted(layer.name for layer in _keras_layers(model)
                      if isinstance(layer, keras.layers.BatchNormalization) and not getattr(layer, "synchronized", False)
                      and type(layer).__name__ != "SyncBatchNormalization")
    return {"rank": world.rank, "size": world.size, "framework": framework, "optimizer": optimizer,
            "optimizer_class": optimizer_class, "steps": steps + (1 if leftover else 0), "accumulate": accumulate,
            "leftover": leftover, "replicas_identical": identical, "plain_batchnorm": plain_bn, **outcome, **extra}


def _tensorflow(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
                factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None) -> dict:
    """A tf.function custom loop: plain GradientTape + hvdp.tensorflow.DistributedOptimizer, the loss
    weighted by shard(weights=True), flush() after the epoch (docs/tensorflow-keras.md)."""
    import keras
    import tensorflow as tf

    import hvdp.tensorflow as htf

    world, model, reference, make_optimizer, x, y, n, multiplier, leftover = _keras_setup(
        "tensorflow", optimizer=optimizer, steps=steps, batch_size=batch_size, accumulate=accumulate, lr=lr,
        seed=seed, factory=factory, input_shape=input_shape, leftover=leftover)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inner = make_optimizer(lr)
    dist = htf.DistributedOptimizer(inner, backward_passes_per_step=accumulate)
    htf.broadcast(model, dist)

    @tf.function
    def train_step(xb, yb, wb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True), sample_weight=wb)
        variables = model.trainable_variables
        dist.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for xb, yb, wb in htf.shard((x, y), batch_size=batch_size, seed=seed, weights=True,
                                backward_passes_per_step=accumulate):
        train_step(xb, yb, wb)
    dist.flush()

    ref_opt = make_optimizer(lr * multiplier) if reference is not None else None

    def replay(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, reference(xb, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))

    return _keras_result("tensorflow", world, model, reference, x, y, n, batch_size=batch_size,
                         accumulate=accumulate, optimizer=optimizer, optimizer_class=type(inner).__name__,
                         steps=steps, seed=seed, leftover=leftover, replay=replay)


def _keras(*, optimizer: str, steps: int, batch_size: int, accumulate: int, lr: float, seed: int,
           factory=None, input_shape: tuple[int, ...] = (20,), leftover: int | None = None) -> dict:
    """Keras 3 model.fit with hvdp.keras's optimizer, shard and callbacks; the reference uses train_on_batch. Both
    run on Keras's backend (KERAS_BACKEND, which `hvdp verify --keras-backend` sets before Keras is imported)."""
    import keras

    import hvdp.keras as hk

    world, model, reference, make_optimizer, x, y, n, multiplier, leftover = _keras_setup(
        "keras", optimizer=optimizer, steps=steps, batch_size=batch_size, accumulate=accumulate, lr=lr,
        seed=seed, factory=factory, input_shape=input_shape, leftover=leftover)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inner = make_optimizer(lr)
    model.compile(optimizer=hk.DistributedOptimizer(inner, backward_passes_per_step=accumulate), loss=loss_fn)
    data = hk.shard((x, y), batch_size=batch_size, seed=seed)
    model.fit(data, epochs=1, verbose=0, callbacks=hk.callbacks(data=data))
    if reference is not None:
        reference.compile(optimizer=make_optimizer(lr * multiplier), loss=loss_fn)
    return _keras_result("keras", world, model, reference, x, y, n, batch_size=batch_size, accumulate=accumulate,
                         optimizer=optimizer, optimizer_class=type(inner).__name__, steps=steps, seed=seed,
                         leftover=leftover, replay=lambda xb, yb: reference.train_on_batch(xb, yb))
