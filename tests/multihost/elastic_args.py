"""The command line both elastic workers (elastic_worker.py, elastic_worker_keras.py) take from test_elastic.py;
imported from the worker's own directory (a script's directory is first on sys.path)."""

import argparse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--progress", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--until-readmitted", action="store_true",
                   help="keep training past --epochs until the world has shrunk and grown back")
    p.add_argument("--until-shrunk", action="store_true", help="keep training past --epochs until the world shrank")
    p.add_argument("--lost-after-save", metavar="FILE",
                   help="(hvdp.torch) once FILE exists, the worker on hostb exits in its next commit, after the "
                        "commit was saved on every rank, in its host check; it removes FILE first")
    p.add_argument("--shard", action="store_true",
                   help="(hvdp.torch) shard_optimizer_state=True; check the state rebuilt after each reset")
    return p.parse_args()
