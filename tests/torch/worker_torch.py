"""Checks of hvdp.torch that need a real job; run under horovodrun by tests/torch/test_torch.py.

Every assertion holds at any world size.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdp.torch as ht  # noqa: E402
from hvdp.core.errors import (CheckpointError, ConfigError, DataError, DivergenceError,  # noqa: E402
                              NonFiniteLossError)
from hvdp.core.scaling import lr_multiplier  # noqa: E402
from hvdp.core.sharding import epoch_order  # noqa: E402
from hvdp.tools import equivalence  # noqa: E402
from tests.checks import check, main  # noqa: E402

world = None  # ht.init() under the main guard below: shard()'s DataLoader workers import this script again
hvd = ht.hvd


def expect(error, fn, match: str):
    try:
        fn()
    except error as e:
        assert match in str(e), f"{type(e).__name__} message {str(e)!r} lacks {match!r}"
        return e
    raise AssertionError(f"expected {error.__name__} ({match!r}), nothing was raised")


# ------------------------------------------------------------------------------------------ equivalence

def _equivalent(optimizer, accumulate, leftover=None):
    # leftover None: the default, N*b - 1 samples more, so that the epoch ends with a short step whose last
    # global batch N ranks split unevenly (none at np=1)
    r = equivalence.run("torch", optimizer=optimizer, steps=4, batch_size=8, accumulate=accumulate,
                        lr=0.02, seed=3, leftover=leftover)
    assert r["size"] == world.size
    assert r["leftover"] == (leftover if leftover is not None else 15 if world.size == 2 else 0), r
    assert r["replicas_identical"], r
    assert r["max_abs_diff"] <= 1e-5, r


@check
def equivalence_sgd_momentum(tmp):
    _equivalent("sgd", 1)


@check
def equivalence_adam(tmp):
    _equivalent("adam", 1)


@check
def equivalence_sgd_accumulate(tmp):
    _equivalent("sgd", 3)


@check
def equivalence_adam_accumulate(tmp):
    _equivalent("adam", 2)


@check
def equivalence_whole_steps_only(tmp):
    _equivalent("sgd", 1, leftover=0)


@check
def equivalence_top_up_batch(tmp):
    # 1 sample left for 2 ranks: rank 1's batch repeats a sample of the epoch and must weigh nothing
    _equivalent("sgd", 1, leftover=1)


@check
def equivalence_short_accumulation_with_partial_batch(tmp):
    # 3 batches per step; the last step has 2 full global batches and one of 5 samples (3/2 at np=2)
    _equivalent("adam", 3, leftover=2 * 8 * world.size + 5)


# ----------------------------------------------------------------------------------------- replicas

@check
def equivalence_compiled_and_amp(tmp):
    # issue 14: a model compiled with hvdp.torch.compile trains as the eager one-process reference (aot_eager:
    # the autograd structure of any backend, without inductor's minutes of C++ compilation), and autocast
    # within verify's stated tolerances (hvdp verify --amp)
    from hvdp.tools.verify import AMP_TOLERANCE
    r = equivalence.run("torch", optimizer="adam", steps=3, batch_size=8, accumulate=2, lr=0.02, seed=3,
                        compile="aot_eager")
    assert r["compile"] == "aot_eager" and r["replicas_identical"] and r["max_abs_diff"] <= 1e-5, r
    for amp, tolerance in AMP_TOLERANCE.items():
        r = equivalence.run("torch", optimizer="sgd", steps=3, batch_size=8, accumulate=1, lr=0.02, seed=3, amp=amp)
        assert r["amp"] == amp and r["replicas_identical"] and r["max_abs_diff"] <= tolerance, r


def _backward_owners(loss):
    """id(parameter) -> the backward node that produces its gradient."""
    owner, seen, todo = {}, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and hasattr(child, "variable"):  # AccumulateGrad of a leaf
                owner[id(child.variable)] = node
            elif child is not None:
                todo.append(child)
    return owner


@check
def compiled_model_all_reduces_during_its_backward(tmp):
    # issue 14: Horovod starts a gradient's all-reduce from the hook of its accumulation. A model compiled
    # whole has one backward node, so every all-reduce starts only after the whole backward pass;
    # hvdp.torch.compile splits the graph (DDP's buckets), and the last layers' all-reduces start before the
    # first layer's backward runs. Counted in order, not timed: starts seen when that node begins.
    import horovod.torch.optimizer as horovod_optimizer
    real, starts = horovod_optimizer.allreduce_async_, []

    def counting(*args, **kwargs):
        starts.append(kwargs.get("name"))
        return real(*args, **kwargs)
    horovod_optimizer.allreduce_async_ = counting
    try:
        seen = {}
        for how in ("eager", "torch.compile", "hvdp.torch.compile"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                          for _ in range(6)], torch.nn.Linear(64, 4))
            forward = {"eager": model, "torch.compile": torch.compile(model, backend="aot_eager"),
                       "hvdp.torch.compile": ht.compile(model, backend="aot_eager", bucket_bytes=40_000)}[how]
            opt = ht.prepare(forward, torch.optim.SGD(model.parameters(), lr=0.01))
            x, y = torch.randn(16, 64), torch.randint(0, 4, (16,))
            for _ in range(2):  # the first call compiles
                starts.clear()
                loss = F.cross_entropy(forward(x), y)
                owners = _backward_owners(loss)
                before_first_layer = []
                owners[id(model[0][0].weight)].register_prehook(lambda grads: before_first_layer.append(len(starts)))
                loss.backward()
                opt.step()
                opt.zero_grad()
            pieces = len({id(node) for node in owners.values()})
            seen[how] = (pieces, before_first_layer[0], len(starts))
        n = 2 * 7  # weights and biases of 7 layers, each one all-reduce (world.size 1: none)
        if world.size == 1:
            assert all(started == 0 for _, _, started in seen.values()), seen
            return
        pieces, early, started = seen["eager"]                 # a node per layer; all but layer 0's in time
        assert pieces >= 7 and early >= n - 2 and started == n, seen
        assert seen["torch.compile"] == (1, 0, n), seen        # the problem: nothing before the very end
        pieces, early, started = seen["hvdp.torch.compile"]
        assert pieces >= 2 and 0 < early < n and started == n, seen
    finally:
        horovod_optimizer.allreduce_async_ = real


@check
def compiled_model_checkpoints_and_checks_as_the_eager_one(tmp):
    # issue 14: save_checkpoint/load_checkpoint/check_consistency take the compiled module: its state_dict's
    # keys carry torch.compile's "_orig_mod." prefix, the checkpoint's must not (it loads into eager models)
    d = Path(hvd.broadcast_object(str(tmp / "ckpt-compiled"), name="ckpt.compiled"))
    model = _model(world.rank)  # different on every rank until prepare() broadcasts rank 0's
    compiled = ht.compile(model, backend="aot_eager")
    opt = ht.prepare(compiled, torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
    ht.check_consistency(compiled)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict()), list(compiled.state_dict())
    ht.save_checkpoint(d, compiled, opt, epoch=0, step=2, global_step=2)
    if world.rank == 0:
        saved = torch.load(next(d.glob("*.pt")), weights_only=True)
        assert set(saved["model"]) == set(model.state_dict()), f"checkpoint keys {sorted(saved['model'])}"
    eager = _model(100 + world.rank)
    eager_opt = ht.prepare(eager, torch.optim.Adam(eager.parameters(), lr=0.01))
    assert ht.load_checkpoint(d, eager, eager_opt)["global_step"] == 2
    again = _model(200 + world.rank)
    again_compiled = ht.compile(again, backend="aot_eager")
    ht.load_checkpoint(d, again_compiled, torch.optim.Adam(again.parameters(), lr=0.01))
    for k, v in model.state_dict().items():
        assert torch.equal(eager.state_dict()[k], v) and torch.equal(again.state_dict()[k], v), k
    assert eager_opt.state_dict()["state"][0]["step"] == 2


# ------------------------------------------------------------------------------------------ streams

class _Numbers(torch.utils.data.IterableDataset):
    """The stream 0, 1, ..., n-1 (as float tensors); `n` may depend on the rank, to break it on purpose."""

    def __init__(self, n, epochs_seen=None):
        self.n, self.epochs_seen = n, epochs_seen

    def set_epoch(self, epoch):
        if self.epochs_seen is not None:
            self.epochs_seen.append(epoch)

    def __iter__(self):
        return (torch.tensor([float(i)]) for i in range(self.n))


def _values(loader):
    return [batch.flatten().tolist() for batch in loader]


def _times_ten(t):
    return t * 10


@check
def stream_equivalence_with_workers_and_accumulation(tmp):
    # issue 16: a stream of unknown length (an IterableDataset), read by 0 or 2 DataLoader workers per rank,
    # 2 passes accumulated, the last step short and its last global batch split unevenly: one process's steps
    for workers in (0, 2):
        r = equivalence.run("torch", optimizer="adam", steps=3, batch_size=8, accumulate=2, lr=0.02, seed=3,
                            stream=workers)
        assert r["stream"] == workers and r["replicas_identical"] and r["max_abs_diff"] <= 1e-5, r


@check
def stream_steps_weighted_by_their_own_accumulation_after_another_prepare(tmp):
    # issue 29: a stream's loader read ahead by the largest k ever prepared: after prepare(k=8), full steps of
    # k=3 took gradient weights of 1.5 and 3.0 (their step's batches were not read yet) instead of 1
    other = _model(seed=0)
    ht.prepare(other, torch.optim.SGD(other.parameters(), lr=0.01), backward_passes_per_step=8)
    r = equivalence.run("torch", optimizer="sgd", steps=4, batch_size=8, accumulate=3, lr=0.02, seed=3, stream=0)
    assert r["replicas_identical"] and r["max_abs_diff"] <= 1e-5, r


@check
def stream_ranks_take_disjoint_parts_and_transform_only_their_own(tmp):
    seen = []
    transformed = []

    def transform(t):
        transformed.append(float(t))
        return t * 10
    for workers in (0, 2):
        epochs = []
        # the workers receive the transform pickled (forkserver): a module-level function, not this closure
        loader = ht.shard(_Numbers(43, epochs), batch_size=4, transform=transform if workers == 0 else _times_ten,
                          num_workers=workers)
        first, second = _values(loader), _values(loader)
        assert epochs == [0, 1] and first == second, (epochs, first, second)
        mine = sorted(v / 10 for batch in first for v in batch)
        everyone = hvd.allgather_object(mine, name=f"stream.parts.{workers}")
        steps = {len(b) for b in hvd.allgather_object(first, name=f"stream.steps.{workers}")}
        assert len(steps) == 1, f"ranks took different numbers of steps: {steps}"
        union = sorted(v for part in everyone for v in part)
        # 43 = 5 steps of 8 + 3: the last is split 2/1 at np=2; a top-up would repeat an element, none here
        assert union == [float(i) for i in range(43)], union
        seen.append(first)
    # the transform ran in this process for workers=0: on this rank's elements only, once per epoch
    own = sum(len(b) for b in seen[0])
    assert len(transformed) == 2 * own, (len(transformed), own)


@check
def stream_tiny_last_batch_and_bad_streams_raise_on_every_rank(tmp):
    size = world.size
    # 2 ranks x 4 and 9 elements: the last step has 1, rank 1 trains on a repeated first element (weight 0)
    loader = ht.shard(_Numbers(4 * size + 1), batch_size=4)
    assert len(_values(loader)) == 2
    expect(DataError, lambda: _values(ht.shard(_Numbers(0), batch_size=2)), "the stream yielded no samples")
    if size > 1:
        expect(ConfigError, lambda: _values(ht.shard(_Numbers(size - 1), batch_size=2)),
               f"the stream has {size - 1} samples but the job has {size} ranks")
        # rank 1's stream ends 30 elements early (its files differ): an error on every rank, no hang
        short = _Numbers(100 - (30 if world.rank == 1 else 0))
        e = expect(DataError, lambda: _values(ht.shard(short, batch_size=2)), "the stream of rank(s) [1] ended")
        assert "must yield the same elements in the same order" in str(e)
        # as many steps, but the last one has 1 element on rank 0 and 2 on the others
        odd = _Numbers(64 + (1 if world.rank == 0 else 2))
        expect(DataError, lambda: _values(ht.shard(odd, batch_size=4)), "rank(s) [1] read other sample counts")

    class OneShot(torch.utils.data.IterableDataset):  # a cursor: its second iteration yields nothing
        def __init__(self):
            self.it = iter(range(20))

        def __iter__(self):
            return (torch.tensor([float(i)]) for i in self.it)
    once = ht.shard(OneShot(), batch_size=2)
    assert len(_values(once)) == -(-20 // (2 * size))
    expect(DataError, lambda: _values(once), "does not start over when iterated again")
    expect(ConfigError, lambda: ht.shard(_Numbers(10), batch_size=2, persistent_workers=True, num_workers=1),
           "refuses persistent_workers=True")
    expect(ConfigError, lambda: ht.shard(_data(), batch_size=2, transform=abs), "transform=...) is for a stream")

    class NoLen(torch.utils.data.Dataset):
        def __getitem__(self, i):
            return i
    expect(ConfigError, lambda: ht.shard(NoLen(), batch_size=2), "needs len(dataset)")
    expect(TypeError, lambda: len(ht.shard(_Numbers(10), batch_size=1)), "has no len()")


@check
def stream_resumes_exactly_from_a_checkpoint(tmp):
    d = Path(hvd.broadcast_object(str(tmp / "ckpt-stream"), name="ckpt.stream"))
    model = _model(0)
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))

    class Sized(_Numbers):
        def __len__(self):
            return self.n
    loader = ht.shard(Sized(90), batch_size=4)
    assert len(loader) == -(-90 // (4 * world.size))
    whole = _values(loader)
    ht.save_checkpoint(d, model, opt, epoch=0, step=3, global_step=3)
    ht.load_checkpoint(d, model, opt, loader)
    assert len(loader) == len(whole) - 3
    assert _values(loader) == whole[3:]
    loader.set_position(0, len(whole) + 2)  # past the stream's end
    expect(DataError, lambda: _values(loader), "nothing is left at the resume position (epoch 0, step")
    expect(ConfigError, lambda: ht.ElasticState(model, opt, loader), "ElasticState needs a map-style dataset")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 3))


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


@check
def zero_grad_takes_set_to_none(tmp):
    # issue 14: Horovod's wrapper dropped the argument, so zero_grad(set_to_none=True) raised TypeError
    model = _model(seed=0)
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = next(iter(ht.shard(_data(), batch_size=8)))
    F.cross_entropy(model(x), y).backward()
    if world.size > 1:  # at one rank Horovod starts no all-reduce, so there is nothing to race with
        expect(AssertionError, opt.zero_grad, "race condition")  # Horovod's guard is kept
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(True)
    assert all(p.grad is None for p in model.parameters())


@check
def second_prepare_does_not_compound_accumulation_hooks(tmp):
    # issue 14: each prepare(backward_passes_per_step=k) added ÷k hooks for good; a second one divided by k*k
    model = _model(seed=0)
    ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), backward_passes_per_step=2)
    ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), backward_passes_per_step=2)
    x, y = next(iter(ht.shard(_data(), batch_size=8)))
    model.eval()  # no dropout: both forwards must agree
    ref = copy.deepcopy(model)  # deepcopy drops tensor hooks: the reference sees the plain gradient
    F.cross_entropy(ref(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad / 2), float((p.grad - r.grad / 2).abs().max())
    # (Horovod's first wrapper keeps its own hooks; with k=2 and one backward neither wrapper all-reduces yet)


@check
def replicas_bit_identical_after_every_step(tmp):
    model = _model(seed=world.rank)  # rank-dependent init: prepare's broadcast must fix it
    opt = ht.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    ht.check_consistency(model)
    torch.manual_seed(100 + world.rank)  # rank-dependent dropout masks, as in real jobs
    for x, y in ht.shard(_data(), batch_size=8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ht.check_consistency(model)


@check
def amp_recipe_autocast_and_grad_scaler(tmp):
    # issue 14: docs/pytorch.md's AMP recipe. The scaler unscales after the all-reduce, so every rank sees the
    # same averaged gradient: an overflow on one rank only makes every rank skip that step, and the scales
    # stay equal. Under autocast (bf16 and fp16) the weights stay float32 and the replicas bit-identical.
    for dtype in (torch.bfloat16, torch.float16):
        model = _model(seed=world.rank)
        opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        torch.manual_seed(7 + world.rank)
        moved = []
        for i, (x, y) in enumerate(ht.shard(_data(), batch_size=8)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            if i == 3 and world.rank == world.size - 1:
                loss = loss * float("inf")  # this rank alone overflows
            before = [p.detach().clone() for p in model.parameters()]
            scaler.scale(loss).backward()
            opt.synchronize()                  # the all-reduce first ...
            scaler.unscale_(opt)               # ... then unscale (and clip) the averaged gradient
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)               # skipped on every rank if any rank overflowed
            scaler.update()
            moved.append(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            ht.check_consistency(model)
        assert moved[3] is False and all(moved[:3]) and all(moved[4:]), (dtype, moved)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        scales = hvd.allgather_object(scaler.get_scale(), name=f"amp.scale.{dtype}")
        assert len(set(scales)) == 1 and scales[0] < 2.0 ** 10, scales  # lowered once, alike everywhere


@check
def bfloat16_and_float16_models_train_with_replicas_bit_identical(tmp):
    # bf16 weights and gradients (Horovod 0.28.1's bindings refused bf16; build_horovod.sh adds it), and fp16.
    for dtype in (torch.bfloat16, torch.float16):
        model = _model(seed=world.rank).to(dtype)  # rank-dependent init: prepare's broadcast must fix it
        opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        ht.check_consistency(model)
        losses = []
        for epoch in range(4):
            for x, y in ht.shard(_data(), batch_size=8, seed=epoch):
                opt.zero_grad()
                loss = F.cross_entropy(model.eval()(x.to(dtype)).float(), y)
                loss.backward()
                assert all(p.grad.dtype == dtype for p in model.parameters())
                opt.step()
                ht.check_consistency(model)
                losses.append(loss.item())
        assert all(p.dtype == dtype for p in model.parameters())
        # Every rank sees its own shard's losses: decide on their average, the same on every rank.
        losses = hvd.allreduce(torch.tensor(losses), op=hvd.Average, name=f"bf16.losses.{dtype}").tolist()
        assert np.mean(losses[-4:]) < np.mean(losses[:4]), (dtype, losses)


@check
def divergence_is_named(tmp):
    model = _model(seed=0)
    if world.rank == world.size - 1 and world.size > 1:
        with torch.no_grad():
            model[3].bias[0] += 1e-6
    if world.size > 1:
        e = expect(DivergenceError, lambda: ht.check_consistency(model), "'3.bias' differs from rank 0")
        assert f"rank(s) [{world.size - 1}]" in str(e)
    wrong = torch.nn.Linear(6, 4 if world.rank == 0 else 5)
    if world.size > 1:
        expect(DivergenceError, lambda: ht.check_consistency(wrong), "different model than rank 0")


# -------------------------------------------------------------------------------------------- sharding

@check
def mismatched_models_are_named_not_hung(tmp):
    """A rank that builds a different model fails prepare() on every rank, naming the rank and tensor."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 16 + (world.rank == world.size - 1)))
    if world.size == 1:
        ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return
    e = expect(DivergenceError, lambda: ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)),
               f"rank {world.size - 1} holds a different model than rank 0: '0.weight' has shape (17, 6)")
    assert "(16, 6) on rank 0" in str(e), str(e)


@check
def shards_disjoint_covering_reshuffled(tmp):
    n = 101
    torch.manual_seed(world.rank)  # a rank-dependent global seed must not change the order
    np.random.seed(world.rank)
    loader = ht.shard(torch.utils.data.TensorDataset(torch.arange(n)), batch_size=7, seed=11)
    epochs = []
    for _ in range(3):  # no set_epoch: the loader moves on by itself
        mine = torch.cat([b[0] for b in loader]).tolist()
        everyone = hvd.allgather_object(mine, name="shard.check")
        flat = [i for part in everyone for i in part]
        assert sorted(flat) == list(range(n)), "ranks must cover the dataset exactly once"
        assert len(set(map(len, everyone))) <= 2
        epochs.append(flat)
    assert epochs[0] != epochs[1] != epochs[2], "the order must change every epoch"
    assert len(loader) == -(-n // (7 * world.size))


# ------------------------------------------------------------------------------------------ LR scaling

@check
def lr_scaled_and_warmed_up(tmp):
    w = torch.nn.Parameter(torch.zeros(1))
    model = torch.nn.Module()
    model.w = w
    opt = ht.prepare(model, torch.optim.SGD([w], lr=0.1), warmup_steps=4)
    assert opt.param_groups[0]["lr"] == 0.1 * world.size
    used = []
    for _ in range(6):
        opt.zero_grad()
        before = float(w.detach())
        (w * 1.0).sum().backward()  # gradient 1 on every rank -> averaged gradient 1
        lr_expected = ht.current_lr(opt)
        opt.step()
        used.append(before - float(w.detach()))  # SGD: delta = lr * grad
        assert abs(used[-1] - lr_expected) < 1e-6, (used, lr_expected)
    assert abs(used[0] - 0.1) < 1e-6, "warmup starts at the base rate"
    assert abs(used[-1] - 0.1 * world.size) < 1e-6, "and ends at the scaled rate"
    assert used == sorted(used)
    assert opt.param_groups[0]["lr"] == 0.1 * world.size, "the group lr is left at the scaled value"
    assert opt.hvdp_schedule.step == 6, "every optimizer step counted once"
    other = torch.nn.Linear(1, 1)
    plain = ht.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))  # no warmup: counted once too
    for _ in range(3):
        plain.zero_grad()
        other(torch.ones(1, 1)).sum().backward()
        plain.step()
    assert plain.hvdp_schedule.step == 3


@check
def lr_of_every_rule_op_and_accumulation_moves_the_weights_as_documented(tmp):
    """issue 29: op="sum" with warmup skipped the ramp (the first update N x too large) and sqrt ran it
    backwards; Adasum counted one step per parameter. Each step moves a weight whose gradient is 1 on every
    rank and pass by the effective rate of docs/pytorch.md's table: from base at step 0, in a straight line,
    to base x N*k (linear) or sqrt(N*k) at the warmup's end, whatever the reduction."""
    base, warmup, n = 0.1, 3, world.size
    ops = ["average", "sum"] + (["adasum"] if n == 1 or hvd.mpi_enabled() else [])
    for rule, op, k in itertools.product(("linear", "sqrt", "none"), ops, (1, 2)):
        target = 1.0 if rule == "none" or op == "adasum" else n * k if rule == "linear" else (n * k) ** 0.5
        w = torch.nn.Parameter(torch.zeros(1))
        model = torch.nn.Module()
        model.w = w
        opt = ht.prepare(model, torch.optim.SGD([w], lr=base), lr_scaling=rule, op=op, warmup_steps=warmup,
                         backward_passes_per_step=k)
        for step in range(warmup + 2):
            before = float(w.detach())
            for _ in range(k):
                (w * 1.0).sum().backward()
            rate = ht.current_lr(opt)
            opt.step()
            opt.zero_grad()
            moved = before - float(w.detach())  # SGD: the rate x the reduced gradient (1, or n summed)
            expected = base * n if (rule, op) == ("none", "sum") else \
                base * (1 + (target - 1) * min(step, warmup) / warmup)
            assert abs(moved - expected) < 1e-6, (rule, op, k, step, moved, expected)
            assert abs(rate * (n if op == "sum" else 1) - moved) < 1e-6, (rule, op, k, step, rate, moved)
        assert opt.hvdp_schedule.step == warmup + 2, (rule, op, k, opt.hvdp_schedule.step)


@check
def gradient_clipping_pattern(tmp):
    model = _model(seed=1)
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = _data()[world.rank * 8:(world.rank + 1) * 8]
    (F.cross_entropy(model(x), y) * 1000).backward()
    opt.synchronize()  # gradients all-reduced here...
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert float(norm) > 1.0
    with opt.skip_synchronize():  # ...so step must not reduce them again
        opt.step()
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert float(total) <= 1.0 + 1e-5
    ht.check_consistency(model)


@check
def fp16_compression_and_adasum_train(tmp):
    variants = [{"compression": "fp16"}, {"op": "adasum"}]
    if world.size > 1 and not hvd.mpi_enabled():  # Horovod implements Adasum on MPI only
        model = _model(seed=0)
        expect(ConfigError, lambda: ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), op="adasum"),
               "needs Horovod's MPI controller")
        variants.pop()
    for kw in variants:
        model = _model(seed=world.rank)
        opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), **kw)
        losses = []
        for _ in range(3):
            for x, y in ht.shard(_data(), batch_size=8, seed=2):
                opt.zero_grad()
                loss = F.cross_entropy(model.eval()(x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss))
        ht.check_consistency(model)
        assert np.mean(losses[-4:]) < np.mean(losses[:4]), (kw, losses)


@check
def sync_batchnorm_uses_global_statistics(tmp):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True)
    assert type(model[1]).__name__ == "SyncBatchNorm"
    g = torch.Generator().manual_seed(5)
    full = torch.randn(8 * world.size, 4, generator=g) * 3 + 1
    mine = full[world.rank * 8:(world.rank + 1) * 8]
    model.train()
    out = model(mine)
    out.sum().backward()  # gradients flow through the all-reduce
    assert model[0].weight.grad is not None
    reference = copy.deepcopy(model[0])
    bn = torch.nn.BatchNorm1d(4)
    bn.train()
    with torch.no_grad():
        bn(reference(full))
    assert torch.allclose(model[1].running_mean, bn.running_mean, atol=1e-5)
    assert torch.allclose(model[1].running_var, bn.running_var, atol=1e-4)


@check
def sync_batchnorm_keeps_float32_statistics_for_bf16_input(tmp):
    # Under autocast a BatchNorm sees bf16 activations: summing them in bf16 loses the statistics (and
    # E[x^2] - E[x]^2 rounds below 0 for a near-constant channel). hvdp accumulates in float32, clamps.
    sync = ht.SyncBatchNorm(3)
    sync.train()
    g = torch.Generator().manual_seed(9)
    full = torch.randn(64 * world.size, 3, generator=g) * 0.01 + torch.tensor([1000.0, 0.0, -5.0])
    mine = full[world.rank * 64:(world.rank + 1) * 64].bfloat16()
    out = sync(mine)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all(), "finite, in the input's dtype"
    exact = full.bfloat16().float()  # what float32 statistics of the same bf16 values give
    assert torch.allclose(sync.running_mean, 0.9 * torch.zeros(3) + 0.1 * exact.mean(0), rtol=1e-5, atol=1e-5)
    assert (sync.running_var >= 0).all() and torch.allclose(
        sync.running_var, 0.9 + 0.1 * exact.var(0), rtol=1e-4, atol=1e-6), sync.running_var


@check
def sync_batchnorm_leaves_out_an_epochs_top_up_samples(tmp):
    """issue 29: a last global batch of fewer samples than ranks is topped up with a repeated sample that weighs
    0 in the gradient, but SyncBatchNorm counted it in its statistics. An epoch through SyncBatchNorm ending with
    one sample for all the ranks must be one process's, BatchNorm2d on each step's real samples."""
    b, g = 2, torch.Generator().manual_seed(11)
    n = 2 * b * world.size + 1
    x = torch.randn(n, 2, 3, 3, generator=g) * 2 + 1
    t = torch.randn(n, 4, 3, 3, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), torch.nn.BatchNorm2d(4))
    reference = copy.deepcopy(model)
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1 * world.size)
    order = epoch_order(n, seed=5, epoch=0)
    model.train()
    reference.train()
    steps = 0
    for step, (xb, tb) in enumerate(ht.shard(torch.utils.data.TensorDataset(x, t), batch_size=b, seed=5)):
        opt.zero_grad()
        F.mse_loss(model(xb), tb).backward()
        opt.step()
        union = order[step * b * world.size:(step + 1) * b * world.size]
        ref_opt.zero_grad()
        F.mse_loss(reference(x[union]), t[union]).backward()
        ref_opt.step()
        steps += 1
    assert steps == 3
    for (name, mine), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(mine.float(), ref.float(), atol=1e-5), (name, float((mine - ref).abs().max()))


@check
def every_rank_computes_on_the_cpu_here_and_a_missing_gpu_fails_on_every_rank(tmp):
    assert ht.device() == torch.device("cpu"), "no GPU on this machine: each rank's device is the CPU"
    # Asking for a GPU that is not there is a ConfigError on every rank (none is left waiting in the exchange),
    # naming the rank; the rank then keeps its device.
    e = expect(ConfigError, lambda: ht.init(device="cuda"), "sees no GPU")
    assert f"rank {world.rank}" in str(e) and "rank 0: device cuda was asked for" in str(e), str(e)
    assert ht.device() == torch.device("cpu")
    expect(ConfigError, lambda: ht.init(device="gpu0"), "is not a device")
    assert ht.init(device="cpu") == world and ht.device() == torch.device("cpu")


# ---------------------------------------------------------------------------------------- evaluation

@check
def evaluate_counts_every_sample_once(tmp):
    model = _model(seed=0).eval()
    for n in (1, 7, 33, 2 * world.size + 1):
        data = _data(n=n, seed=n)
        m = ht.evaluate(model, data, batch_size=4)
        assert m["samples"] == n, m
        x, y = data.tensors
        with torch.no_grad():
            out = model(x)
        assert abs(m["accuracy"] - float((out.argmax(1) == y).double().mean())) < 1e-9
        assert abs(m["loss"] - float(F.cross_entropy(out.double(), y))) < 1e-6
    empty = torch.utils.data.TensorDataset(*(t[:0] for t in _data(n=4, seed=0).tensors))
    expect(ConfigError, lambda: ht.evaluate(model, empty), "empty dataset")  # on every rank, not NaN metrics


@check
def evaluate_scores_a_regressor_with_its_own_loss_and_metrics(tmp):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    x, y = torch.randn(2 * world.size + 3, 6), torch.randn(2 * world.size + 3, 2)
    data = torch.utils.data.TensorDataset(x, y)
    m = ht.evaluate(model, data, batch_size=2, loss_fn=F.mse_loss,
                    metrics={"mae": lambda out, t: (out - t).abs().sum() / t.shape[1]})
    with torch.no_grad():
        out = model(x)
    assert set(m) == {"loss", "mae", "samples"} and m["samples"] == len(x), m
    assert abs(m["loss"] - float(F.mse_loss(out.double(), y.double(), reduction="sum")) / len(x)) < 1e-6, m
    assert abs(m["mae"] - float((out - y).abs().mean())) < 1e-6, m
    assert set(ht.evaluate(model, data, loss_fn=F.mse_loss, metrics={})) == {"loss", "samples"}


@check
def barrier_orders_what_ranks_do(tmp):
    # Each rank but 0 writes its file only after a delay; rank 0 must see every file right after the barrier.
    d = Path(hvd.broadcast_object(str(tmp / "barrier"), name="barrier.dir"))
    d.mkdir(exist_ok=True)
    for round_ in range(3):
        if world.rank != 0:
            time.sleep(0.2)
            (d / f"{round_}.{world.rank}").write_text("here")
        ht.barrier()
        if world.rank == 0:
            missing = [r for r in range(1, world.size) if not (d / f"{round_}.{r}").exists()]
            assert not missing, f"round {round_}: rank 0 left the barrier before ranks {missing} reached it"
        ht.barrier()


@check
def average_and_nonfinite(tmp):
    assert abs(ht.average(world.rank) - (world.size - 1) / 2) < 1e-12
    ht.check_finite(torch.tensor(1.0), step=3)
    bad = torch.tensor(float("nan") if world.rank == world.size - 1 else 0.5)
    e = expect(NonFiniteLossError, lambda: ht.check_finite(bad, step=7), "not finite at step 7")
    assert f"rank(s) [{world.size - 1}]" in str(e)


# -------------------------------------------------------------------------------------------- elastic

@check
def elastic_commit_overwrites_its_snapshot_in_place(tmp):
    # issue 45: save() built the new snapshot beside the old one (two copies of model and optimizer state in
    # memory at each commit); now written into the last one's tensors
    model, opt, loader = _fresh(seed=0)
    state = ht.ElasticState(model, opt, loader)
    batches = iter(loader)

    def step():
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    state.commit()

    def pointers():
        snap = state._snapshot
        return ([v.data_ptr() for v in snap["model"].values()] +
                [v.data_ptr() for st in snap["optimizer"]["state"].values() for v in st.values() if torch.is_tensor(v)])

    held, before = pointers(), copy.deepcopy(state._snapshot)
    step()
    state.commit()
    assert pointers() == held and len(held) > len(before["model"])  # model and optimizer state, in place
    live = model.state_dict()
    assert all(torch.equal(state._snapshot["model"][k], v) for k, v in live.items())
    assert any(not torch.equal(before["model"][k], v) for k, v in live.items())  # the step was copied in
    assert all(v.data_ptr() != live[k].data_ptr() for k, v in state._snapshot["model"].items())  # a copy, not the live one


@check
def elastic_state_commit_restore_sync(tmp):
    """restore() rolls model, optimizer, warmup step and data position back to the last commit; the next
    iteration resumes at the committed offset; sync() keeps replicas identical (the resize itself is
    tests/multihost/test_elastic.py). Wrong arguments are clear errors."""
    model, opt, loader = _fresh(seed=world.rank)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    expect(ConfigError, lambda: ht.ElasticState(model, plain, loader), "optimizer returned by hvdp.torch.prepare()")
    expect(ConfigError, lambda: ht.ElasticState(model, opt, [1, 2]), "DataLoader returned by hvdp.torch.shard()")
    expect(ConfigError, lambda: ht.ElasticState(model, opt, loader, epoch=3), "`epoch` is kept by ElasticState")
    state = ht.ElasticState(model, opt, loader, best=0.0, history=[])
    state.sync()  # what elastic_run does first: rank 0's model everywhere (prepare skips its broadcast only
    ht.check_consistency(model)  # under HOROVOD_ELASTIC, so here the model was already identical)
    lr = opt.param_groups[0]["lr"]
    plan = loader.batch_sampler.plan
    batches = iter(loader)

    def steps(k):
        for _ in range(k):
            x, y = next(batches)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    steps(2)
    state.best = 0.5
    state.history.append("step 2")  # an extra changed in place: ObjectState kept only a reference to it
    state.commit()
    committed = copy.deepcopy(model.state_dict())
    assert state.epoch == 0 and loader.batch_sampler.position() == (0, 2 * plan.global_batch)

    steps(3)
    state.best = 0.9
    state.history.append("step 5")  # rolled back with the steps it records, or they would count twice
    assert loader.batch_sampler.position() == (0, 5 * plan.global_batch)
    state.restore()
    assert state.best == 0.5 and opt.hvdp_schedule.step == 2
    assert state.history == ["step 2"], f"an extra changed in place after a commit was not rolled back: {state.history}"
    state.history.append("again")
    state.restore()  # the restored value is a copy: changing it leaves the commit as it was
    assert state.history == ["step 2"], state.history
    assert all(torch.equal(committed[k], v) for k, v in model.state_dict().items()), "model not rolled back"
    first = next(iter(loader))[1]
    expected = _data()[plan.batch(0, 2)][1]
    assert torch.equal(first, expected), "the next iteration must start at the committed offset"
    # A step that raises, as Horovod's does when a peer dies mid-allreduce, skips the post-step hooks;
    # after restore() the steps must count again (they did not: the position froze and an epoch ended early).
    def die(*_):
        opt.synchronize()  # let this step's all-reduces finish (a real reset would shut Horovod down)
        raise RuntimeError("peer lost")
    hook = opt.register_step_pre_hook(die)
    batches = iter(loader)
    expect(RuntimeError, lambda: steps(1), "peer lost")
    hook.remove()
    state.restore()
    batches = iter(loader)
    steps(1)
    assert loader.batch_sampler.position() == (0, 3 * plan.global_batch), loader.batch_sampler.position()
    state.sync()
    assert opt.param_groups[0]["lr"] == lr, "same world size: the learning rate must not change"
    ht.check_consistency(model)


@check
def elastic_reset_without_sync_rescales_the_lr(tmp):
    """issue 29: when hosts are only removed Horovod raises HostsUpdatedInterrupt(skip_sync=True), and its
    run_fn (horovod/common/elastic.py) calls state.on_reset() without state.sync(): the rates of the larger
    world stayed while the data was split for the smaller one. on_reset() must rescale them."""
    model, opt, loader = _fresh(seed=0)
    state = ht.ElasticState(model, opt, loader)
    bigger = 2 * world.size  # as a world of twice the ranks left the schedule and the rates
    opt.hvdp_schedule.size = bigger
    for group in opt.param_groups:
        group["lr"] = 0.01 * lr_multiplier("linear", bigger)
    state.on_reset()
    assert opt.param_groups[0]["lr"] == 0.01 * lr_multiplier("linear", world.size), opt.param_groups[0]["lr"]
    assert ht.current_lr(opt) == 0.01, "warmup step 0: the base rate"


@check
def elastic_counts_the_batches_of_a_step_grad_scaler_skipped(tmp):
    """issue 29: a step that GradScaler skips (an overflow on any rank) never calls step(), so its batches were
    not counted and a reset trained them again. The data position advances one global batch per step."""
    model, opt, loader = _fresh(seed=0)
    state = ht.ElasticState(model, opt, loader)
    state.sync()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    plan = loader.batch_sampler.plan
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        if i == 1 and world.rank == world.size - 1:
            loss = loss * float("inf")  # this rank alone overflows: every rank skips the step
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        assert state.sampler.position() == (0, plan.consumed(0, i + 1)), (i, state.sampler.position())
        if i == 2:
            break
    assert opt.hvdp_schedule.step == 2, "a skipped step is not an optimizer step (warmup, checkpoints)"


# ---------------------------------------------------------------------------------------- checkpoints

def _train(model, opt, loader, epochs, directory=None, start=(0, 0), global_step=0):
    for epoch in range(start[0], epochs):
        for step, (x, y) in enumerate(loader, start[1] if epoch == start[0] else 0):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            global_step += 1
            if directory and step == 2:  # a mid-epoch checkpoint
                ht.save_checkpoint(directory, model, opt, epoch=epoch, step=step + 1, global_step=global_step)
        if directory:
            ht.save_checkpoint(directory, model, opt, epoch=epoch + 1, step=0, global_step=global_step)
    return global_step


def _fresh(seed):
    model = _model(seed)
    opt = ht.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01), warmup_steps=5)
    return model, opt, ht.shard(_data(), batch_size=8, seed=4)


@check
def checkpoint_resume_is_bit_identical(tmp):
    d = hvd.broadcast_object(str(tmp / "ckpt-resume"), name="ckpt.dir")
    torch.manual_seed(50 + world.rank)
    model, opt, loader = _fresh(0)
    _train(model, opt, loader, epochs=3)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    for stop_epoch, stop_at_mid in ((1, False), (2, True)):
        directory = Path(d) / f"{stop_epoch}-{stop_at_mid}"
        torch.manual_seed(50 + world.rank)
        model, opt, loader = _fresh(0)
        _train(model, opt, loader, epochs=stop_epoch, directory=directory)
        if stop_at_mid:  # drop the end-of-epoch checkpoint: resume from the mid-epoch one
            if world.rank == 0:
                sorted(directory.glob("ckpt-*.pt"))[-1].unlink()
            hvd.barrier()
        torch.manual_seed(999)  # the "restarted process" has another RNG state and other weights
        model, opt, loader = _fresh(seed=7 + world.rank)
        state = ht.load_checkpoint(directory, model, opt, loader)
        assert state is not None and state["step"] == (3 if stop_at_mid else 0), state
        _train(model, opt, loader, epochs=3, start=(state["epoch"], state["step"]),
               global_step=state["global_step"])
        for k, v in model.state_dict().items():
            assert torch.equal(v, uninterrupted[k]), f"{k} differs after resume at {stop_epoch}/{stop_at_mid}"


@check
def checkpoint_keeps_last_k_and_none_is_fine(tmp):
    d = Path(hvd.broadcast_object(str(tmp / "ckpt-keep"), name="ckpt.dir2"))
    model, opt, loader = _fresh(0)
    assert ht.load_checkpoint(d, model, opt, loader) is None
    for step in range(5):
        ht.save_checkpoint(d, model, opt, epoch=0, step=step, global_step=step, keep=2)
    if world.rank == 0:
        assert [p.name for p in sorted(d.glob("*.pt"))] == ["ckpt-00000003.pt", "ckpt-00000004.pt"]
        assert not list(d.glob(".*tmp"))


@check
def corrupt_truncated_foreign_checkpoints_refused_untouched(tmp):
    base = Path(hvd.broadcast_object(str(tmp / "ckpt-bad"), name="ckpt.dir3"))
    model, opt, loader = _fresh(0)
    ht.save_checkpoint(base / "good", model, opt, epoch=1, step=0, global_step=9)
    good = (base / "good" / "ckpt-00000009.pt")
    cases = {"garbage": lambda b: b"this is not a checkpoint" * 10, "truncated": lambda b: b[: len(b) // 2]}
    for name, mangle in cases.items():
        path = base / name / "ckpt-00000009.pt"
        if world.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(mangle(good.read_bytes()))
        hvd.barrier()
        before = path.read_bytes() if world.rank == 0 else None
        expect(CheckpointError, lambda: ht.load_checkpoint(path.parent, model, opt), str(path))
        if world.rank == 0:
            assert path.read_bytes() == before, "a refused checkpoint must be left untouched"
    other = torch.nn.Linear(6, 3)
    other_opt = ht.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    expect(CheckpointError, lambda: ht.load_checkpoint(base / "good", other, other_opt), "different model")
    plain = base / "plain" / "ckpt-00000001.pt"
    if world.rank == 0:
        plain.parent.mkdir(exist_ok=True)
        torch.save(model.state_dict(), plain)  # a torch file, but not hvdp's
    hvd.barrier()
    expect(CheckpointError, lambda: ht.load_checkpoint(plain.parent, model, opt), "not an hvdp checkpoint")


@check
def checkpoint_refuses_pickled_code(tmp):
    path = Path(hvd.broadcast_object(str(tmp / "ckpt-evil"), name="ckpt.dir4")) / "ckpt-00000001.pt"
    if world.rank == 0:
        path.parent.mkdir(exist_ok=True)
        torch.save({"hvdp": {"format": "x"}, "payload": Evil()}, path)
    hvd.barrier()
    model, opt, _ = _fresh(0)
    expect(CheckpointError, lambda: ht.load_checkpoint(path.parent, model, opt), "cannot read checkpoint")
    assert not (tmp / "pwned").exists()


class Evil:
    def __reduce__(self):
        return (Path.touch, (Path(sys.argv[2]) / "pwned",))


# ------------------------------------------------------------- ranks that disagree, and one rank's error

class _Files(torch.utils.data.Dataset):
    """A data set that reads a file list, as a DatasetFolder does (its `samples`), here without the files."""

    def __init__(self, names):
        self.samples = list(names)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return torch.tensor([float(i)])


@check
def shard_settings_and_data_must_agree(tmp):
    # What each rank passed is compared before any batch: a mismatch is a ConfigError on every rank that names
    # the rank and the value, instead of overlapping samples (seed=rank) or a hang (different step counts).
    ht.shard(_data(), batch_size=8, seed=3)  # the same on every rank: accepted
    ht.shard(_Files(["a", "b", "c", "d"]), batch_size=1)
    if world.size == 1:
        return
    odd = world.rank == 1
    expect(ConfigError, lambda: ht.shard(_data(), batch_size=8, seed=world.rank), "seed=1 on rank 1, but seed=0")
    expect(ConfigError, lambda: ht.shard(_data(n=95 if odd else 96), batch_size=8), "samples=95 on rank 1")
    expect(ConfigError, lambda: ht.shard(_data(seed=7 if odd else 0), batch_size=8), "fingerprint=")
    names = ["a", "c", "b", "d"] if odd else ["a", "b", "c", "d"]  # a listing taken in another order
    e = expect(ConfigError, lambda: ht.shard(_Files(names), batch_size=1), "the same files in the same order")
    assert "on rank 1" in str(e) and e.rank == world.rank
    expect(ConfigError, lambda: ht.shard(_data(), batch_size=8, drop_last=odd), "drop_last=True on rank 1")
    expect(ConfigError, lambda: ht.shard(_Numbers(10), batch_size=2 if odd else 1), "batch_size=2 on rank 1")


class _Boom(torch.utils.data.Dataset):
    """The evaluation data of _data(), except that sample 2 of rank `bad`'s slice raises KeyError there."""

    def __init__(self, bad):
        self.data, self.bad = _data(n=40), bad

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if world.rank == self.bad and i == world.rank * (40 // world.size) + 2:
            raise KeyError(f"sample {i}")
        return self.data[i]


def _raising(exc, real=None, when=lambda *args: True):
    """A function that raises `exc`; with `real`, only where `when(*args)` holds, else it calls `real`
    (Horovod's object collectives use torch.save and torch.load themselves)."""
    def fail(*args, **kwargs):
        if real is None or when(*args):
            raise exc
        return real(*args, **kwargs)
    return fail


@check
def one_ranks_error_is_raised_on_every_rank(tmp):
    # An arbitrary exception on one rank inside an operation the others are in: the others must not wait.
    from hvdp import _horovod
    from hvdp.core.errors import RankError
    import hvdp.torch.checkpoint as ckpt_module

    last = world.size - 1
    model, opt, _ = _fresh(0)
    e = expect(RankError, lambda: ht.evaluate(model, _Boom(bad=last)), f"rank {last}: KeyError: 'sample")
    assert "hvdp.torch.evaluate failed on 1 of" in str(e)
    assert isinstance(e.__cause__, KeyError) == (world.rank == last)
    base = Path(hvd.broadcast_object(str(tmp / "ckpt-boom"), name="ckpt.boom"))
    real_rng, real_save = ckpt_module._rng_state, torch.save
    try:
        if world.rank == last:
            ckpt_module._rng_state = _raising(MemoryError("no room for the RNG state"))
        expect(RankError, lambda: ht.save_checkpoint(base, model, opt, epoch=0, step=0, global_step=1),
               f"save_checkpoint failed on 1 of {world.size} rank(s), so every rank stops: rank {last}: MemoryError")
        ckpt_module._rng_state = real_rng
        if world.rank == 0:
            torch.save = _raising(ZeroDivisionError("in the writer"), real_save,
                                  when=lambda obj, *_: isinstance(obj, dict) and "hvdp" in obj)
        expect(CheckpointError, lambda: ht.save_checkpoint(base, model, opt, epoch=0, step=0, global_step=2),
               "ZeroDivisionError: in the writer")
    finally:
        ckpt_module._rng_state, torch.save = real_rng, real_save
    ht.save_checkpoint(base, model, opt, epoch=0, step=0, global_step=3)
    real_load = torch.load
    try:
        if world.rank == 0:
            torch.load = _raising(MemoryError("reading"), real_load, when=lambda f, *_: "ckpt-boom" in str(f))
        expect(CheckpointError, lambda: ht.load_checkpoint(base, model, opt), "MemoryError: reading")
    finally:
        torch.load = real_load
    if world.rank == 0:  # a valid header, but no "model" entry: the others must not wait in the broadcast
        payload = torch.load(base / "ckpt-00000003.pt", weights_only=True)
        del payload["model"]
        torch.save(payload, base / "ckpt-00000004.pt")
    hvd.barrier()
    expect(CheckpointError, lambda: ht.load_checkpoint(base, model, opt), "no 'model' entry")
    # init()'s device placement and CPU count: one rank's exception, every rank's error
    real_index, real_share = _horovod.gpu_index, _horovod.cpu_share
    try:
        if world.rank == last:
            _horovod.gpu_index = _raising(OSError("the GPU driver went away"))
        expect(RankError, lambda: ht.init(device="cpu"), f"rank {last}: OSError: the GPU driver went away")
        _horovod.gpu_index = real_index
        if world.rank == last:
            _horovod.cpu_share = _raising(PermissionError("cgroup"))
        _horovod._ready = None  # make init() set this world up again
        expect(RankError, lambda: ht.init(), f"rank {last}: PermissionError: cgroup")
    finally:
        _horovod.gpu_index, _horovod.cpu_share = real_index, real_share
    assert ht.init() == world  # sets the world up again, every rank
    # verify: rank 0's reference run fails, the others would wait for its result
    real_plan = equivalence.ShardPlan
    try:
        if world.rank == 0:
            equivalence.ShardPlan = _raising(ValueError("reference broke"))
        expect(RankError, lambda: equivalence.run("torch", optimizer="sgd", steps=1, batch_size=4, accumulate=1,
                                                  lr=0.02, seed=3), "rank 0: ValueError: reference broke")
    finally:
        equivalence.ShardPlan = real_plan


@check
def a_later_init_is_not_a_collective(tmp):
    # The first init() forms the world; a later one returns it without any collective, so one rank alone may
    # call it (before, it all-gathered the CPU count every time: `if rank == 0: init()` hung).
    if world.rank == 0:
        assert ht.init() == world
    ht.barrier()
    assert ht.average(1.0) == 1.0


# ------------------------------------------------ worker processes and the watchdog's knowledge (issue 36)

class _Pids(torch.utils.data.Dataset):
    """Sample i is (i, the pid of the process that read it): shard(check_items=False), its items differ by rank."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid()])


class _Phases(torch.utils.data.Dataset):
    """Records, in this process (num_workers=0), the phase the watchdog had while each sample was read."""

    def __init__(self):
        self.seen = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        from hvdp import _horovod
        self.seen.append(_horovod._watchdog.phase if _horovod._watchdog is not None else None)
        return torch.tensor([i])


def _pids(loader):
    return {int(p) for batch in loader for p in batch[:, 1]}


@check
def shard_workers_start_by_forkserver_once_per_run(tmp):
    """issue 36: workers started by forkserver (fork in a threaded rank can deadlock), kept from one epoch to
    the next for a map-style dataset; a stream's and persistent_workers=False restart each epoch."""
    kept = ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2)
    assert kept.multiprocessing_context.get_start_method() == "forkserver" and kept.persistent_workers
    first, second = _pids(kept), _pids(kept)
    assert len(first) == 2 and first == second and os.getpid() not in first, (first, second)
    fresh = ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2, persistent_workers=False)
    assert not fresh.persistent_workers and _pids(fresh).isdisjoint(_pids(fresh))
    stream = ht.shard(_Numbers(16), batch_size=2, num_workers=2)
    assert stream.multiprocessing_context.get_start_method() == "forkserver" and not stream.persistent_workers
    # the user's own choice of start method is kept; num_workers=0 starts nothing
    spawned = ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert spawned.multiprocessing_context.get_start_method() == "spawn"
    assert ht.shard(_Pids(), check_items=False, batch_size=2).multiprocessing_context is None


def _lambda_collate(batch):
    return batch


@check
def shard_says_which_object_the_workers_cannot_receive(tmp):
    import threading

    class Local(torch.utils.data.Dataset):  # defined in a function: pickle cannot find it by name
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return i

    locked = _Pids()
    locked.lock = threading.Lock()  # a lock (an open file, a connection) made in this process
    cases = [
        (lambda: ht.shard(Local(), batch_size=2, num_workers=2), ["dataset", "Local", "local object"]),
        (lambda: ht.shard(locked, check_items=False, batch_size=2, num_workers=2), ["dataset", "_Pids", "_thread.lock"]),
        (lambda: ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2, collate_fn=lambda b: b),
         ["collate_fn", "<lambda>"]),
        (lambda: ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2, worker_init_fn=lambda i: None),
         ["worker_init_fn", "<lambda>"]),
        (lambda: ht.shard(_Numbers(16), batch_size=2, num_workers=2, transform=lambda t: t),
         ["transform", "<lambda>"]),
    ]
    for make, words in cases:
        e = expect(ConfigError, make, "cannot be sent to the DataLoader's worker processes")
        assert all(w in str(e) for w in words) and "forkserver" in str(e) and "num_workers=0" in str(e), str(e)
        assert str(e).startswith(f"[rank {world.rank}] shard(num_workers=2): "), str(e)
    # the same objects are fine without workers, and a module-level function is fine with them
    ht.shard(Local(), batch_size=2)
    ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2, collate_fn=_lambda_collate)


@check
def loader_tells_the_watchdog_it_waits_for_a_batch(tmp):
    from hvdp import _horovod
    from hvdp.torch.data import READING_ITEMS
    from hvdp.torch.workers import LOADING
    data = _Phases()
    loader = ht.shard(data, batch_size=2, shuffle=False)
    compared, data.seen = data.seen, []  # shard() read a few items itself, to compare them across the ranks
    batches = list(loader)
    assert len(batches) == -(-8 // (2 * world.size))
    if _horovod._watchdog is None:  # a world of 1: no watchdog to tell
        return
    assert compared and set(compared) == {READING_ITEMS}, compared
    assert data.seen and set(data.seen) == {LOADING}, data.seen
    assert _horovod._watchdog.phase != LOADING  # restored once the batch is handed out


def _in_collective_while_peer_is_late(enter, expected_op, expected_phase=None):
    """Rank 0 enters a collective 1 s after the others; each rank samples what the watchdog knows while it
    waits. The ranks that wait must have seen `expected_op` (and `expected_phase`); afterwards nothing."""
    import threading

    from hvdp import _horovod
    seen, stop = set(), threading.Event()

    def sample():
        while not stop.is_set():
            op, _ = _horovod._collectives.waiting()
            if op is not None:
                seen.add((op, _horovod._watchdog.phase))
            time.sleep(0.01)
    sampler = threading.Thread(target=sample)
    sampler.start()
    if world.rank == 0:
        time.sleep(1.0)
    try:
        enter()
    finally:
        stop.set()
        sampler.join()
    if world.rank != 0:
        ops = {op for op, _ in seen}
        assert expected_op in ops, (expected_op, seen)
        if expected_phase is not None:
            assert (expected_op, expected_phase) in seen, (expected_phase, seen)
    # (other checks may leave handles they never waited for: only this collective must be gone)
    assert _horovod._collectives.waiting() == (None, 0.0) and expected_op not in _horovod._collectives.names()


@check
def watchdog_knows_which_collective_a_rank_waits_in(tmp):
    """issue 36: a rank blocked in any collective, Horovod's or hvdp's, is known by the collective's name (so
    a hang outside the gradient all-reduce names where each rank is)."""
    if world.size == 1:
        return  # no watchdog, no collective
    model, data = _model(0), _data(8)
    cases = [
        (lambda: hvd.allgather_object(1, name="probe.gather"), "allgather.probe.gather.sz", None),
        (lambda: hvd.broadcast_object(1, root_rank=0, name="probe.bcast"), "broadcast.probe.bcast.sz", None),
        (lambda: hvd.barrier(), "barrier", None),
        (lambda: hvd.allreduce(torch.ones(2), name="probe.sum"), "allreduce.probe.sum", None),
        (lambda: ht.barrier(), "barrier", None),
        (lambda: ht.evaluate(model, data), "allgather.hvdp.evaluate.sz", "evaluating (hvdp.torch.evaluate)"),
        (lambda: ht.broadcast(model), "broadcast.0.bias", None),  # broadcast_parameters sorts by name
    ]
    for enter, op, phase in cases:
        _in_collective_while_peer_is_late(enter, op, phase)


@check
def users_own_fork_dataloader_warns_once_naming_the_fix(tmp):
    """issue 36: a DataLoader of the user's with fork workers in a rank (Horovod's threads run) is warned about
    once, at its first use, with the fix; hvdp's own loaders never fork."""
    import warnings

    from hvdp import _workers
    _workers._fork_warned = False
    loader = torch.utils.data.DataLoader(_Pids(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert len(_pids(loader)) == 1
    forks = [str(w.message) for w in caught if "forks this rank's process" in str(w.message)]
    assert len(forks) == 1, forks
    assert "a torch DataLoader with num_workers > 0 and the fork start method" in forks[0], forks[0]
    assert "multiprocessing_context='forkserver'" in forks[0] and "worker_torch.py:" in forks[0], forks[0]
    _workers._fork_warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _pids(ht.shard(_Pids(), check_items=False, batch_size=2, num_workers=2, persistent_workers=False))
    assert not [w for w in caught if "forks this rank's process" in str(w.message)]


@check
def prepare_returns_the_optimizer_to_use_and_leaves_the_model_in_place(tmp):
    # The decision docs/porting.md states: prepare() wraps the optimizer (use the one it returns) and neither
    # copies nor moves the model: its own parameters, where they were, receive rank 0's values.
    model = _model(0)
    params = list(model.parameters())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ht.prepare(model, plain)
    assert opt is not plain and isinstance(opt, torch.optim.Optimizer) and callable(opt.synchronize)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len(params) and all(a is b for a, b in zip(grouped, params))
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert {p.device for p in model.parameters()} == {params[0].device}


@check
def prepare_says_what_it_did_to_the_rate_on_rank_0(tmp):
    import contextlib
    import io
    import warnings

    from hvdp.core.scaling import LRScalingWarning

    model = _model(0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ht.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01), warmup_steps=3)
    said = [line for line in err.getvalue().splitlines() if line.startswith("hvdp: lr ")]
    adaptive = [w for w in caught if issubclass(w.category, LRScalingWarning)]
    if world.rank == 0:
        assert said == [f"hvdp: lr 0.01 -> {0.01 * world.size:g} (lr_scaling='linear': x{world.size} for "
                        f"{world.size} rank(s) x 1 pass(es))" + (", warmup from 0.01 over 3 step(s)" if world.size > 1 else "")], said
        assert len(adaptive) == (1 if world.size > 1 else 0), adaptive  # Adam at linear x N: warned
        assert all("Adam with lr_scaling='linear'" in str(w.message) for w in adaptive)
    else:
        assert not said and not adaptive, (said, adaptive)


# ------------------------------------------------------------------ the models people bring (issue 44)
# Each rank trains through hvdp on its b samples of a global batch of N*b; a plain torch copy trains on the
# whole global batch at the scaled rate (N x base), its loss the mean of the N chunks' mean losses (one
# process's mean over N*b samples, with a branch decided per chunk as each rank decides it).

def _chunks(step, b=4, d=6):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(world.size * b, d, generator=g), torch.randint(0, 3, (world.size * b,), generator=g)
    return [(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for r in range(world.size)]


def _max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


class _Experts(torch.nn.Module):
    """Two experts; which runs is decided per batch (routing), so an expert can go unused on every rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(6, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 3) for _ in range(2))

    def forward(self, x, expert):
        return self.experts[expert](torch.relu(self.trunk(x)))


def _route(step, rank):
    # steps 0-2: expert 0 on every rank (expert 1 unused everywhere); step 3: expert 1 on rank 0 only;
    # step 4: expert 1 everywhere; step 5: expert 0 everywhere again (expert 1 unused, with Adam state)
    return {3: 1 if rank == 0 else 0, 4: 1}.get(step, 0)


@check
def unused_expert_keeps_no_gradient_and_moves_as_in_one_process(tmp):
    # issue 44: Horovod filled an unused expert's gradient with zeros: AdamW decayed and moved it (0.09 in 3 steps)
    model, ref = _Experts(), _Experts()
    opt = ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01 * world.size, weight_decay=0.1)
    for step in range(6):
        chunks = _chunks(step)
        opt.zero_grad()
        F.cross_entropy(model(*chunks[world.rank][:1], _route(step, world.rank)), chunks[world.rank][1]).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(F.cross_entropy(ref(x, _route(step, r)), y) for r, (x, y) in enumerate(chunks)).div(world.size).backward()
        ref_opt.step()
        unused_everywhere = step in (0, 1, 2, 5)
        assert (model.experts[1].weight.grad is None) == unused_everywhere, (step, model.experts[1].weight.grad)
        assert _max_diff(model, ref) < 1e-6, (step, _max_diff(model, ref))
    assert opt.state[model.experts[1].weight]["step"] == ref_opt.state[ref.experts[1].weight]["step"] == 2
    ht.check_consistency(model)


class _SparseText(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(6)
        self.emb = torch.nn.Embedding(20, 4, sparse=sparse)
        self.bag = torch.nn.EmbeddingBag(20, 4, mode="mean", sparse=sparse)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, tokens, with_text=True):
        if not with_text:  # a batch without text: neither embedding is used
            return self.out(torch.zeros(len(tokens), 8))
        return self.out(torch.cat([self.emb(tokens).mean(1), self.bag(tokens)], 1))


@check
def embeddings_dense_and_sparse_average_as_one_process(tmp):
    # issue 44: duplicate token ids within and across ranks are a sum; a rank whose batch used no embedding
    # joins the others' sparse all-gather (Horovod's zero fill sent a dense all-reduce against it: a hang)
    cases = [(False, lambda ps, lr: torch.optim.Adam(ps, lr=lr)), (False, lambda ps, lr: torch.optim.AdamW(ps, lr=lr)),
             (False, lambda ps, lr: torch.optim.RMSprop(ps, lr=lr)), (True, lambda ps, lr: torch.optim.SGD(ps, lr=lr)),
             (True, lambda ps, lr: torch.optim.Adagrad(ps, lr=lr)), (True, lambda ps, lr: torch.optim.SparseAdam(ps, lr=lr))]
    for sparse, make in cases:
        model, ref = _SparseText(sparse), _SparseText(sparse)
        # SparseAdam takes sparse gradients only: it steps the embeddings, the dense layer stays as built
        trained = (lambda m: [p for n, p in m.named_parameters() if not n.startswith("out")]) \
            if make is cases[-1][1] else (lambda m: list(m.parameters()))
        opt = ht.prepare(model, make(trained(model), 0.05))
        ref_opt = make(trained(ref), 0.05 * world.size)
        for step in range(4):
            g = torch.Generator().manual_seed(50 + step)
            tokens = torch.randint(0, 6, (world.size * 3, 5), generator=g)  # few ids: duplicates everywhere
            y = torch.randint(0, 3, (world.size * 3,), generator=g)
            text = [not (step == 2 and r == world.size - 1) for r in range(world.size)]  # last rank: no text once
            mine = slice(world.rank * 3, world.rank * 3 + 3)
            opt.zero_grad()
            F.cross_entropy(model(tokens[mine], text[world.rank]), y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            sum(F.cross_entropy(ref(tokens[r * 3:r * 3 + 3], text[r]), y[r * 3:r * 3 + 3])
                for r in range(world.size)).div(world.size).backward()
            ref_opt.step()
            assert _max_diff(model, ref) < 1e-6, (sparse, type(ref_opt).__name__, step, _max_diff(model, ref))
        ht.check_consistency(model)
    # sharded state keeps flat slices of dense gradients: a sparse embedding is refused before the first step
    # (it raised torch's "reshape is not implemented for sparse tensors" in the backward pass)
    model = _SparseText(sparse=True)
    expect(ConfigError, lambda: ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           shard_optimizer_state=True), "'emb', 'bag' make(s) sparse ones")


class _FineTune(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.backbone = torch.nn.Linear(6, 8)
        self.neck = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.neck(torch.relu(self.backbone(x)))))


def _fine_tune_events(step, model, opt, lr):
    if step == 2:  # unfreeze the neck, which the optimizer held while frozen
        model.neck.requires_grad_(True)
    if step == 3:  # the backbone joins in a param group of its own, with its own rate
        model.backbone.requires_grad_(True)
        opt.add_param_group({"params": list(model.backbone.parameters()), "lr": lr / 2})


def _fine_tune_setup(prepared):
    model = _FineTune()
    model.backbone.requires_grad_(False)
    model.neck.requires_grad_(False)
    params = list(model.neck.parameters()) + list(model.head.parameters())
    if prepared:
        return model, ht.prepare(model, torch.optim.AdamW(params, lr=0.01, weight_decay=0.05))
    return model, torch.optim.AdamW(params, lr=0.01 * world.size, weight_decay=0.05)


def _fine_tune_step(step, model, opt, lr, reference):
    _fine_tune_events(step, model, opt, lr)
    chunks = _chunks(step)
    opt.zero_grad()
    if reference:
        sum(F.cross_entropy(model(x), y) for x, y in chunks).div(world.size).backward()
    else:
        F.cross_entropy(model(chunks[world.rank][0]), chunks[world.rank][1]).backward()
    opt.step()


@check
def unfrozen_and_added_parameters_train_as_in_one_process_and_resume(tmp):
    # issue 44: a parameter unfrozen after prepare(), or added by add_param_group(), had no hook: it trained on
    # its rank's own gradient (replicas 0.088 apart after 3 steps) at an unscaled rate
    model, opt = _fine_tune_setup(prepared=True)
    ref, ref_opt = _fine_tune_setup(prepared=False)
    directory = tmp / "fine_tune"
    for step in range(6):
        _fine_tune_step(step, model, opt, 0.01, reference=False)
        _fine_tune_step(step, ref, ref_opt, 0.01 * world.size, reference=True)
        assert _max_diff(model, ref) < 1e-6, (step, _max_diff(model, ref))
        if step == 4:
            ht.save_checkpoint(directory, model, opt, epoch=0, step=step + 1, global_step=step + 1)
    ht.check_consistency(model)
    assert opt.param_groups[1]["lr"] == pytest_approx(0.01 / 2 * world.size)
    # resumed: the script re-creates the same groups (as it must for torch's load_state_dict), then loads
    again, again_opt = _fine_tune_setup(prepared=True)
    for step in range(4):
        _fine_tune_events(step, again, again_opt, 0.01)
    ht.load_checkpoint(directory, again, again_opt)
    _fine_tune_step(5, again, again_opt, 0.01, reference=False)
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), model.parameters()))


def pytest_approx(x, rel=1e-9):
    class _Approx(float):
        def __eq__(self, other):
            return abs(other - x) <= rel * abs(x)
    return _Approx(x)


@check
def state_rank_0_restored_before_prepare_reaches_every_rank(tmp):
    # Horovod's resume recipe: rank 0 loads the optimizer state, prepare() broadcasts it. Horovod's wrapper is
    # a new optimizer over the same param groups, built empty: the restored state was dropped on rank 0 too
    source = _Experts()
    trained = torch.optim.AdamW(source.parameters(), lr=0.01)
    F.cross_entropy(source(torch.randn(4, 6), 0), torch.tensor([0, 1, 2, 0])).backward()
    trained.step()  # rank-local values: the state rank 0 saved
    saved = hvd.broadcast_object(trained.state_dict() if world.rank == 0 else None, root_rank=0, name="test.saved")
    model = _Experts()
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    if world.rank == 0:
        plain.load_state_dict(saved)
    opt = ht.prepare(model, plain)
    got = opt.state_dict()["state"]
    assert sorted(got) == sorted(saved["state"]) and got, (sorted(got), sorted(saved["state"]))
    for index, entries in saved["state"].items():
        for key, value in entries.items():
            assert torch.equal(got[index][key], value), (index, key)


@check
def synchronize_twice_reduces_once(tmp):
    # issue 44: a second synchronize() in a step (a logging helper, then the clipping recipe) reduced the
    # already-reduced gradients again: with op="sum" they grew N-fold
    model = _Experts()
    opt = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), op="sum")
    x, y = _chunks(0)[world.rank]
    F.cross_entropy(model(x, 0), y).backward()
    opt.synchronize()
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    with opt.skip_synchronize():
        opt.step()
    second = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))
    opt.zero_grad()
    F.cross_entropy(model(x, 0), y).backward()
    opt.synchronize()
    after = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.step()  # step() after synchronize(), no skip_synchronize: no second reduce either
    assert all(torch.equal(a, p.grad) for a, p in zip(after, [p for p in model.parameters() if p.grad is not None]))


class _RandomData(torch.utils.data.Dataset):
    """The DDP tutorial's dataset: its data drawn with torch.rand when it is built."""

    def __init__(self, n=64):
        self.x, self.y = torch.rand(n, 6), torch.randint(0, 3, (n,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class _Augmented(_RandomData):
    def __getitem__(self, i):  # a random augmentation from the global generator: not a difference in the data
        return self.x[i] + 0.01 * torch.randn(6), self.y[i]


@check
def custom_datasets_and_evaluation_data_checked_across_ranks(tmp):
    # issue 44: shard()'s fingerprint covered tensors, arrays and file lists only: the DDP tutorial's unseeded
    # dataset trained each rank on other data, silently; evaluate() took any data
    torch.manual_seed(100 + world.rank)
    unseeded = _RandomData()
    if world.size > 1:
        e = expect(ConfigError, lambda: ht.shard(unseeded, batch_size=4), "torch.manual_seed(0)")
        assert "rank 1" in str(e), e
    torch.manual_seed(0)
    seeded = _RandomData()
    ht.shard(seeded, batch_size=4)
    torch.manual_seed(0)
    augmented = _Augmented()
    torch.manual_seed(100 + world.rank)  # the ranks' generators differ: the items are read alike all the same
    before = torch.rand(1)
    torch.manual_seed(100 + world.rank)
    ht.shard(augmented, batch_size=4)
    assert torch.equal(torch.rand(1), before)  # and the global generator is left as it was
    ht.shard(unseeded, batch_size=4, check_items=False)  # the way out for a dataset hvdp cannot read alike
    model = torch.nn.Linear(6, 3)
    data = _data(n=40)
    exact = ht.evaluate(model, data)
    order = torch.randperm(40) if world.rank else torch.arange(40)  # an unseeded shuffle on rank 1
    shuffled = torch.utils.data.TensorDataset(*(t[order] for t in data.tensors))
    if world.size > 1:
        e = expect(ConfigError, lambda: ht.evaluate(model, shuffled), "evaluate()")
        assert "fingerprint" in str(e) and "rank 1" in str(e), e
        expect(ConfigError, lambda: ht.evaluate(model, unseeded), "torch.manual_seed(0)")
    assert ht.evaluate(model, seeded)["samples"] == 64 and exact["samples"] == 40


@check
def evaluate_scores_a_binary_classifier(tmp):
    # issue 44: a binary classifier's one logit per sample went through cross_entropy (0 over one class) and
    # argmax(1) (always 0): loss 0 and the accuracy of predicting class 0, silently
    torch.manual_seed(0)
    x = torch.randn(50, 6)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Linear(6, 1)
    out = model(x).detach()
    got = ht.evaluate(model, torch.utils.data.TensorDataset(x, y))
    loss = float(F.binary_cross_entropy_with_logits(out[:, 0], y.float()))
    accuracy = float(((out[:, 0] > 0).long() == y).float().mean())
    assert abs(got["loss"] - loss) < 1e-6 and abs(got["accuracy"] - accuracy) < 1e-6, (got, loss, accuracy)
    flat = ht.evaluate(torch.nn.Sequential(model, torch.nn.Flatten(0)), torch.utils.data.TensorDataset(x, y))
    assert abs(flat["loss"] - loss) < 1e-6 and flat["accuracy"] == got["accuracy"], flat


@check
def a_name_is_taken_while_its_operation_is_in_flight(tmp):
    # issue 52: the rule for two operations of one name, as Horovod's engine keeps it (docs/internals.md): a
    # second submission while the first is in flight in the engine (submitted here, not yet done by every rank)
    # raises ValueError on that rank; once it is done, the name is free again, synchronized or not.
    if world.size == 1:
        return
    tensor = torch.arange(8, dtype=torch.float32) * (world.rank + 1)
    if world.rank == 0:  # the others post theirs only after the barrier: rank 0's first one cannot complete
        first = hvd.broadcast_async(tensor.clone(), root_rank=0, name="hvdp.test.same_name")
        expect(ValueError, lambda: hvd.broadcast_async(tensor.clone(), root_rank=0, name="hvdp.test.same_name"),
               "same name")
    hvd.barrier()
    if world.rank > 0:
        first = hvd.broadcast_async(tensor.clone(), root_rank=0, name="hvdp.test.same_name")
    assert torch.equal(hvd.synchronize(first), torch.arange(8, dtype=torch.float32))
    hvd.barrier()  # done on every rank: the name is free
    again = hvd.broadcast_async(tensor.clone(), root_rank=0, name="hvdp.test.same_name")
    assert torch.equal(hvd.synchronize(again), torch.arange(8, dtype=torch.float32))


@check
def peeking_at_a_batch_warns_that_its_epoch_went_by(tmp):
    import warnings

    from hvdp.torch.data import PeekWarning

    loader = ht.shard(_data(), batch_size=8)
    next(iter(loader))  # a peek: epoch 0 ends here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the next epoch (warned about once), then another
            for _ in loader:
                pass
    peeks = [w for w in caught if issubclass(w.category, PeekWarning)]
    assert len(peeks) == 1 and "epoch 0" in str(peeks[0].message), [str(w.message) for w in caught]


if __name__ == "__main__":
    world = ht.init()
    main(lambda obj: hvd.allgather_object(obj, name="checks.results"), world.rank)
