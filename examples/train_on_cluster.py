"""Train the digits CNN on a Spark or a Ray cluster: the examples' train() functions, launched by hvdp.spark
and hvdp.ray instead of horovodrun.

    python examples/train_on_cluster.py spark --master 'local-cluster[2,1,1024]' --workers 2
    python examples/train_on_cluster.py spark --master spark://head:7077 --workers 8 --framework keras
    python examples/train_on_cluster.py ray --address head:6379 --workers 4
    python examples/train_on_cluster.py ray --address head:6379 --elastic --min-workers 2 --workers 4

The driver imports neither torch nor TensorFlow: the training function goes by name ("train_torch:train"),
imported by the workers, so this folder must be importable there (PYTHONPATH, or your own package). The
training flags of train_torch.py apply (--epochs, --batch-size, ...). Every rank's result is printed, the
ranks' final weights are compared (exit 1 if any differs), and the last line is `result: {json}` (rank 0's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import DEFAULTS, fail, print_result
from hvdp import TrainConfig
from hvdp.core.errors import ConfigError, HvdpError

TARGETS = {("torch", False): "train_torch:train", ("keras", False): "train_keras:train",
           ("torch", True): "train_torch_elastic:train"}


def parse() -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cluster", choices=("spark", "ray"), help="the cluster to run on")
    parser.add_argument("--master", help="Spark: the master URL (default: spark-submit's or spark-defaults.conf's)")
    parser.add_argument("--address", help="Ray: the head's host:port, 'auto' or 'local' (default: RAY_ADDRESS)")
    parser.add_argument("--workers", type=int, default=2, help="training processes (elastic: the most)")
    parser.add_argument("--min-workers", type=int, help="elastic: the fewest training goes on with (default 1)")
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch", help="(default: torch)")
    parser.add_argument("--elastic", action="store_true", help="Horovod elastic (PyTorch)")
    TrainConfig.add_arguments(parser, **DEFAULTS)
    args = parser.parse_args()
    if args.elastic and args.framework != "torch":
        parser.error("--elastic is PyTorch only (Keras 3 has no elastic mode in hvdp)")
    try:
        return args, TrainConfig.from_args(args)
    except ConfigError as e:
        parser.error(str(e))


def launch(args: argparse.Namespace, cfg: TrainConfig) -> list[dict]:
    target = TARGETS[(args.framework, args.elastic)]
    if args.cluster == "spark":
        import hvdp.spark
        hvdp.spark.session(args.master, app_name="hvdp digits")  # hvdp: Java checked, executors on this Python
        if args.elastic:  # hvdp: one rank per Spark task; the others go on when one fails
            return hvdp.spark.run_elastic(target, num_proc=args.workers, min_num_proc=args.min_workers or 1,
                                          max_num_proc=args.workers, args=(cfg,), all_ranks=True)
        return hvdp.spark.run(target, num_proc=args.workers, args=(cfg,), all_ranks=True)
    import hvdp.ray
    if args.elastic:  # hvdp: one rank per Ray actor; the job follows the cluster's nodes
        return hvdp.ray.run_elastic(target, min_workers=args.min_workers or 1, max_workers=args.workers,
                                    args=(cfg,), address=args.address, all_ranks=True)
    return hvdp.ray.run(target, num_workers=args.workers, args=(cfg,), address=args.address, all_ranks=True)


def main() -> None:
    args, cfg = parse()
    started = time.perf_counter()
    results = launch(args, cfg)
    for result in results:
        print(f"rank {result['rank']}: {json.dumps(result, sort_keys=True)}", flush=True)
    if len({r["weights_sha256"] for r in results}) != 1:
        print("error: the ranks' final weights differ", file=sys.stderr)
        sys.exit(1)
    print_result({**results[0], "launch_seconds": round(time.perf_counter() - started, 2)})


if __name__ == "__main__":
    try:
        main()
    except HvdpError as e:
        fail(e)
