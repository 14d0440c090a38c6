"""`hvdp verify --zoo` as a user runs it: every case of the model zoo PASSes, and every case the zoo defines
printed its line (a case dropped from a launch, or a launch that died, fails here by name).

One test per world: np=2 under MPI (the default launcher), np=3 under Gloo. Gloo at np=2 was a third world
(60-90 s of the suite): tests/torch and tests/tensorflow run every path the cases take at np=2 under Gloo, and
the zoo's own code is the same whatever the controller. Each is one torch launch (16 runs: 8 cases
on the allreduce path and sharded) plus, where hvdp.tools.zoo_keras exists, one Keras launch per backend."""

import pytest

from hvdp.tools import zoo
from tests.launch import result_line, skip_without_mpi
from tests.test_cli import hvdp

TORCH_CASES = ["text-cnn", "gru", "tiny-transformer", "moe", "finetune", "syncbn", "adafactor", "accumulate"]


def test_the_zoo_holds_the_cases_the_docs_promise():
    # The list in docs/verify.md and this file's, against the zoo's own: a case renamed or dropped fails here.
    assert [c.name for c in zoo.torch_cases()] == TORCH_CASES
    assert all(c.paths == ("allreduce", "sharded") for c in zoo.torch_cases())
    names = {(f, p, n) for f, p, n in zoo.expected_records(framework="torch")}
    assert names == {("torch", p, n) for n in TORCH_CASES for p in ("allreduce", "sharded")}


@pytest.mark.parametrize("args,size", [(["--np", "2"], 2), (["--np", "3", "--gloo"], 3)], ids=["mpi-np2", "gloo-np3"])
def test_verify_zoo_passes(args, size):
    if "--gloo" not in args:
        skip_without_mpi("mpi")
    proc = hvdp("verify", "--zoo", *args, timeout=1200)
    out = proc.stdout + proc.stderr
    summary = result_line(out, zoo.SUMMARY)
    assert summary["size"] == size, summary
    printed = {(c["framework"], c["path"], c["name"]) for c in summary["cases"]}
    expected = set(zoo.expected_records())
    assert expected <= printed, f"cases without a line: {sorted(expected - printed)}\n{out[-4000:]}"
    assert {n for f, _, n in printed if f == "torch"} == set(TORCH_CASES)
    failed = [zoo.format_line(c) for c in summary["cases"] if not c["ok"]]
    assert not failed and not summary["failed_launches"], "\n".join(failed) + "\n" + out[-3000:]
    assert proc.returncode == 0 and summary["ok"], out[-3000:]
    for case in summary["cases"]:
        assert case["max_abs_diff"] <= zoo.TOLERANCE, case
        # every line says what it compared: name, framework/path, the figure, the tolerance, the verdict
        assert zoo.format_line(case) in proc.stdout


def test_zoo_refuses_what_it_does_not_take(capsys):
    from hvdp.tools import cli
    assert cli.main(["verify", "--zoo", "--model", "m:f", "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err
    assert "--zoo runs its own models, optimizers and tolerance (1e-05)" in err and "--model, --optimizer" in err, err
    assert cli.main(["verify", "--zoo", "--framework", "torch", "--keras-backend", "torch"]) == 2
    assert "--keras-backend is for --framework keras only" in capsys.readouterr().err


@pytest.mark.parametrize("said,expected", [
    ({"FRAMEWORKS": {"a": "keras", "b": "tensorflow"}}, {"a": ("tensorflow", "torch"), "b": ("tensorflow",)}),
    ({"BACKENDS": {"a": ("torch",)}}, {"a": ("torch",), "b": ("tensorflow", "torch")}),
    ({}, {"a": ("tensorflow", "torch"), "b": ("tensorflow", "torch"), "tf_loop": ("tensorflow",)}),
])
def test_which_backends_a_keras_case_runs_on(said, expected):
    module = type("ZooKeras", (), said)
    for name, backends in expected.items():
        assert tuple(b for b in ("tensorflow", "torch") if zoo._applies(module, name, b)) == backends, name
