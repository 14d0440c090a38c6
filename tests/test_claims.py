"""The README's claims cannot drift from what was measured and tested: every speed figure in README.md is
one that docs/benchmarks.md reports, as it writes it (two decimals at least), and every test the support
matrix (docs/support.md) cites exists.

In-process, reading text only: milliseconds.
"""

from __future__ import annotations

import re

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


def test_readme_speed_figures_are_the_benchmark_pages():
    figures = speed_figures(README.read_text())
    assert figures, "the README quotes no speed figure: this test would check nothing (update its pattern?)"
    # Quoted as measured, to two decimals at least: a round "3×" is found in any page (and says little).
    rounded = [f for f in figures if any(not re.fullmatch(r"\d+\.\d{2,}", n) for n in f.split("–"))]
    assert not rounded, f"README.md rounds {rounded}: quote docs/benchmarks.md's figures as it writes them"
    page = BENCHMARKS.read_text()
    missing = [f for f in figures if not reports(page, f)]
    assert not missing, (f"README.md quotes {', '.join(m + '×' for m in missing)}, which docs/benchmarks.md does "
                         "not report: quote the benchmark page's figures as it writes them")


CITED = sorted(set(re.findall(r"`(tests/[\w/.-]+)`", SUPPORT.read_text())))


@pytest.mark.parametrize("path", CITED)
def test_support_matrix_cites_tests_that_exist(path):
    assert (ROOT / path).exists(), f"docs/support.md cites {path}, which does not exist"


def test_support_matrix_cites_tests():
    assert len(CITED) >= 10, CITED
