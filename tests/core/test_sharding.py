import numpy as np
import pytest

from hvdp.core.errors import ConfigError
from hvdp.core.sharding import (ShardPlan, StreamSplit, epoch_order, eval_bounds, eval_means, exact_weight, keepers,
                                real_count)


def plans(n, b, size, **kw):
    return [ShardPlan(n=n, batch_size=b, rank=r, size=size, **kw) for r in range(size)]


def test_order_depends_only_on_seed_and_epoch():
    np.random.seed(123)  # the global RNG must not matter
    a = epoch_order(100, seed=7, epoch=3)
    np.random.seed(999)
    b = epoch_order(100, seed=7, epoch=3)
    assert np.array_equal(a, b)
    assert sorted(a.tolist()) == list(range(100))
    assert not np.array_equal(a, epoch_order(100, seed=7, epoch=4))
    assert not np.array_equal(a, epoch_order(100, seed=8, epoch=3))


@pytest.mark.parametrize("n,b,size,drop_last", [
    (96, 8, 4, False), (100, 8, 4, False), (100, 8, 4, True), (97, 5, 3, False), (1797, 32, 2, False),
    (10, 3, 3, True),
])
def test_ranks_disjoint_and_covering(n, b, size, drop_last):
    ps = plans(n, b, size, seed=1, drop_last=drop_last)
    steps = {p.steps_per_epoch for p in ps}
    assert len(steps) == 1, "every rank must run the same number of steps (or the job hangs)"
    seen = [np.concatenate(list(p.batches(epoch=0))) for p in ps]
    union = np.concatenate(seen)
    assert len(union) == len(set(union.tolist())), "a sample was seen by two ranks"
    if drop_last:
        assert len(union) == (n // (b * size)) * b * size
    else:
        assert sorted(union.tolist()) == list(range(n))


@pytest.mark.parametrize("n,b,size", [(96, 8, 4), (64, 4, 2), (100, 8, 4), (1797, 32, 2)])
def test_each_step_equals_one_big_batch(n, b, size):
    """At every step, N ranks with batch b see exactly what one process with batch N*b sees."""
    big = ShardPlan(n=n, batch_size=b * size, seed=5)
    small = plans(n, b, size, seed=5)
    assert big.steps_per_epoch == small[0].steps_per_epoch
    for epoch in range(2):
        for step in range(big.steps_per_epoch):
            joined = np.concatenate([p.batch(epoch, step) for p in small])
            assert np.array_equal(joined, big.batch(epoch, step))


def test_reshuffles_every_epoch():
    p = ShardPlan(n=64, batch_size=8, rank=0, size=2, seed=0)
    e0 = np.concatenate(list(p.batches(0)))
    e1 = np.concatenate(list(p.batches(1)))
    assert not np.array_equal(e0, e1)


def test_no_shuffle_is_sequential():
    p = ShardPlan(n=8, batch_size=2, rank=1, size=2, shuffle=False)
    assert [b.tolist() for b in p.batches(0)] == [[2, 3], [6, 7]]


def test_resume_mid_epoch():
    p = ShardPlan(n=64, batch_size=4, rank=1, size=2, seed=3)
    full = list(p.batches(2))
    assert [b.tolist() for b in p.batches(2, start_step=3)] == [b.tolist() for b in full[3:]]


def test_tail_smaller_than_world_is_topped_up():
    # 9 samples, 2 ranks x 4: step 0 takes 8, the last global batch holds 1 sample for 2 ranks.
    ps = plans(9, 4, 2, seed=0)
    last = [p.batch(0, 1) for p in ps]
    assert all(len(b) == 1 for b in last), "no rank may get an empty batch"
    all_seen = np.concatenate([np.concatenate(list(p.batches(0))) for p in ps])
    assert sorted(set(all_seen.tolist())) == list(range(9))


@pytest.mark.parametrize("n,b,before,after,steps_before", [
    (240, 4, 2, 1, 7), (240, 4, 1, 2, 5), (100, 3, 2, 3, 4), (97, 5, 3, 2, 1), (50, 4, 2, 1, 0)])
def test_resize_mid_epoch_covers_the_rest_exactly_once(n, b, before, after, steps_before):
    """An elastic job trains `steps_before` steps on `before` ranks, then the rest of the epoch on `after`
    ranks from the offset reached: every sample of the epoch is trained on exactly once."""
    old = plans(n, b, before, seed=4)
    trained = [p.batch(1, step) for step in range(steps_before) for p in old]
    offset = old[0].consumed(0, steps_before)
    assert offset == min(n, steps_before * b * before)
    new = plans(n, b, after, seed=4)
    steps = {p.steps_for(n - offset) for p in new}
    assert len(steps) == 1, "every rank must run the same number of steps"
    trained += [batch for p in new for batch in p.batches(1, offset=offset)]
    assert sorted(np.concatenate(trained).tolist()) == list(range(n))


def test_offset_outside_the_epoch_is_an_error():
    with pytest.raises(IndexError, match="offset 65 outside an epoch of 64 samples"):
        ShardPlan(n=64, batch_size=4).batch(0, 0, offset=65)


@pytest.mark.parametrize("kw,match", [
    (dict(n=1, batch_size=1, rank=0, size=2), "1 samples but the job has 2 ranks"),
    (dict(n=10, batch_size=6, rank=0, size=2), r"batch_size \(6\) is larger than each rank's shard"),
    (dict(n=10, batch_size=0), "batch_size must be >= 1"),
])
def test_bad_plans_are_clear_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        ShardPlan(**kw)


@pytest.mark.parametrize("n,size", [(10, 3), (360, 2), (359, 4), (2, 4), (0, 2), (1797, 7)])
def test_eval_bounds_count_every_sample_once(n, size):
    bounds = [eval_bounds(n, r, size) for r in range(size)]
    covered = [i for lo, hi in bounds for i in range(lo, hi)]
    assert covered == list(range(n))
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("n,b,size,passes,offset", [
    (51, 4, 2, 1, 0),    # the last global batch holds 3 samples: split 2/1
    (49, 4, 2, 1, 0),    # 1 sample for 2 ranks: rank 1's batch only tops it up
    (103, 5, 3, 1, 0),   # 13 left for 3 ranks: 5/4/4
    (100, 8, 4, 3, 0),   # 4 steps: the last accumulates 1 partial batch where 3 were expected
    (90, 4, 2, 4, 0),    # 12 batches (the last partial), 4 per step: 4 steps
    (98, 3, 2, 2, 17),   # resumed 17 samples into the epoch (a resized elastic world)
    (96, 8, 4, 1, 0),    # divisible: every weight is exactly 1
])
def test_weighted_gradients_are_the_one_process_mean_at_every_step(n, b, size, passes, offset):
    """Each sample has a 'gradient' (a number); a rank's batch gives its mean. The average over ranks and
    accumulated batches, each weighted by gradient_weight(), must be the mean over the step's samples that
    one process computes, at every step, the partial last one included."""
    value = np.random.default_rng(0).standard_normal(n)
    ps = plans(n, b, size, seed=2)
    order = epoch_order(n, seed=2, epoch=0)[offset:]
    steps = ps[0].steps_for(n - offset)
    global_batch = b * size
    for first in range(0, steps, passes):
        batches = range(first, min(first + passes, steps))
        average = sum(p.gradient_weight(j, offset, passes) * value[p.batch(0, j, offset=offset)].mean()
                      for p in ps for j in batches) / (size * passes)
        samples = order[first * global_batch:min(len(order), (batches[-1] + 1) * global_batch)]
        assert average == pytest.approx(value[samples].mean(), rel=1e-12), (first, list(batches))
    full = [p.gradient_weight(j, offset, passes) for p in ps for j in range(steps)
            if (j // passes + 1) * passes * global_batch <= n - offset]
    assert set(full) <= {1.0}, "a step of full batches must keep every gradient as it is"


def test_a_top_up_batch_weighs_nothing():
    ps = plans(49, 4, 2, seed=0)  # step 6 holds one real sample, on rank 0
    assert [p.real_samples(6) for p in ps] == [1, 0]
    assert [p.gradient_weight(6) for p in ps] == [2.0, 0.0]


# ------------------------------------------------------------------------------------------ streams

def stream_steps(n, b, size, rank, *, workers=1, start_step=0, drop_last=False):
    """{step: (elements, count)} of one rank, its workers' outputs merged as the loader takes them in turn."""
    split = StreamSplit(batch_size=b, rank=rank, size=size, drop_last=drop_last)
    outputs = [list(split.batches(iter(range(n)), start_step=start_step, worker=w, workers=workers))
               for w in range(workers)]
    merged, k = [], 0
    while any(k < len(out) for out in outputs):
        merged += [out[k] for out in outputs if k < len(out)]
        k += 1
    steps = [step for step, _, _ in merged]
    assert steps == list(range(start_step, start_step + len(merged))), f"steps out of order: {steps}"
    return {step: (elements, count) for step, elements, count in merged}


@pytest.mark.parametrize("n,b,size", [(96, 8, 4), (100, 8, 4), (97, 5, 3), (17, 8, 2), (9, 4, 2), (2, 1, 2),
                                      (37, 3, 5), (21, 4, 5)])
@pytest.mark.parametrize("workers", [1, 3])
def test_stream_split_is_the_plan_of_the_stream_order(n, b, size, workers):
    # ranks with batch b see at every step what ShardPlan gives them with the stream's order as the epoch
    # order (shuffle=False), so one process reading the stream with batch N*b sees their union
    for drop_last in (False, True):
        per_rank = [stream_steps(n, b, size, r, workers=workers, drop_last=drop_last) for r in range(size)]
        assert len({len(steps) for steps in per_rank}) == 1, "ranks must get the same number of steps"
        if b <= n // size:
            plan_steps = ShardPlan(n=n, batch_size=b, size=size, shuffle=False, drop_last=drop_last).steps_per_epoch
            assert len(per_rank[0]) == plan_steps
        for step in per_rank[0]:
            counts = {steps[step][1] for steps in per_rank}
            assert counts == {min(b * size, n - step * b * size)}, counts
            union = [e for steps in per_rank for e in steps[step][0]]
            real = [e for r, steps in enumerate(per_rank)
                    for e in steps[step][0][:real_count(steps[step][1], b, size, r)]]
            assert real == list(range(step * b * size, min(n, (step + 1) * b * size))), (step, union)
            assert all(steps[step][0] for steps in per_rank), "every rank needs a sample at every step"
            if b <= n // size:
                for r, steps in enumerate(per_rank):
                    expected = ShardPlan(n=n, batch_size=b, rank=r, size=size, shuffle=False).batch(0, step)
                    assert steps[step][0] == expected.tolist(), (r, step)


@pytest.mark.parametrize("workers", [1, 2])
def test_stream_resumes_at_a_step(workers):
    whole = stream_steps(103, 4, 3, 1, workers=workers)
    resumed = stream_steps(103, 4, 3, 1, workers=workers, start_step=5)
    assert resumed == {step: v for step, v in whole.items() if step >= 5}
    assert stream_steps(20, 4, 3, 1, start_step=9) == {}  # past the end: nothing (the loader says so)


def test_stream_weights_make_the_last_step_exact():
    # 2 ranks x 8, 17 elements: the last step has 1 element, on rank 0; rank 1 repeats element 0 with weight 0
    last = [stream_steps(17, 8, 2, r)[1] for r in range(2)]
    assert last == [([16], 1), ([0], 1)]
    weights = [exact_weight(real_count(1, 8, 2, r), 1, 2, 1) for r in range(2)]
    assert weights == [2.0, 0.0]  # the ranks' average of (2 * g16, 0 * g0) is g16, one process's step
    assert exact_weight(8, 16, 2, 1) == 1.0


def test_stream_split_refuses_bad_arguments():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="batch_size must be an integer >= 1"):
            StreamSplit(batch_size=bad)
    with pytest.raises(ConfigError, match="outside a world of size 2"):
        StreamSplit(batch_size=1, rank=2, size=2)


def test_eval_means_are_the_means_of_the_summed_slices_and_refuse_an_empty_set():
    # 3 ranks' slices of 7 samples (eval_bounds): the all-reduced sums give the one-process means.
    losses, correct = [0.5, 1.0, 1.5, 2.0, 0.25, 0.75, 3.0], [1, 0, 1, 1, 0, 1, 1]
    sums = [0.0, 0.0, 0.0]
    for r in range(3):
        lo, hi = eval_bounds(7, r, 3)
        sums = [sums[0] + sum(losses[lo:hi]), sums[1] + sum(correct[lo:hi]), sums[2] + hi - lo]
    assert eval_means({"loss": sums[0], "accuracy": sums[1]}, sums[2], rank=0) == \
        {"loss": sum(losses) / 7, "accuracy": 5 / 7, "samples": 7}
    with pytest.raises(ConfigError, match=r"rank 2.*empty dataset: nothing to score"):
        eval_means({"loss": 0.0}, 0.0, rank=2)


# ------------------------------------------------------------------ elastic keepers (issue 45 item 3)

def _hosts(*counts, interleaved=False):
    """Host names per rank: counts[h] ranks on host h, listed host by host (or round-robin, as a launcher
    that spreads ranks may number them)."""
    if not interleaved:
        return [f"h{h}" for h, c in enumerate(counts) for _ in range(c)]
    out, left = [], list(counts)
    while any(left):
        for h, c in enumerate(left):
            if c:
                out.append(f"h{h}")
                left[h] -= 1
    return out


LAYOUTS = {"1x1": _hosts(1), "1x2": _hosts(2), "1x8": _hosts(8), "2x1": _hosts(1, 1), "2x8": _hosts(8, 8),
           "4x8": _hosts(8, 8, 8, 8), "3x4 interleaved": _hosts(4, 4, 4, interleaved=True),
           "uneven 3+2+1": _hosts(3, 2, 1), "uneven 5+3 interleaved": _hosts(5, 3, interleaved=True),
           "uneven 4+4+2+1+1": _hosts(4, 4, 2, 1, 1), "big host 5+1+1": _hosts(5, 1, 1)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_keepers_hold_two_slices_each_and_survive_any_host(layout):
    hosts = LAYOUTS[layout]
    size = len(hosts)
    kept = keepers(hosts)
    held = [1 + sum(1 for r in range(size) if kept[r] == k and kept[r] != r) for k in range(size)]
    assert sorted(kept) == list(range(size)), kept            # a permutation: each rank keeps exactly one other
    assert max(held) <= min(2, size), (kept, held)            # own slice + one: 2/N of the state (1/1 alone)
    assert all(kept[r] != r for r in range(size)) or size == 1, kept
    for lost in set(hosts):  # a single host lost: every slice it held is kept elsewhere
        survivors = {r for r in range(size) if hosts[r] != lost}
        orphans = [r for r in range(size) if r not in survivors and kept[r] not in survivors]
        if 2 * hosts.count(lost) <= size:
            assert not orphans, (layout, lost, kept)
        else:  # a host of more than half the ranks (or the only one): at most its excess over the others
            assert len(orphans) <= 2 * hosts.count(lost) - size, (layout, lost, orphans)


def test_keepers_on_two_hosts_of_eight_are_the_same_local_rank_on_the_other_host():
    # issue 45: every rank of host h kept its copy on the first rank of host h+1: ranks 0 and 8 held 9/16
    assert keepers(_hosts(8, 8)) == [r + 8 for r in range(8)] + list(range(8))
    assert keepers(_hosts(8)) == list(range(1, 8)) + [0]
