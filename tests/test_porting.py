"""docs/porting.md's ports do what the page says: the port at np=2 with batch b ends with the weights of the
plain script alone at batch 2·b and twice the rate (hvdp verify's criterion), and the page's diff is the diff
of its two PyTorch scripts. The scripts run as the page shows them, with the data order fixed in both
(`shuffle=True` -> `False`: hvdp's shuffled order is its own) and, for the plain one, the global batch and
its rate (`batch_size=64` -> 128, the rate x2)."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

import numpy as np
import pytest

from tests import launch
from tests.test_docs import FENCE

PAGE = launch.ROOT / "docs" / "porting.md"


def _block(first_line: str) -> str:
    found = [code for lang, code in FENCE.findall(PAGE.read_text()) if code.startswith(first_line)]
    assert len(found) == 1, f"docs/porting.md: expected one block starting {first_line!r}, found {len(found)}"
    return found[0]


def _plain_at_global_batch(code: str, rate: str, doubled: str) -> str:
    assert code.count("batch_size=64") == 1 and code.count(rate) == 1, "the plain script changed: update the test"
    return code.replace("batch_size=64", "batch_size=128").replace(rate, doubled).replace("shuffle=True", "shuffle=False")


def _run_both(tmp_path, plain: str, port: str):
    alone, ranks = tmp_path / "alone", tmp_path / "np2"
    alone.mkdir(), ranks.mkdir()
    (alone / "train.py").write_text(plain)
    (ranks / "train.py").write_text(port.replace("shuffle=True", "shuffle=False"))
    proc = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, timeout=300, cwd=alone,
                          env=launch.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = launch.run("mpi", ranks / "train.py", np=2, timeout=300, cwd=ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return alone, ranks


def test_the_diff_on_the_page_is_the_diff_of_its_scripts():
    plain, port = _block("# train.py: one process"), _block("# train.py: data-parallel with hvdp")
    diff = difflib.unified_diff(plain.splitlines(), port.splitlines(), lineterm="", n=100)
    shown = [code for lang, code in FENCE.findall(PAGE.read_text()) if lang == "diff"]
    assert shown and shown[0].splitlines() == list(diff)[2:], "regenerate the diff block in docs/porting.md"


def test_torch_port_at_np2_is_the_plain_script_at_the_global_batch(tmp_path):
    plain = _plain_at_global_batch(_block("# train.py: one process"), "lr=0.1", "lr=0.2")
    alone, ranks = _run_both(tmp_path, plain, _block("# train.py: data-parallel with hvdp"))
    code = ("import sys, torch; a, b = (torch.load(p, weights_only=True) for p in sys.argv[1:]); "
            "print(max(float((a[k] - b[k]).abs().max()) for k in a))")
    proc = subprocess.run([sys.executable, "-c", code, str(alone / "model.pt"), str(ranks / "model.pt")],
                          capture_output=True, text=True, check=True, env=launch.env())
    assert float(proc.stdout) <= 1e-5, proc.stdout


def _h5_arrays(path) -> dict:
    h5py = pytest.importorskip("h5py")
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, np.asarray(obj)) if isinstance(obj, h5py.Dataset) else None)
    return found


def test_keras_port_at_np2_is_the_plain_script_at_the_global_batch(tmp_path):
    plain = _plain_at_global_batch(_block("# train_keras.py: one process"), "SGD(0.1,", "SGD(0.2,")
    alone, ranks = _run_both(tmp_path, plain, _block("# train_keras.py: data-parallel with hvdp"))
    a, b = (_h5_arrays(d / "model.weights.h5") for d in (alone, ranks))
    a, b = ({k: v for k, v in w.items() if k.startswith("layers/")} for w in (a, b))  # the model (not optimizer)
    assert a.keys() == b.keys() and len(a) == 4, (a.keys(), b.keys())
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-5
