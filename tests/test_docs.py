"""The docs cannot rot: every code block in README.md, CONTRIBUTING.md and docs/ runs, and every relative
link and anchor resolves.

- ```python runs as a program on its own (np=1); with `<!-- run: np=2 -->` on the line before the fence, under
  `horovodrun -np 2` (MPI) instead (what the page tells the reader to run; a world of 1 is what the rest of
  the suite's np=1 runs and the blocks without the marker cover).
- ```bash runs from the repository root with `bash -e -o pipefail`. A block that cannot run on one machine
  (other hosts, a Docker engine) carries `<!-- not-run: why -->` on the line before it, and is parsed only.
- ```text (and any other language) is prose: not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import launch

ROOT = launch.ROOT
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(run|not-run):\s*(.*?)\s*-->")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("run", "np=2") or ("not-run", why)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARKER.fullmatch(before.strip())
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                           (mark.group(1), mark.group(2)) if mark else None))
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
BASH = [b for b in ALL if b.lang in ("bash", "sh", "shell")]
NP2 = [b for b in PYTHON if b.marker == ("run", "np=2")]
ALONE = [b for b in PYTHON if b not in NP2]


def _ids(items):
    return [b.id for b in items]


def _fail(what: str, proc: subprocess.CompletedProcess) -> str:
    return f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_the_pages_have_runnable_blocks():
    # A parser that found nothing would make every test below pass vacuously.
    assert len(ALONE) >= 4 and len(BASH) >= 6 and len(NP2) >= 4, (len(ALONE), len(BASH), len(NP2))


@pytest.mark.parametrize("block", ALONE, ids=_ids(ALONE))
def test_python_block_runs_alone(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=launch.env())
    assert proc.returncode == 0, _fail(f"{block.id} (python)", proc)


@pytest.mark.parametrize("block", NP2, ids=_ids(NP2))
def test_python_block_runs_under_horovodrun(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    proc = launch.run("mpi", script, np=2, timeout=300, cwd=tmp_path)  # files a snippet writes stay there
    assert proc.returncode == 0, _fail(f"{block.id} (horovodrun -np 2)", proc)


@pytest.mark.parametrize("block", BASH, ids=_ids(BASH))
def test_bash_block(block):
    if block.marker and block.marker[0] == "not-run":
        assert len(block.marker[1]) > 10, f"{block.id}: a not-run block must say why it cannot run here"
        proc = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert proc.returncode == 0, _fail(f"{block.id} (bash -n)", proc)
        return
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=launch.env())
    assert proc.returncode == 0, _fail(f"{block.id} (bash)", proc)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


LINKS = [(page, target) for page in PAGES for target in LINK.findall(FENCE.sub("", page.read_text()))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page,target", LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS])
def test_relative_link(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor:
        assert dest.suffix == ".md", f"{page.relative_to(ROOT)}: anchor #{anchor} into a non-Markdown file"
        assert anchor in anchors(dest), (f"{page.relative_to(ROOT)} links to {target}: no heading with that "
                                         f"anchor; there are {sorted(anchors(dest))}")


def test_readme_is_the_front_door():
    # issue 49: what hvdp is and its status, install, one horovodrun line, the two snippets, features, links;
    # how to test and develop is CONTRIBUTING.md's, with one line here that still names the test command
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 130, "the README is the front door: details go to docs/"
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"docs/{page.name} is not in the README's table"
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings == ["Install", "Run", "PyTorch", "Keras 3", "What you get", "Where to read next"], headings
    intro = readme[:readme.index("## Install")]
    assert len(intro.strip().splitlines()) <= 10, intro
    status = intro[intro.index("**Status:**"):]
    pinned = re.search(r"^horovod==([\d.]+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    for said in ("tested on CPUs", "docs/support.md", "not run on a GPU", "docs/gpus.md", f"Horovod {pinned}"):
        assert said in status, f"the README's status line does not say {said!r}"
    install = [b.code for b in blocks(ROOT / "README.md") if b.lang == "bash"]
    assert [re.findall(r"^(pip install|hvdp build-horovod|hvdp doctor)\b", b, re.M) for b in install][0] == \
        ["pip install", "hvdp build-horovod", "hvdp doctor"], install
    assert sum(line.lstrip().startswith("horovodrun ") for b in install for line in b.splitlines()) == 1, install
    assert "`make test`" in readme and "CONTRIBUTING.md#tests" in readme, "the README must name the test command"
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # the command the README names is what CI runs
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "`make test` is the test command" in contributing and "make train" in contributing


def test_slug_matches_github():
    assert slug("`hvdp verify`: N ranks with batch b ≡ one process") == "hvdp-verify-n-ranks-with-batch-b--one-process"
    assert slug("Gloo and hostnames") == "gloo-and-hostnames"
