"""The suite's figures in docs/support.md (how many tests `make test` ran, in how many minutes, on which date, how
many of them were skipped and how many failed), written from the summary line of the pytest run that measured them, into
the one place that states them: docs/support.md, between MARKERS. Other pages link there (tests/test_claims.py
checks that none states a suite count or duration).

    python -m hvdp.tools.suite_figures LOG --date YYYY-MM-DD            # print the figures
    python -m hvdp.tools.suite_figures LOG --date YYYY-MM-DD --write    # rewrite them in docs/support.md

LOG is the run's output (`make test 2>&1 | tee LOG`); its last pytest summary line
("= 11 failed, 2454 passed, 12 skipped, 3 warnings in 3480.12s (0:58:00) =") gives the figures.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

from hvdp.tools import resources

MARKERS = ("<!-- suite: written by `python -m hvdp.tools.suite_figures LOG --date D --write` -->", "<!-- /suite -->")
# pytest's last line, between '=' banners, or bare under -q (make test's)
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ \w+(?:, \d+ \w+)*) in ([\d.]+)s(?: \([\d:]+\))?(?: =+)?\s*$", re.M)
_SENTENCE = re.compile(r"^([\d,]+) tests in (\d+) minutes on (\d{4}-\d\d-\d\d), ([\d,]+) skipped, ([\d,]+) failed$")
# pytest's outcome words, singular and plural, to what is counted
_OUTCOMES = {"passed": "passed", "skipped": "skipped", "failed": "failed", "error": "failed", "errors": "failed",
             "xfailed": "passed", "xpassed": "passed", "deselected": None, "warning": None, "warnings": None}


def parse(log: str) -> dict:
    """{"passed", "skipped", "failed", "seconds"} from the last pytest summary line in `log` (errors and
    xpassed/xfailed counted as failed/passed; warnings and deselected not counted).

    Raises:
        ValueError: no summary line, or an outcome word pytest does not print.
    """
    found = _SUMMARY.findall(log)
    if not found:
        raise ValueError("no pytest summary line ('= ... passed ... in N s =') in the log")
    counts, seconds = found[-1]
    figures = {"passed": 0, "skipped": 0, "failed": 0, "seconds": float(seconds)}
    for part in counts.split(", "):
        n, word = part.split(" ")
        if word not in _OUTCOMES:
            raise ValueError(f"unknown pytest outcome {word!r} in {counts!r}")
        if _OUTCOMES[word]:
            figures[_OUTCOMES[word]] += int(n)
    return figures


def sentence(figures: dict, date: str) -> str:
    """The figures as docs/support.md states them: "2,477 tests in 58 minutes on 2026-12-07, 12 skipped, 11 failed"
    (the tests: passed, skipped and failed together; minutes rounded to the nearest).

    Raises:
        ValueError: `date` is not YYYY-MM-DD.
    """
    datetime.date.fromisoformat(date)
    total = figures["passed"] + figures["skipped"] + figures["failed"]
    return (f"{total:,} tests in {round(figures['seconds'] / 60)} minutes on {date}, {figures['skipped']:,} skipped, "
            f"{figures['failed']:,} failed")


def stated(page: str) -> dict:
    """The figures docs/support.md states between MARKERS: {"total", "minutes", "date", "skipped", "failed"}.

    Raises:
        ValueError: no MARKERS section, or its text is not what sentence() writes.
    """
    start, end = page.find(MARKERS[0]), page.find(MARKERS[1])
    if start < 0 or end < start:
        raise ValueError(f"the page holds no {MARKERS[0]!r} ... {MARKERS[1]!r} section")
    text = page[start + len(MARKERS[0]):end]
    m = _SENTENCE.match(text)
    if m is None:
        raise ValueError(f"the suite figures {text!r} are not in the form sentence() writes")
    total, minutes, date, skipped, failed = m.groups()
    n = {k: int(v.replace(",", "")) for k, v in (("total", total), ("skipped", skipped), ("failed", failed))}
    return {**n, "minutes": int(minutes), "date": date}


def replace(page: str, text: str) -> str:
    """`page` with its MARKERS section holding `text`."""
    stated(page)  # raises if there is no section
    start, end = page.find(MARKERS[0]) + len(MARKERS[0]), page.find(MARKERS[1])
    return page[:start] + text + page[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvdp.tools.suite_figures", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the output of the `make test` run")
    ap.add_argument("--date", required=True, help="the day of the run, YYYY-MM-DD")
    ap.add_argument("--write", action="store_true", help="rewrite the figures in docs/support.md")
    args = ap.parse_args(argv)
    text = sentence(parse(Path(args.log).read_text(errors="replace")), args.date)
    return resources.print_or_write(text, "docs/support.md", replace, args.write)


if __name__ == "__main__":
    sys.exit(main())
