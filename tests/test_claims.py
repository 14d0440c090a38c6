"""The docs' claims cannot drift from what was measured, tested and coded (issue 49): one source per figure
and list.

- README.md states no figure and no date (a number with a unit, a speed ratio, a YYYY-MM-DD).
- Every other page's figures (a number followed by ×, %, ms, µs, s, min, minutes, MiB or GB/s, outside code
  blocks) are found as written in a page that records measurements (OWNERS), or are a setting quoted from
  the file that sets it (SETTINGS: the file is checked to hold the value), or are recorded first-hand on
  that page and on no other guide page (RECORDED: a copy on a second page must link instead).
- Dates: none in the future; a guide page's dates are in an owner page or RECORDED.
- The Horovod fixes list in docs/install.md is what `python -m hvdp.tools.fixes` generates.
- The words of docs/verify.md's definitions ("exact", "bit-identical", "bit for bit") link to them on every
  page that uses them; "proves" is not used.
- CONTRADICTIONS: the cross-page statements the audit of issue 49 found contradicting, each checked.

In-process, reading text only: well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.launch import ROOT

README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SUPPORT = ROOT / "docs" / "support.md"

NUMBER = r"\d+(?:\.\d+)?"
# A speed figure: a number or a range of two ("1.125–1.276"), then × or x as a suffix ("3×", "1.5x ",
# "0.97×)"). A × between two factors ("1×N·b", "3×64×64") is a product, not a speed: the lookahead skips it.
FIGURE = re.compile(rf"(?<![\w.])({NUMBER}(?:\s*[–-]\s*{NUMBER})?)\s?[×x](?![\w.])")


def speed_figures(text: str) -> list[str]:
    """The speed figures in `text`, as written without the ×: ["3", "1.531", "1.125–1.276"]."""
    return [re.sub(r"\s*[–-]\s*", "–", m.group(1)) for m in FIGURE.finditer(text)]


def reports(page: str, figure: str) -> bool:
    """Whether `page` has `figure` as a whole number (1.53 is not found in 1.531), a range with either dash."""
    parts = [re.escape(p) for p in figure.split("–")]
    return re.search(r"(?<![\d.])" + r"\s*[–-]\s*".join(parts) + r"(?!\.?\d)", page) is not None


def test_speed_figures_are_found_as_written():
    text = ("3× Horovod's, 1.531× and 1.308× the recipe, 0.993x the sampler, hvdp 1.125–1.276× DDP, 2 - 5x; "
            "not N×b ≡ 1×N·b, 3×64×64 images, LR x size, 0x10")
    assert speed_figures(text) == ["3", "1.531", "1.308", "0.993", "1.125–1.276", "2–5"]


def test_a_figure_is_reported_only_as_written():
    page = "gave **1.531** (0.572, 1.531) and 2.09–5.75× (median 3.94×); 10.4 GB/s"
    assert reports(page, "1.531") and reports(page, "2.09–5.75") and reports(page, "3.94")
    assert not reports(page, "1.53")       # a rounding of the page's figure is not the page's figure
    assert not reports(page, "0.4")        # nor a piece of another number
    assert not reports(page, "2.09–5.7")


CITED = sorted(set(re.findall(r"`(tests/[\w/.-]+)`", SUPPORT.read_text())))


@pytest.mark.parametrize("path", CITED)
def test_support_matrix_cites_tests_that_exist(path):
    assert (ROOT / path).exists(), f"docs/support.md cites {path}, which does not exist"


def test_support_matrix_cites_tests():
    assert len(CITED) >= 10, CITED


# --------------------------------------------------------------------------------------------------------
# One source per figure (issue 49)

DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
# The pages that record measurements first-hand (the lab notes): a figure elsewhere quotes one of them.
OWNERS = [BENCHMARKS, DOCS / "internals.md", SUPPORT]
# Pages left out of the checks below (none: every page is checked).
NOT_YET: list = []
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
RANGE = r"\d[\d,]*(?:\.\d+)?(?:\s*[–-]\s*\d[\d,]*(?:\.\d+)?)?"
UNIT = re.compile(rf"(?<![\w.])({RANGE})(?:\s?(?:%|ms|µs|s|min|minutes|seconds|MiB|GB/s)(?![\w/])"
                  rf"|\s?[×x](?![\w.]|\s*\d))")
DATE = re.compile(r"(?<![\d-])20\d\d-[01]\d-[0-3]\d(?![\d-])")
START, END = "<!-- fixes: generated", "<!-- /fixes -->"

# (page, the figure as written, the file that sets it, a pattern that file must hold)
SETTINGS = [
    ("docs/launchers.md", "12 s", "tests/slurm/test_sbatch.py", r"^SUSPEND_SECONDS = 12$"),
    ("docs/troubleshooting.md", "12 s", "tests/faults/test_pause.py", r"^PAUSE = 12 "),
    ("docs/troubleshooting.md", "30000ms", "docs/launchers.md", r"HOROVOD_GLOO_TIMEOUT_SECONDS` \(default 30\)"),
    ("docs/troubleshooting.md", "30 minutes", "hvdp/core/tuning.py", r'"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1800"'),
    ("docs/troubleshooting.md", "10–30 minutes", "hvdp/core/watchdog.py", r"NCCL watchdogs' 10-30 minutes"),
    ("docs/troubleshooting.md", "14 s", "tests/faults/test_hangs.py", r'"--pause", "14"'),
    ("docs/troubleshooting.md", "8 s", "tests/faults/test_hangs.py", r'HVDP_WATCHDOG_TIMEOUT="8"'),
    ("docs/verify.md", "300 s", "hvdp/tools/zoo.py", r"^LAUNCH_TIMEOUT = 300$"),
    ("docs/verify.md", "120 s", "hvdp/tools/zoo.py", r'"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120"'),
    ("docs/pytorch.md", "25 MiB", "hvdp/torch/compiled.py", r"_BUCKET_BYTES = 1 << 20, 25 << 20"),
    ("docs/troubleshooting.md", "60 s", "hvdp/core/watchdog.py", r"^DEFAULT_TIMEOUT = 60\.0$"),
    ("docs/troubleshooting.md", "1800 s", "hvdp/core/watchdog.py", r"^DEFAULT_ELSEWHERE_TIMEOUT = 1800\.0$"),
    ("docs/troubleshooting.md", "20%", "hvdp/core/stragglers.py", r"^THRESHOLD = 0\.20 "),
    ("docs/troubleshooting.md", "10%", "hvdp/core/stragglers.py", r"^MIN_EXCESS = 0\.10 "),
]
# Figures recorded first-hand on a guide page (a run that page describes), on no other guide page.
RECORDED = {
    "docs/docker.md": ["1.5 min", "8 min"],
    "docs/elastic.md": ["22 s", "26–58 s"],
    "docs/gpus.md": ["110 s", "4.5 min", "63 s", "630 s"],
    "docs/install.md": ["10 min", "10 minutes", "45 s", "706 s"],
    "docs/launchers.md": ["1.4 s", "10.0 s", "13–14 s", "150 s", "2.1 s", "2.4 s", "3.9 s", "438 s", "5.2 s",
                          "6.3 s", "6.7 s", "64 s", "8.1 s", "8.3 s", "9–16 s",
                          # other programs' defaults and messages, as their documentation and output give them
                          "600 s", "300 s", "10000ms"],
    "docs/pytorch.md": ["29.2 MiB", "4.8%", "97%"],
    "docs/troubleshooting.md": ["0.05 ms", "0.1 ms", "4.3 s", "40%", "6.0 s"],
    "docs/verify.md": ["16–27 s", "50–65 s"],
}


def prose(page: Path) -> str:
    """The page without its code blocks and without the generated fixes section (its source is checked below)."""
    text = page.read_text()
    if START in text:
        text = text[:text.index(START)] + text[text.index(END) + len(END):]
    return FENCE.sub("", text)


def unit_figures(text: str) -> list[str]:
    """Every number (or range) followed by a unit or a ×, as written: ["60 s", "1.5 min", "0.96×"]."""
    return [m.group(0) for m in UNIT.finditer(text)]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_unit_figures_are_found_as_written():
    text = ("60 s, 1.5 min, 2,003 µs, 0.93–1.02× and 3.3-6.4x, 48 MiB, 10.4 GB/s, 97%, 30 minutes; not 1×N·b, "
            "3×64×64, LR x size, 2 samples, 8 MiB/s")
    assert unit_figures(text) == ["60 s", "1.5 min", "2,003 µs", "0.93–1.02×", "3.3-6.4x", "48 MiB", "10.4 GB/s",
                                  "97%", "30 minutes"]


def test_readme_states_no_figure_and_no_date():
    text = prose(README)
    assert not unit_figures(text) and not speed_figures(text), (unit_figures(text), speed_figures(text))
    assert not DATE.findall(text), DATE.findall(text)


CHECKED = [p for p in PAGES if p not in OWNERS and p not in NOT_YET and p != README]


@pytest.mark.parametrize("page", CHECKED, ids=_rel)
def test_every_figure_has_one_source(page):
    owners = "\n".join(o.read_text() for o in OWNERS)
    settings = {f for pg, f, _, _ in SETTINGS if pg == _rel(page)}
    recorded = set(RECORDED.get(_rel(page), []))
    loose = sorted({f for f in unit_figures(prose(page)) if f not in owners and f not in settings | recorded})
    assert not loose, (f"{_rel(page)} states {loose}, found in no page that records measurements "
                       f"({', '.join(_rel(o) for o in OWNERS)}) nor declared: quote the owner page as it writes the "
                       "figure (or link to it), or declare the setting's source file in SETTINGS, or a first-hand "
                       "record of this page in RECORDED")


@pytest.mark.parametrize("entry", SETTINGS, ids=lambda e: f"{e[0]}:{e[1]}")
def test_settings_are_what_their_source_sets(entry):
    page, figure, source, pattern = entry
    assert figure in unit_figures(prose(ROOT / page)), f"{page} no longer states {figure}: drop it from SETTINGS"
    assert re.search(pattern, (ROOT / source).read_text(), re.M), f"{source} no longer holds {pattern!r} ({figure})"


@pytest.mark.parametrize("page", sorted(RECORDED))
def test_recorded_figures_are_on_their_page_only(page):
    mine = set(unit_figures(prose(ROOT / page)))
    stale = [f for f in RECORDED[page] if f not in mine]
    assert not stale, f"{page} no longer states {stale}: drop them from RECORDED"
    settings = {(pg, f) for pg, f, _, _ in SETTINGS}
    for other in CHECKED:
        if _rel(other) == page:
            continue
        copies = [f for f in RECORDED[page] if f in unit_figures(prose(other)) and (_rel(other), f) not in settings
                  and f not in RECORDED.get(_rel(other), [])]
        assert not copies, f"{_rel(other)} copies {copies} from {page}: link to it instead"


def test_no_date_in_the_future_and_guide_dates_have_an_owner():
    import datetime
    today = datetime.date.today().isoformat()
    owners = "\n".join(o.read_text() for o in OWNERS)
    for page in PAGES:
        if page in NOT_YET:
            continue
        dates = DATE.findall(prose(page))
        assert all(d <= today for d in dates), (_rel(page), [d for d in dates if d > today])
        if page not in OWNERS:
            loose = [d for d in dates if d not in owners and d not in RECORDED.get(_rel(page), [])]
            assert not loose, f"{_rel(page)} dates {loose}, which no page that records measurements holds"


def test_the_horovod_fixes_list_is_generated():
    from hvdp.tools import fixes
    page = (DOCS / "install.md").read_text()
    assert fixes.replace(page, fixes.section(ROOT)) == page, \
        "docs/install.md's fixes list is not what `python -m hvdp.tools.fixes` generates: run it with --write"
    numbers = [f.number for f in fixes.parse((ROOT / "scripts" / "build_horovod.sh").read_text()) if f.number]
    internals = (DOCS / "internals.md").read_text()
    missing = [n for n in sorted(numbers) if not re.search(rf"^{n}\. \*\*", internals, re.M)]
    assert not missing, f"docs/internals.md explains no fix {missing} (its numbered list of the Horovod fixes)"
    for page in PAGES:  # no second copy of the list: the failure messages are named once
        if page.name != "install.md":
            assert page.read_text().count("patch failed`") <= 2, f"{_rel(page)} copies the fixes' messages"


def test_the_fixes_generator_reads_numbers_sources_and_messages():
    from hvdp.tools import fixes
    script = """apply_fixes() {
    # Fix 2: two (a, b). More words.
    # still fix 2
    patch -s -p1 -d "$1" < "$csrc/patches/two.patch"
    grep -q x "$1/y" || { echo "two patch failed" >&2; exit 1; }
    # Fix 1: one: detail
    sed -i 's/a/b/' "$1/f"
    # Addition (not a repair): extra
    cp "$csrc/extra.cc" "$1/"
}
"""
    found = fixes.parse(script)
    assert [(f.number, f.summary, f.sources, f.failures) for f in found] == [
        (2, "two (a, b)", ["patches/two.patch"], ["two patch failed"]), (1, "one", [], []),
        (None, "extra", ["extra.cc"], [])]
    assert "still fix 2" in found[0].text
    with pytest.raises(ValueError, match="twice"):
        fixes.parse(script.replace("# Fix 1:", "# Fix 2:"))


WORDS = re.compile(r"\b(exact(?:ly)?|bit-identical(?:ly)?|bit for bit)\b", re.I)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in NOT_YET], ids=_rel)
def test_defined_words_link_their_definition(page):
    text = prose(page)
    assert not re.search(r"\bprov(?:e|es|ed|en)\b", text) or page.name == "verify.md", \
        f"{_rel(page)} says 'prove': a check holds for the runs it made (docs/verify.md#what-exact-means-here)"
    if WORDS.search(text) and page.name != "verify.md":
        assert "verify.md#what-exact-means-here" in text, (f"{_rel(page)} says {WORDS.search(text).group(0)!r} "
                                                            "without linking its bound (docs/verify.md)")


def _code(path: str) -> str:
    return (ROOT / path).read_text()


# The cross-page statements issue 49's audit found contradicting each other or the code: each is checked.
CONTRADICTIONS = {
    # 1. the README's clipping recipe clips the shards, or raises (hvdp/torch/sharded_clip.py's _clip_norm)
    "sharded clipping: the recipe works": lambda: not re.search(r"cannot work here: after the reduce-scatter",
                                                                prose(DOCS / "pytorch.md"))
    and re.search(r"_guarded\(torch\.nn\.utils\.clip_grad_norm_,\s*_clip_norm\)",
                  _code("hvdp/torch/sharded_clip.py"))
    and "torch_clip_grad_norm_on_the_model_clips_the_shards" in _code("tests/torch/worker_sharded.py"),
    # 2. hvdp.keras runs on the torch backend: no page says it refuses it
    "keras torch backend is not refused": lambda: all(
        "refuse `KERAS_BACKEND=torch`" not in p.read_text() and "hvdp.keras / hvdp.tensorflow average TensorFlow"
        not in p.read_text() for p in PAGES) and '("tensorflow", "torch")' in _code("hvdp/_keras_backend.py"),
    # 3. resuming bit for bit is said with its bound
    "resume bit for bit has its bound": lambda: "bit for bit\n   ([bounds](verify.md#what-exact-means-here)) at 2 ranks"
    in (DOCS / "launchers.md").read_text() and "resumes bit-identically" not in README.read_text(),
    # 4./5. test counts and suite minutes live in support.md only
    "suite figures in support.md only": lambda: all(
        not re.search(r"\d[\d,]* passed\b.{0,100}?\d+(?:\.\d+)? min|make test(?![\w-])[^\n.]{0,45}?\d+ min",
                      prose(p), re.S)
        for p in PAGES if p != SUPPORT),
    # 5. small all-reduce latency: only the benchmark and internals pages state it
    "small all-reduce latency from benchmarks.md": lambda: all(
        not re.search(r"1\.[1-7] ms (?:\(MPI\)|\(Gloo\)|under MPI|under Gloo|here\))", prose(p))
        for p in PAGES if p not in OWNERS),
    # 7. the fixes list has one copy (test_the_horovod_fixes_list_is_generated)
    "one fixes list": lambda: "| 5. blocking `synchronize()`" not in (DOCS / "install.md").read_text(),
    # 8./9. no (seed, epoch) order promise for streams, no 30-minute claim for different collectives in the README
    "README order and watchdog claims": lambda: "(seed, epoch)" not in README.read_text()
    and "30 minutes" not in README.read_text(),
    # 8. a stream's order is its own: where a page says the order depends on (seed, epoch), it says for which data
    "stream order": lambda: all(
        "(seed, epoch)`" not in line or "indexed" in line for p in PAGES if p not in NOT_YET
        for line in p.read_text().splitlines()),
    # 9. the watchdog's limits quoted from hvdp/core/watchdog.py
    "watchdog limits": lambda: re.search(r"^DEFAULT_TIMEOUT = 60\.0$", _code("hvdp/core/watchdog.py"), re.M)
    and re.search(r"^DEFAULT_ELSEWHERE_TIMEOUT = 1800\.0$", _code("hvdp/core/watchdog.py"), re.M)
    and "`HVDP_WATCHDOG_TIMEOUT` seconds** (default 60)" in (DOCS / "troubleshooting.md").read_text()
    and "(default 1800 s" in (DOCS / "troubleshooting.md").read_text()
    and re.search(r"^EXIT_CODE = 70$", _code("hvdp/core/watchdog.py"), re.M)
    and "exits with **code 70**" in (DOCS / "troubleshooting.md").read_text()
    and "exit 70" in (DOCS / "recipes.md").read_text(),
    # 10. Slurm is two slurmd on one VM; the sbatch's keepalives as the script sets them
    "slurm cluster described as it is": lambda: all("real two-node" not in p.read_text() for p in PAGES),
    "sbatch keepalives as set": lambda: len(found := re.findall(
        r'export (OMPI_MCA_oob_tcp_keepalive_\w+|HOROVOD_GLOO_TIMEOUT_SECONDS)="\$\{\1:-(\d+)\}"',
        _code("examples/slurm.sbatch"))) == 4 and all(f"`{k}={v}`" in (DOCS / "launchers.md").read_text()
                                                        for k, v in found),
}


@pytest.mark.parametrize("name", sorted(CONTRADICTIONS))
def test_audited_contradiction_stays_fixed(name):
    assert CONTRADICTIONS[name](), name


def test_suite_figures_are_written_from_a_pytest_summary():
    from hvdp.tools import suite_figures as suite
    log = ("... = 3 failed, 2 passed in 9.00s =\nlater output\n"
           "====== 11 failed, 2454 passed, 12 skipped, 1 error, 3 warnings in 3480.12s (0:58:00) ======\n")
    figures = suite.parse(log)  # the last summary line; an error counts as failed, warnings not at all
    assert figures == {"passed": 2454, "skipped": 12, "failed": 12, "seconds": 3480.12}
    assert suite.sentence(figures, "2026-12-07") == "2,478 tests in 58 minutes on 2026-12-07, 12 skipped, 12 failed"
    quiet = suite.parse("....   [100%]\n2759 passed, 13 skipped in 4371.82s (1:12:51)\n")  # make test's pytest -q
    assert quiet == {"passed": 2759, "skipped": 13, "failed": 0, "seconds": 4371.82}
    with pytest.raises(ValueError, match="no pytest summary"):
        suite.parse("no summary here")
    with pytest.raises(ValueError):
        suite.sentence(figures, "07/12/2026")


def test_support_states_the_suite_figures_once_in_the_written_form():
    from hvdp.tools import suite_figures as suite
    page = SUPPORT.read_text()
    figures = suite.stated(page)  # raises unless the marked text is what sentence() writes
    again = suite.sentence({"passed": figures["total"] - figures["skipped"] - figures["failed"],
                            "skipped": figures["skipped"], "failed": figures["failed"],
                            "seconds": figures["minutes"] * 60}, figures["date"])
    assert suite.replace(page, again) == page
    assert figures["date"] <= __import__("datetime").date.today().isoformat()
