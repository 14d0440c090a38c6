"""A tiny registry for checks that run inside a launched job (see tests/launch.py:run_checks).

A worker script defines checks with @check, then calls main(allgather_object, rank). Every rank runs
every check; the results of all ranks are gathered, and rank 0 writes them to the JSON file named on the
command line, so pytest asserts each check separately and one failure does not hide the rest.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import traceback
from pathlib import Path

CHECKS: dict = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def main(allgather_object, rank: int) -> None:
    out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
    results = {}
    only = os.environ.get("HVDP_CHECKS")  # a comma-separated subset, when working on a few checks
    for name, fn in CHECKS.items():
        if only and name not in only.split(","):
            continue
        print(f"[rank {rank}] check {name}", file=sys.stderr, flush=True)
        try:
            fn(tmp)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=6)
            # at once too: a check that failed on one rank may leave the others waiting, and then no results come
            print(f"[rank {rank}] check {name} failed:\n{results[name]}", file=sys.stderr, flush=True)
    gathered = allgather_object(results)
    if rank == 0:
        merged = {name: {str(r): res[name] for r, res in enumerate(gathered)} for name in results}
        out.write_text(json.dumps(merged, indent=1))


def check_names(worker: Path) -> list[str]:
    """Names of the @check functions in `worker`, read without importing it (nor its framework)."""
    tree = ast.parse(Path(worker).read_text())
    return [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(getattr(d, "id", None) == "check" for d in f.decorator_list)]


def assert_passed(results: tuple[str, dict], name: str) -> None:
    """Fail with every rank's traceback if check `name` did not pass on all ranks."""
    launcher, checks = results
    assert name in checks, f"{name} did not run under {launcher}"
    failures = {rank: res for rank, res in checks[name].items() if res != "ok"}
    assert not failures, f"{name} under {launcher}:\n" + "\n".join(f"rank {r}: {t}" for r, t in failures.items())
