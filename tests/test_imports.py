"""`import hvdp` must stay cheap: no framework, no horovod, nothing heavy."""
import subprocess
import sys

HEAVY = ("torch", "tensorflow", "keras", "horovod", "mpi4py", "sklearn", "matplotlib", "pyspark", "ray", "py4j")


def test_import_hvdp_loads_no_framework():
    code = ("import sys, hvdp, hvdp.core.sharding, hvdp.core.checkpoint, hvdp.core.clusters, hvdp.tools.cli, "
            "hvdp.spark, hvdp.ray;"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_core_imports_nothing_of_the_frameworks():
    # Static guard: the core package may not even mention a framework import.
    import pathlib

    import hvdp.core
    for path in pathlib.Path(hvdp.core.__file__).parent.glob("*.py"):
        text = path.read_text()
        for mod in HEAVY:
            assert f"import {mod}" not in text and f"from {mod}" not in text, f"{path.name} imports {mod}"
