"""`import hvdp` must stay cheap: no framework, no horovod, nothing heavy."""
import subprocess
import sys

HEAVY = ("torch", "tensorflow", "keras", "horovod", "mpi4py", "sklearn", "matplotlib", "pyspark", "ray", "py4j",
         "lightning", "pytorch_lightning")


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


def test_a_pytorch_job_under_horovodrun_prints_no_tensorflow_banner(tmp_path):
    # issue 46: horovodrun's gloo_built()/mpi_built() loaded horovod.tensorflow's extension first, in a child
    # process, so TensorFlow's oneDNN/absl banner came with every PyTorch-only launch (build_horovod.sh fix 18).
    from tests.launch import ROOT, env, launcher_cmd

    code = "import sys, hvdp.torch as ht; ht.init(); print('tensorflow loaded:', 'tensorflow' in sys.modules)"
    proc = subprocess.run(launcher_cmd("gloo") + ["-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=env(), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("tensorflow loaded: False") == 2, out[-3000:]
    assert "oneDNN" not in out and "TensorFlow binary" not in out and "absl::" not in out, out[-3000:]
