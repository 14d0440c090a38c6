"""Whole lines from launched ranks (issue 46): hvdp/_output.py in-process, then under mpirun and Gloo at np=2
with a rank that writes its lines in pieces while the other writes between them."""

import io
import re

import pytest

from hvdp import _output
from tests.launch import ROOT, TAG, run, skip_without_mpi


@pytest.mark.parametrize("pending,text,whole,rest", [
    ("", "abc", "", "abc"),
    ("ab", "c\n", "abc\n", ""),
    ("", "a\nb\nc", "a\nb\n", "c"),
    ("", "\r50%", "\r", "50%"),
    ("x", "\ry\rz", "x\ry\r", "z"),
])
def test_split_whole_cuts_after_the_last_line_end(pending, text, whole, rest):
    assert _output.split_whole(pending, text) == (whole, rest)


def test_whole_lines_writes_each_write_s_whole_lines_at_once_and_the_rest_at_the_end():
    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    raw = Recorder()
    stream = _output.WholeLines(raw)
    print("first", end="", file=stream, flush=True)  # a flush mid-line writes nothing
    assert raw.writes == []
    print(" half", file=stream)  # Python's print: the text, then "\n", in two writes
    stream.write("a\nb")
    stream.close_line()
    assert raw.writes == ["first half\n", "a\n", "b\n"]  # the last line, ended at exit
    assert stream.getvalue() == "first half\na\nb\n"  # anything else is the wrapped stream's


def test_whole_lines_is_off_with_the_variable_and_wraps_once(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    assert _output.whole_lines({"HVDP_WHOLE_LINES": "0"}) is False
    assert _output.whole_lines({}) is True
    import sys
    assert isinstance(sys.stdout, _output.WholeLines) and sys.stdout._stream is out
    assert _output.whole_lines({}) is True and sys.stdout._stream is out  # not wrapped twice


def _glued(output: str) -> list[str]:
    """Lines with a rank's tag anywhere but at the start, or with two tags."""
    return [line for line in output.splitlines() if TAG.search(line)
            and (len(TAG.findall(line)) > 1 or not TAG.match(line))]


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_a_rank_s_lines_reach_the_launcher_whole(launcher):
    skip_without_mpi(launcher)
    proc = run(launcher, ROOT / "tests" / "torch" / "worker_lines.py", timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not _glued(out), "\n".join(_glued(out))
    lines = [(int(m.group(1)), line[m.end():]) for line in out.splitlines() if (m := TAG.match(line))]
    assert [t for r, t in lines if r == 0 and "line" in t] == [f"rank0 line{i} begins and ends" for i in range(4)]
    assert [t for r, t in lines if r == 1 and "line" in t] == [f"rank1 line{i} whole" for i in range(4)]
    for rank in (0, 1):
        assert (rank, f"rank{rank} done") in lines and (rank, f"rank{rank} unended") in lines, out[-2000:]
        assert any(re.fullmatch(rf"\r?rank{rank} bar 2\r?", t) or t == f"rank{rank} bar 2" for r, t in lines
                   if r == rank), out[-2000:]
    if launcher == "mpi":  # the same job with Python's own streams: mpirun glues rank 1's lines into rank 0's
        old = run(launcher, ROOT / "tests" / "torch" / "worker_lines.py", timeout=180,
                  extra_env={"HVDP_WHOLE_LINES": "0"})
        assert old.returncode == 0 and _glued(old.stdout + old.stderr), (old.stdout + old.stderr)[-3000:]
