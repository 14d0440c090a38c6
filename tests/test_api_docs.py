"""The API reference is the docstrings (`python -m pydoc hvdp.torch`): every public name states its contract.

For each public module: `__all__` lists its public API; every function and class in it (and the public
methods of those classes that hvdp defines) has a docstring of at least one sentence that names each
parameter, names every exception the code itself raises, and, for a collective, says that every rank must
call it; and pydoc renders the module. In-process; the modules are imported inside the tests, so that
collecting this file does not load torch or TensorFlow.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pydoc
import re
import textwrap

import pytest

MODULES = (
    "hvdp",
    "hvdp.torch",
    "hvdp.tensorflow",
    "hvdp.keras",
    "hvdp.spark",
    "hvdp.ray",
    "hvdp.core.checkpoint",
    "hvdp.core.clusters",
    "hvdp.core.config",
    "hvdp.core.consistency",
    "hvdp.core.devices",
    "hvdp.core.heartbeats",
    "hvdp.core.errors",
    "hvdp.core.preemption",
    "hvdp.core.scaling",
    "hvdp.core.sharding",
    "hvdp.core.tuning",
    "hvdp.core.watchdog",
    "hvdp.core.world",
)

# Functions and methods that run a collective (or may: init() forms the world and starts the watchdog with
# an allgather). A rank that skips one, or calls them in another order, leaves the others waiting forever,
# so the docstring must say "every rank must call it".
COLLECTIVES = {
    "hvdp.torch": {"init", "barrier", "prepare", "shard", "broadcast", "average", "evaluate", "check_consistency", "check_finite",
                   "save_checkpoint", "load_checkpoint", "elastic_run", "preempted", "SyncBatchNorm.forward",
                   "ElasticState.sync"},
    "hvdp.tensorflow": {"init", "barrier", "shard", "allreduce_gradients", "broadcast", "average", "evaluate",
                        "check_consistency", "check_finite", "save_checkpoint", "load_checkpoint", "preempted",
                        "DistributedGradientTape.gradient", "DistributedOptimizer.apply",
                        "DistributedOptimizer.flush"},
    "hvdp.keras": {"init", "callbacks", "shard", "barrier", "average", "broadcast", "check_finite", "elastic_run",
                   "ElasticState.sync", "ElasticState.fit"},
}

# Public-looking names defined in a module that are deliberately not part of its API.
NOT_API = {
    "hvdp.core.watchdog": {"PeerState"},  # the watchdog's record of one peer, internal to Watchdog
}

_RAISE = re.compile(r"^\s*raise\s+([A-Z]\w*Error)\b", re.M)


def _defined_in_hvdp(obj) -> bool:
    return (getattr(obj, "__module__", "") or "").split(".")[0] == "hvdp"


def _implementation(module) -> list:
    """The modules whose definitions are `module`'s API: `module` itself and, for a package (hvdp.tensorflow),
    the submodules its __init__ imports from, unless they are documented modules of their own (in MODULES)."""
    if not hasattr(module, "__path__"):
        return [module]
    subs = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module
        if node.level:  # relative: from .runtime import init
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__name__)
        names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
        subs |= {n for n in names if n.startswith(module.__name__ + ".") and n not in MODULES}
    return [module] + [importlib.import_module(s) for s in sorted(subs)]


def _params(func) -> list[str]:
    """The parameters a docstring must name: all but self/cls and the private ones (`_scaled`)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls") and not p.startswith("_")]


def _raised(func) -> set[str]:
    """The exception classes `func`'s own body raises by name (not those raised by what it calls)."""
    try:
        return set(_RAISE.findall(textwrap.dedent(inspect.getsource(func))))
    except (OSError, TypeError):
        return set()


def _problems_with_text(label: str, doc: str | None, *, params=(), raises=(), collective=False) -> list[str]:
    doc = inspect.cleandoc(doc or "")
    if len(doc.split()) < 3 or not re.search(r"[.:]", doc):
        return [f"{label}: no docstring of substance (need at least one sentence), got {doc!r}"]
    problems = []
    missing = [p for p in params if not re.search(rf"(?<![\w]){re.escape(p)}(?![\w])", doc)]
    if missing:
        problems.append(f"{label}: the docstring does not mention parameter(s) {missing}")
    unnamed = sorted(e for e in raises if e not in doc)
    if unnamed:
        problems.append(f"{label}: raises {unnamed} but the docstring does not say so (a 'Raises:' entry)")
    if collective and not re.search(r"every\s+rank\s+must\s+call", doc, re.I):
        problems.append(f"{label}: a collective, but the docstring does not say 'every rank must call it'")
    return problems


def _class_problems(modname: str, name: str, cls) -> list[str]:
    collectives = COLLECTIVES.get(modname, set())
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    params, raises = [], set()
    if "__init__" in cls.__dict__:
        init = cls.__dict__["__init__"]
        params = _params(init)
        raises |= _raised(init)
        doc = (doc or "") + "\n" + (init.__doc__ or "")
    if "__post_init__" in cls.__dict__:
        raises |= _raised(cls.__dict__["__post_init__"])
    if dataclasses.is_dataclass(cls):
        # A field documented in its metadata (TrainConfig's --flag help) counts as documented.
        helped = {f.name for f in dataclasses.fields(cls) if f.metadata.get("help")}
        params = [p for p in params if p not in helped]
    problems = _problems_with_text(f"{modname}.{name}", doc, params=params, raises=raises,
                                   collective=name in collectives)
    for attr, member in cls.__dict__.items():
        if attr.startswith("_"):
            continue
        label = f"{modname}.{name}.{attr}"
        if isinstance(member, property):
            problems += _problems_with_text(label, member.__doc__)
            continue
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if not inspect.isfunction(func):
            continue
        problems += _problems_with_text(label, func.__doc__, params=_params(func), raises=_raised(func),
                                        collective=f"{name}.{attr}" in collectives)
    return problems


def _api(modname: str):
    module = importlib.import_module(modname)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{modname} has no __all__: list its public API there"
    return module, names


@pytest.mark.parametrize("modname", MODULES)
def test_module_docstring_is_an_overview(modname):
    module = importlib.import_module(modname)
    doc = inspect.getdoc(module) or ""
    assert len(doc.split()) >= 12, f"{modname}: the module docstring (pydoc shows it first) is too short: {doc!r}"


@pytest.mark.parametrize("modname", MODULES)
def test_all_lists_the_public_api(modname):
    module, names = _api(modname)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{modname}.__all__ names {missing}, which the module does not define"
    defined = sorted({n for m in _implementation(module) for n, obj in vars(m).items()
                      if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                      and getattr(obj, "__module__", None) == m.__name__})
    unlisted = [n for n in defined if n not in names and n not in NOT_API.get(modname, set())]
    assert not unlisted, (f"{modname} defines public {unlisted} but its __all__ leaves them out: add them to "
                          f"__all__, rename them with a leading underscore, or list them in NOT_API here")


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_states_its_contract(modname):
    module, names = _api(modname)
    collectives = COLLECTIVES.get(modname, set())
    problems = []
    for name in names:
        obj = getattr(module, name, None)
        if not _defined_in_hvdp(obj):
            continue
        if inspect.isclass(obj):
            problems += _class_problems(modname, name, obj)
        elif inspect.isfunction(obj):
            problems += _problems_with_text(f"{modname}.{name}", obj.__doc__, params=_params(obj),
                                            raises=_raised(obj), collective=name in collectives)
    assert not problems, f"{len(problems)} docstring problem(s) in {modname}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("modname", MODULES)
def test_pydoc_renders(modname):
    module = importlib.import_module(modname)
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    assert modname in text
    for name in getattr(module, "__all__", ()):
        if inspect.isfunction(getattr(module, name)) or inspect.isclass(getattr(module, name)):
            assert name in text, f"pydoc {modname} does not show {name}"
