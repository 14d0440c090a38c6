"""Horovod 0.28.1's own parallel tests against the Horovod that hvdp builds (issue 51): a team's Horovod scripts
use `horovod.torch`, `horovod.tensorflow` and `horovod.tensorflow.keras` directly, and these files are the
conformance suite of that API. They are ../shared/peer/horovod-0.28.1's (unmodified, Apache License 2.0),
copied to a temporary folder and run as Horovod's CI ran them:

    horovodrun -np 2 -H localhost:2 [--gloo | --mpi] python -m pytest -q <file>

with tests/peer_deselect.txt's tests deselected (each cannot pass for a reason in its own code, named there),
plus tests/peer_keras3.py: the Keras-3 ports of the deselected Keras tests, run the same way.

`make test` runs what fits its time budget (docs/support.md): at np=2 under Gloo and MPI, the Keras suite and
the ports whole, and the torch and TensorFlow suites' tests of the API a training script calls (SUITES below).
`make test-horovod` (HVDP_PEER_FULL=1) runs every suite whole, at np=2 and np=3. `make soak-horovod`
(HVDP_PEER_ROUNDS=R, HVDP_PEER_NP=2) runs every suite whole R times in a row under Gloo and MPI at np=2, each
run bounded by HVDP_PEER_TIMEOUT seconds (a hang fails its run instead of the soak), and appends one JSON line
per run (suite, launcher, round, seconds, outcome, summaries or the failed tests) to HVDP_PEER_LOG: the figures
of docs/support.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from hvdp.tools import rotation
from tests.launch import ROOT, env, launcher_cmd, rank_lines

PEER = Path(os.environ.get("HVDP_PEER_DIR", ROOT.parent / "shared" / "peer" / "horovod-0.28.1"))
DESELECT = Path(__file__).with_name("peer_deselect.txt")
PORTS = Path(__file__).with_name("peer_keras3.py")
FULL = os.environ.get("HVDP_PEER_FULL") == "1"
ROUNDS = int(os.environ.get("HVDP_PEER_ROUNDS", "1"))
TIMEOUT = float(os.environ.get("HVDP_PEER_TIMEOUT", "1800"))
LOG = os.environ.get("HVDP_PEER_LOG")

# The launches: (files run by one pytest, the -k expression `make test` runs them with; None: whole). The torch
# and TensorFlow files hold 115 and 143 tests, most of them each collective in every dtype and its error cases
# (hvdp's own suite covers those through hvdp): `make test` takes the calls a training script makes, and the
# Keras file and its ports whole; `make test-horovod` (HVDP_PEER_FULL=1) takes every file whole.
SUITES = {
    "keras": (["test_tensorflow2_keras.py", PORTS.name], None),
    "tensorflow": (["test_tensorflow.py"], "model_parallel or elastic_state or broadcast_object or allreduce_average_cpu "
                                           "or indexed_slices_average_cpu or join_allreduce"),
    "torch": (["test_torch.py"], "optimizer or broadcast_state or allreduce_average or gradient_clipping "
                                 "or dynamic_requires_grad or sparse_embeddings or join_allreduce"),
}
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.* in [\d.]+s\b.*?)\s*=*$")

def deselected() -> dict[str, str]:
    """tests/peer_deselect.txt: {'<file>::<class>::<test>': reason}."""
    out = {}
    for line in DESELECT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            node, _, reason = line.partition("  ")
            out[node.strip()] = reason.strip()
    return out


def _peer_missing() -> None:
    if not (PEER / "test" / "parallel" / "test_torch.py").is_file():
        pytest.fail(f"Horovod's peer tests are not at {PEER} (../shared/peer/horovod-0.28.1 beside the checkout); "
                    "set HVDP_PEER_DIR to their folder")


def test_deselect_list_names_tests_of_the_files():
    """Every entry names a test that exists in its (unmodified) file, with a reason: a renamed or removed test
    would otherwise be deselected silently, and a test deselected without a reason hides a failure."""
    _peer_missing()
    entries = deselected()
    assert entries
    for node, reason in entries.items():
        file, cls, name = node.split("::")
        source = (PEER / "test" / "parallel" / file).read_text()
        assert f"class {cls}(" in source, node
        base = re.sub(r"_\d+$", "", name)  # parameterized.expand's suffix
        assert f"def {name}(" in source or (base != name and f"def {base}(" in source
                                              and "@parameterized.expand" in source), node
        assert len(reason) > 20, node
    ported = [n.split("::")[-1] for n, r in entries.items() if "(port)" in r]
    port_source = PORTS.read_text()
    for name in ported:  # a port of each, under the same name
        assert f"def {re.sub(r'_[01]$', '', name)}(" in port_source, name


def run_suite(files: list[str], launcher: str, np: int, tmp: Path, select: str | None) -> dict[int, str]:
    """Run peer files (or the ports) in one pytest under horovodrun; {rank: pytest's summary line}. Fails on a
    failure, naming the failed tests."""
    _peer_missing()
    work = tmp / "test"
    shutil.copytree(PEER / "test", work)
    for p in work.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)  # shared/ is read-only in CI
    parallel = work / "parallel"
    if PORTS.name in files:
        shutil.copy(PORTS, parallel)
    cmd = launcher_cmd(launcher, np) + ["-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider", "-rfE", *files]
    cmd += [a for node in deselected() if node.split("::")[0] in files for a in ("--deselect", node)]
    if select and not FULL:
        cmd += ["-k", select]
    # Not tests.launch's PYTHONPATH: its examples/common.py would shadow the peer files' utils/common.py.
    run_env = env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=parallel,
                            env=run_env)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        rotation.kill_tree([proc.pid])  # the ranks too, not only horovodrun
        out, _ = proc.communicate()
        _log(files, launcher, np, time.monotonic() - start, "hang", {})
        pytest.fail(f"{files} under {launcher} at np={np} did not end in {TIMEOUT:.0f} s (a hang)\n{out[-3000:]}")
    summaries = {rank: m.group(1) for rank, line in rank_lines(out) if (m := SUMMARY.match(line))}
    failures = [line for line in out.splitlines() if re.search(r"<stdout>:(SUB)?(FAILED|ERROR) ", line)]
    ok = proc.returncode == 0 and sorted(summaries) == list(range(np)) and all(
        "passed" in v and not re.search(r"\d+ (failed|errors?)\b", v) for v in summaries.values())
    _log(files, launcher, np, time.monotonic() - start, "pass" if ok else "fail", summaries,
         sorted({re.sub(r"\x1b\[[0-9;]*m", "", f).split(" - ")[0].split(":", 1)[-1] for f in failures}))
    errors = [line for line in out.splitlines() if re.search(r"<std(out|err)>:(E |.*(Error|Fatal|Abort))", line)]
    assert proc.returncode == 0 and sorted(summaries) == list(range(np)), \
        f"{files} under {launcher} at np={np} (exit {proc.returncode}): {summaries}\n" + "\n".join(failures) + \
        "\n" + "\n".join(errors[:60]) + "\n" + out[-3000:]
    for rank, summary in summaries.items():
        assert "passed" in summary and not re.search(r"\d+ (failed|errors?)\b", summary), (rank, summary, failures)
    return summaries


def _log(files, launcher, np, seconds, outcome, summaries, failed=()) -> None:
    """One soak run's line in HVDP_PEER_LOG (when set)."""
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"files": files, "launcher": launcher, "np": np, "seconds": round(seconds, 1),
                                "outcome": outcome, "summaries": summaries, "failed": list(failed)}) + "\n")


def summarize(log: str) -> str:
    """`make soak-horovod`'s table from HVDP_PEER_LOG: per suite and launcher, runs, passed, hangs, the median
    seconds, and each failed test with its count."""
    runs = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    rows = ["| suite | launcher | np | runs | passed | failed | hangs | median s | failed tests (runs) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted({(" ".join(r["files"]), r["launcher"], r["np"]) for r in runs}):
        mine = [r for r in runs if (" ".join(r["files"]), r["launcher"], r["np"]) == key]
        counts: dict[str, int] = {}
        for r in mine:
            for name in r["failed"]:
                counts[name] = counts.get(name, 0) + 1
        outcome = [r["outcome"] for r in mine]
        seconds = sorted(r["seconds"] for r in mine)
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(mine)} | {outcome.count('pass')} | "
                    f"{outcome.count('fail')} | {outcome.count('hang')} | {seconds[len(seconds) // 2]:.0f} | "
                    + (", ".join(f"{n} ({c})" for n, c in sorted(counts.items())) or "none") + " |")
    return "\n".join(rows)


NPS = tuple(int(n) for n in os.environ["HVDP_PEER_NP"].split(",")) if os.environ.get("HVDP_PEER_NP") else \
    ((2, 3) if FULL else (2,))
CASES = [(suite, launcher, n, r) for r in range(ROUNDS) for n in NPS for suite in SUITES for launcher in ("gloo", "mpi")]


@pytest.mark.parametrize("suite,launcher,np,round_", CASES,
                         ids=[f"{s}-{l}-np{n}" + (f"-round{r}" if ROUNDS > 1 else "") for s, l, n, r in CASES])
def test_peer_suite(suite, launcher, np, round_, tmp_path):
    files, select = SUITES[suite]
    summaries = run_suite(files, launcher, np, tmp_path, select)
    print(f"{suite} {launcher} np={np}: {summaries[0]}")


# docs/porting.md#from-horovod's two scripts: Horovod 0.28 code (no hvdp), each under one controller.
EXAMPLES = [("horovod_keras.py", "mpi"), ("horovod_torch.py", "gloo")]


@pytest.mark.parametrize("script,launcher", EXAMPLES, ids=[s for s, _ in EXAMPLES])
def test_horovod_script_runs_unchanged(script, launcher):
    """The script trains (loss down, test accuracy >= 0.8 on the digits) and its ranks end with the same weights:
    they start from different ones, rank 0's are broadcast, and each rank's different shard of gradients is
    averaged (without the all-reduce on Keras 3, as before Fix 16, the ranks' weights part)."""
    cmd = launcher_cmd(launcher, 2) + [str(ROOT / "examples" / script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # raw_decode: under MPI another rank's output may be glued after the JSON on the same line
    results = [json.JSONDecoder().raw_decode(line.split("result: ", 1)[1])[0]
               for line in proc.stdout.splitlines() if "result: " in line]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout[-3000:]
    for r in results:
        assert r["size"] == 2 and r["last_loss"] < r["first_loss"] / 5 and r["test_accuracy"] >= 0.8, r
    assert results[0]["weights_checksum"] == results[1]["weights_checksum"], results
