"""What the straggler report's per-step accounting (issue 47) costs a step, timed in one process (the figures of
docs/benchmarks.md#step-accounting-and-the-straggler-report-issue-47; the multi-rank bench's rounds move by
more than these costs on a shared machine):

- torch: the five hooks of one step (the loader's wait, the end of backward, the gradient collectives, the
  optimizer's start and end) and its closing, plain Python;
- TensorFlow custom loop: a compiled step carrying the three marks (gradients ready, reduced, applied)
  against the same step without them, and the iterator's hooks (the wait for a batch, the close: one read of
  the marks) against none.

    .venv/bin/python benchmarks/step_accounting.py [--steps N]

Best of 5 repetitions of N steps each (the least disturbed one); prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best(fn, steps: int) -> float:
    """The least seconds per call of `fn` over 5 repetitions of `steps` calls."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps)
    return min(times)


def torch_hooks(steps: int) -> float:
    from hvdp import _stragglers

    class Alone:  # a world of 1: a period's report gathers nothing
        def size(self):
            return 1

    hvd = Alone()

    def step():
        t = time.perf_counter()
        _stragglers.loader_wait(t, time.perf_counter())
        _stragglers.backward_done()
        _stragglers.collective_wait(time.perf_counter())
        began = _stragglers.step_begin()
        _stragglers.step_end(hvd, began)

    return best(step, steps)


def tf_loop(steps: int) -> dict:
    import tensorflow as tf

    import hvdp.tensorflow as htf
    from hvdp import _keras_steps, _stragglers

    htf.init()
    loop = _keras_steps.LOOP
    from hvdp.tensorflow.runtime import hvd
    loop.hvd, loop.marks = hvd, _keras_steps.Marks()  # what shard() makes in a world of 2+
    marks = loop.marks
    x = tf.random.normal((32, 32))

    @tf.function
    def plain(x):
        return tf.matmul(x, x)

    @tf.function
    def marked(x):
        return marks.mark("optimizer", marks.mark("wait", marks.mark("compute", tf.matmul(x, x))))

    def hooked(fn):
        def step():
            asked = time.time()
            loop.fetch(asked)
            loop.arrived(asked, time.time())
            fn(x)
        return step

    loop.epoch_begin()
    plain(x), marked(x)
    base = best(lambda: plain(x), steps)
    with_marks = best(lambda: marked(x), steps)
    before = _stragglers.steps
    both = best(hooked(marked), steps)
    loop.fetch(time.time())  # the last step closed
    closed = _stragglers.steps - before
    return {"step_us": base * 1e6, "marks_us": (with_marks - base) * 1e6, "marks_and_hooks_us": (both - base) * 1e6,
            "closed": closed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000, help="steps per repetition (default 5000)")
    args = parser.parse_args()
    from hvdp import _stragglers
    torch_us = torch_hooks(args.steps * 20) * 1e6
    torch_closed = _stragglers.steps
    loop = tf_loop(args.steps)
    print(json.dumps({"torch_hooks_us": torch_us, "tensorflow_loop": {k: v for k, v in loop.items() if k != "closed"},
                      "steps_closed": {"torch": torch_closed, "tensorflow": loop["closed"]}}))


if __name__ == "__main__":
    main()
