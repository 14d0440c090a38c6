"""Where the files hvdp ships beside its code live: the Horovod build recipe (scripts/build_horovod.sh, the
C++ sources and patches in csrc/horovod/, the pins in constraints.txt) and the benchmark workers (benchmarks/).

The repository keeps one copy of each, at its top level. An installed hvdp (`pip install .`, a wheel) carries
them under hvdp/_build/ with the same layout (setup.py copies them there when it builds); a checkout or an
editable install reads them from the source tree. Either way build_horovod.sh computes the same recipe hash,
so both find the same cached Horovod wheel.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

# What a complete resource root holds, relative to it: setup.py copies exactly these.
FILES = ("scripts/build_horovod.sh", "scripts/cuda_stack.sh", "constraints.txt")
DIRS = ("csrc/horovod", "benchmarks")

_PACKAGED = Path(__file__).resolve().parents[1] / "_build"
_SOURCE = Path(__file__).resolve().parents[2]


def root() -> Path:
    """The directory holding scripts/, csrc/, benchmarks/ and constraints.txt: the installed package's copy
    first, else the source tree this module sits in. Raises FileNotFoundError naming both when neither has
    them (an install built without them)."""
    for candidate in (_PACKAGED, _SOURCE):
        if (candidate / FILES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"hvdp's build recipe is not installed: neither {_PACKAGED / FILES[0]} nor "
                            f"{_SOURCE / FILES[0]} exists. Reinstall hvdp from a wheel or a checkout "
                            f"(pip install --force-reinstall hvdp, or pip install /path/to/hvdp).")


def path(relative: str) -> Path:
    """`relative` (e.g. "benchmarks", "constraints.txt") under the installed copy, else the source tree; it
    may not exist (the caller says what is missing). Never raises: importing a command must not fail."""
    base = _PACKAGED if (_PACKAGED / FILES[0]).is_file() else _SOURCE
    return base / relative


def packaged() -> bool:
    """Whether this hvdp is an installed copy (its files under hvdp/_build/), not a checkout: what to tell a
    user who lacks something (`hvdp build-horovod` and pip, or `make setup`)."""
    return (_PACKAGED / FILES[0]).is_file()


def print_or_write(text: str, page: str, replace: Callable[[str, str], str], write: bool) -> int:
    """A generated docs section's command (hvdp.tools.fixes, hvdp.tools.suite_figures): print `text`, or with
    `write` put it into the checkout's `page` (e.g. "docs/install.md") with `replace(page_text, text)`. Returns
    the exit code (1: no such page, outside a checkout)."""
    if not write:
        print(text)
        return 0
    target = path(page)
    if not target.is_file():
        print(f"no {target}: --write needs a checkout", file=sys.stderr)
        return 1
    target.write_text(replace(target.read_text(), text))
    return 0
