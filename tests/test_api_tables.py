"""The API tables in docs/ agree with the code: every `name(arguments)` in a table headed
`| function | what it does |` names the function's parameters exactly (none missing, none extra, `**kwargs`
included) and the defaults it writes as literals are the function's own. In-process: the modules are
imported inside the test."""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest

from tests import launch

# The module a page's unqualified names belong to; a qualified one (`hvdp.keras.callbacks(...)`) names its own.
PAGES = {"pytorch.md": "hvdp.torch", "tensorflow-keras.md": "hvdp.tensorflow"}
CALL = re.compile(r"`((?:hvdp\.\w+\.)?[A-Za-z_]\w*)\(([^`]*)\)(?: -> [^`]*)?`")
_NO_LITERAL = object()


def _rows(page: str) -> list[tuple[str, str, str]]:
    """(module, name, arguments) of each signature in the first column of the page's function tables."""
    found, in_table = [], False
    for line in (launch.ROOT / "docs" / page).read_text().splitlines():
        if re.match(r"\|\s*function\s*\|\s*what it does\s*\|", line):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if in_table and not line.startswith("|---"):
            first = line.split("|")[1]
            for name, args in CALL.findall(first):
                module, _, short = name.rpartition(".")
                found.append((module or PAGES[page], short, args))
    return found


ROWS = [(page, *row) for page in PAGES for row in _rows(page)]


def _split(args: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for c in args:
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += c
    return [p for p in parts + [current.strip()] if p and p not in ("*", "...")]


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _NO_LITERAL


def test_the_tables_were_found():
    assert len(ROWS) >= 15, ROWS  # a parser that found nothing would pass every check below


@pytest.mark.parametrize("page,module,name,args", ROWS, ids=[f"{p}:{m}.{n}" for p, m, n, _ in ROWS])
def test_table_row_matches_the_signature(page, module, name, args):
    func = getattr(importlib.import_module(module), name)
    params = {p.name: p for p in inspect.signature(func).parameters.values() if p.name not in ("self", "cls") and not p.name.startswith("_")}
    documented = {}
    for arg in _split(args):
        key, _, default = arg.lstrip("*").partition("=")
        documented[key.strip()] = default.strip()
    missing = sorted(set(params) - set(documented))
    extra = sorted(set(documented) - set(params))
    assert not missing and not extra, (f"docs/{page}: `{name}({args})` against {module}.{name}{inspect.signature(func)}: "
                                       f"missing {missing}, extra {extra}")
    for key, default in documented.items():
        value = _literal(default) if default else _NO_LITERAL
        if value is not _NO_LITERAL:
            assert params[key].default == value, f"docs/{page}: {name}'s {key}={default}, the code's is {params[key].default!r}"


def test_the_bench_synopsis_lists_every_option():
    import argparse

    from hvdp.tools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    text = (launch.ROOT / "docs" / "benchmarks.md").read_text()
    synopsis = text[text.index("hvdp bench ["):text.index("```", text.index("hvdp bench ["))]
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [o for o in options if o not in synopsis]
    assert not missing, f"docs/benchmarks.md's synopsis of hvdp bench lacks {missing}"
