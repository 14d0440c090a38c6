"""Copies the files hvdp ships beside its code into the built package (hvdp/_build/), so an installed hvdp
(`pip install .`, a wheel from `python -m build`) carries its Horovod build recipe and benchmark workers.
The repository keeps one copy of each at its top level; hvdp/tools/resources.py finds either. Everything
else about the package is in setup.cfg."""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
_resources = runpy.run_path(str(HERE / "hvdp" / "tools" / "resources.py"))  # the one list of what ships
FILES, DIRS = _resources["FILES"], _resources["DIRS"]


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads them from the source tree
            return
        target = Path(self.build_lib) / "hvdp" / "_build"
        missing = [rel for rel in (*FILES, *DIRS) if not (HERE / rel).exists()]
        if missing:  # a package without its build recipe would fail later, in `hvdp build-horovod`
            raise FileNotFoundError(f"hvdp ships {', '.join(missing)} inside the package, but {HERE} lacks them: "
                                    f"build from a full checkout or sdist")
        for rel in FILES:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(HERE / rel, target / rel)
        for rel in DIRS:
            shutil.rmtree(target / rel, ignore_errors=True)
            shutil.copytree(HERE / rel, target / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithResources})
