"""A benchmark worker's side of taking turns (hvdp/tools/rotation.py is the coordinator's).

    turns = Turns.from_args(args, rank)   # --turns DIR --job NAME [--instance K]; without --turns: always on
    turns.wait("warmup")                  # returns when it is this job's turn
    ...warm up...
    turns.done("warmup", {})
    for rep in range(args.reps):
        turns.wait(rep)
        ...time one repetition...
        turns.done(rep, {"samples_per_sec": rate})

Without --turns a worker runs its repetitions back to back, as a single run (the np=1 measurements).
"""

import json
import time
from pathlib import Path

from hvdp.tools.rotation import write_whole

POLL_S = 0.001


class Turns:
    def __init__(self, directory: str | None, job: str, process: int, index: int | None):
        """`process`: this process's number in the job (its ready file); `index`: its result file's number, or
        None when it writes none."""
        self.directory = Path(directory) if directory else None
        self.job, self.index = job, index
        if self.directory:
            write_whole(self.directory / f"{job}.{process}.ready", "")

    @classmethod
    def from_args(cls, args, rank: int) -> "Turns":
        """Process `rank` of a distributed job (rank 0 writes the results), or instance --instance of the
        independent processes (each writes its own)."""
        if args.instance is not None:
            return cls(args.turns, args.job, args.instance, args.instance)
        return cls(args.turns, args.job, rank, 0 if rank == 0 else None)

    def wait(self, rep) -> None:
        if not self.directory:
            return
        mine, turn = f"{self.job} {rep}", self.directory / "turn"
        while True:
            now = turn.read_text()
            if now == mine:
                return
            if now == "stop":
                raise SystemExit(f"bench: stopped by the coordinator while waiting for {mine}")
            time.sleep(POLL_S)

    def done(self, rep, record: dict) -> None:
        if self.directory and self.index is not None:
            write_whole(self.directory / f"{self.job}.{rep}.{self.index}.json", json.dumps(record))


def add_arguments(parser) -> None:
    parser.add_argument("--turns", help="take turns with the other jobs through this directory (hvdp bench)")
    parser.add_argument("--job", default="", help="this job's name in the rotation")
    parser.add_argument("--instance", type=int, help="which of the independent plain processes this is")

