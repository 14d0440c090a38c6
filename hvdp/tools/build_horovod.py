"""`hvdp build-horovod`: build Horovod with hvdp's source fixes against the environment this Python runs in,
and install it there. No root, no apt: everything comes from pip or what is already on PATH.

It chooses what to build from the environment (torch and/or TensorFlow, whichever are installed; MPI when
mpicxx is on PATH, else Gloo only; NCCL when torch is a CUDA build and a CUDA toolkit and NCCL are found),
checks the tools the build needs and says the command that installs a missing one, then runs the one build
recipe, scripts/build_horovod.sh, shipped inside the package (hvdp/tools/resources.py). `make setup` runs the
same script, so both share its source fixes and its wheel cache (~/.cache/hvdp/wheels/<key>).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from hvdp.tools import resources


def add_arguments(parser) -> None:
    parser.add_argument("--print-plan", action="store_true",
                        help="say what would be built and why, check the tools, and stop")
    parser.add_argument("--without-mpi", action="store_true",
                        help="build Gloo only even when mpicxx is on PATH")
    parser.add_argument("--cpu-only", action="store_true",
                        help="with a CUDA torch, build without NCCL GPU operations instead of requiring a CUDA "
                             "toolkit and NCCL")
    parser.add_argument("--no-install", action="store_true",
                        help="build (or find in the cache) the wheel and print its path; do not install it")


@dataclass
class Plan:
    """What `hvdp build-horovod` would build: the env's frameworks, the controllers, the GPU operations, the
    environment the recipe runs with, and the problems that stop it (each with its fix)."""
    python: str
    torch: str | None = None
    torch_cuda: str | None = None
    tensorflow: str | None = None
    mpi: str | None = None          # mpicxx's path, when MPI is built in
    gpu: str | None = None          # "NCCL" or None
    pip_cuda: bool = False          # the toolkit is pip's (site-packages/nvidia/cu13): lay it out first
    env: dict = field(default_factory=dict)
    reasons: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


def _which(name: str, bindir: Path) -> str | None:
    """`name` in this env's bin directory first (pip's cmake lands there), then on PATH."""
    return shutil.which(name, path=str(bindir)) or shutil.which(name)


def _torch_cuda() -> str | None:
    """torch.version.cuda, asked of a child process so this one loads no framework."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def _site_packages() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(p) for p in dict.fromkeys((paths["purelib"], paths["platlib"]))]


def _pip_cuda13() -> bool:
    """Whether this env holds pip's CUDA 13 toolkit (cuda-toolkit[nvcc,...], in site-packages/nvidia/cu13), the
    layout `make setup-cuda` builds with; scripts/cuda_stack.sh's cuda_layout makes it look like a CUDA install."""
    return any((sp / "nvidia" / "cu13" / "bin" / "nvcc").is_file() for sp in _site_packages())


def _nvcc_top(nvcc: str) -> Path:
    """The toolkit an `nvcc` found on PATH belongs to: the TOP its driver reports (`nvcc --dryrun` prints the
    variables of its nvcc.profile). A GPU server's /usr/local/bin/nvcc or a module's wrapper is often a script
    that execs the real one, so the directory above the file found (/usr/local) is not the toolkit; that was
    issue 46's `Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART)`."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("#$ TOP="):
                return Path(line.split("=", 1)[1].strip()).resolve()
    except (OSError, subprocess.SubprocessError):
        pass
    return Path(nvcc).resolve().parents[1]


# Where a user points Horovod at a CUDA toolkit, in the order Horovod's and torch's builds read them.
CUDA_HOME_VARS = ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # where torch.utils.cpp_extension also looks


def _cuda_home(bindir: Path) -> tuple[Path | None, str]:
    """(the CUDA toolkit to build with, how it was found), or (None, ""): the first of HOROVOD_CUDA_HOME,
    CUDA_HOME and CUDA_PATH that is set (taken as the user's choice even when incomplete: the preflight then
    says what it lacks), pip's toolkit in this env (site-packages/nvidia/cu13 with nvcc), the toolkit of the
    nvcc on PATH, /usr/local/cuda."""
    for var in CUDA_HOME_VARS:
        if os.environ.get(var):
            return Path(os.environ[var]), f"${var}"
    for sp in _site_packages():
        if (sp / "nvidia" / "cu13" / "bin" / "nvcc").is_file():
            return sp / "nvidia" / "cu13", "pip's nvidia-cuda-nvcc in this env"
    nvcc = _which("nvcc", bindir)
    if nvcc:
        return _nvcc_top(nvcc), f"the toolkit of {nvcc}"
    if (DEFAULT_CUDA_HOME / "bin" / "nvcc").is_file():
        return DEFAULT_CUDA_HOME, str(DEFAULT_CUDA_HOME)
    return None, ""


# What Horovod's NCCL build needs of a CUDA toolkit, as alternatives under its root, and the pip package
# that brings each piece into a pip toolkit (site-packages/nvidia/cu13).
TOOLKIT_PIECES = (
    ("nvcc", ("bin/nvcc",), "nvidia-cuda-nvcc"),
    ("cicc, nvcc's device compiler", ("nvvm/bin/cicc",), "nvidia-nvvm"),
    ("crt/host_config.h", ("include/crt/host_config.h", "targets/*/include/crt/host_config.h"), "nvidia-cuda-crt"),
    ("cuda_runtime.h", ("include/cuda_runtime.h", "targets/*/include/cuda_runtime.h"), "nvidia-cuda-runtime"),
    ("nv/target (CCCL, for cuda_fp16.h)", ("include/cccl/nv/target", "include/nv/target",
                                           "targets/*/include/cccl/nv/target", "targets/*/include/nv/target"),
     "nvidia-cuda-cccl"),
    ("libcudart.so", ("lib64/libcudart.so", "lib/libcudart.so", "targets/*/lib/libcudart.so"),
     "nvidia-cuda-runtime"),
    ("libcudart_static.a", ("lib64/libcudart_static.a", "lib/libcudart_static.a", "targets/*/lib/libcudart_static.a"),
     "nvidia-cuda-runtime"),
    ("libcudadevrt.a", ("lib64/libcudadevrt.a", "lib/libcudadevrt.a", "targets/*/lib/libcudadevrt.a"),
     "nvidia-cuda-runtime"),
)


def toolkit_problems(home: Path, how: str, torch_cuda: str, pip: bool) -> list[str]:
    """What the CUDA toolkit at `home` lacks for Horovod's NCCL build, each naming the missing file and the fix;
    [] when it is complete and its CUDA major version is torch's.

    Args:
        home: the toolkit's root (the directory holding bin/nvcc).
        how: how it was found (for the message: "$CUDA_HOME", "the toolkit of /usr/local/bin/nvcc").
        torch_cuda: torch.version.cuda ("13.0").
        pip: whether it is pip's toolkit in this env, whose missing pieces pip installs (and whose
            libcudart.so link scripts/cuda_stack.sh's cuda_layout adds before the build).
    """
    major = torch_cuda.split(".")[0]
    problems, packages = [], []
    for what, alternatives, package in TOOLKIT_PIECES:
        patterns = alternatives + (("lib/libcudart.so.*",) if pip and what == "libcudart.so" else ())
        if any(glob.glob(str(home / pattern)) for pattern in patterns):
            continue
        if pip:
            packages.append(package)
            problems.append(f"the CUDA toolkit in {home} ({how}) has no {what} ({home / alternatives[0]})")
        else:
            problems.append(f"the CUDA toolkit in {home} ({how}) has no {what} ({home / alternatives[0]}): point "
                            f"CUDA_HOME at a complete CUDA {major} toolkit (`module load cuda`, or the one in "
                            f"/usr/local/cuda-{major}.x), or install this env's: {sys.executable} -m pip install "
                            f"'cuda-toolkit[nvcc,crt,nvvm,cccl]=={torch_cuda}.*' and unset CUDA_HOME")
    if packages:
        pins = " ".join(f"'{p}=={torch_cuda}.*'" for p in dict.fromkeys(packages))
        problems[-1] += f". Install the missing pieces: {sys.executable} -m pip install {pins}"
    version = _toolkit_version(home)
    if version and version.split(".")[0] != major:
        problems.append(f"the CUDA toolkit in {home} ({how}) is CUDA {version}, but torch is a CUDA {torch_cuda} "
                        f"build: point CUDA_HOME at a CUDA {major} toolkit, or pip install "
                        f"'cuda-toolkit[nvcc,crt,nvvm,cccl]=={torch_cuda}.*'")
    if pip:  # nvcc 13.0 with a newer crt or nvvm from an unpinned install fails to compile
        versions = {d: _version(d) for d in ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm")}
        found = {d: v for d, v in versions.items() if v}
        if len({".".join(v.split(".")[:2]) for v in found.values()}) > 1:
            nvcc = ".".join(found.get("nvidia-cuda-nvcc", next(iter(found.values()))).split(".")[:2])
            problems.append("pip's CUDA compiler pieces differ in version (" + ", ".join(
                f"{d} {v}" for d, v in found.items()) + f"): {sys.executable} -m pip install "
                f"'nvidia-cuda-crt=={nvcc}.*' 'nvidia-nvvm=={nvcc}.*'")
    return problems


def _toolkit_version(home: Path) -> str | None:
    """"13.0" from the toolkit's cuda_runtime_api.h (CUDART_VERSION 13000), or None."""
    for header in [home / "include" / "cuda_runtime_api.h", *home.glob("targets/*/include/cuda_runtime_api.h")]:
        try:
            match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
        except OSError:
            continue
        if match:
            number = int(match.group(1))
            return f"{number // 1000}.{number % 1000 // 10}"
    return None


def _nccl_home() -> Path | None:
    """HOROVOD_NCCL_HOME or NCCL_HOME, else pip's nvidia-nccl-cu* package (site-packages/nvidia/nccl)."""
    candidates = [os.environ.get("HOROVOD_NCCL_HOME"), os.environ.get("NCCL_HOME")]
    candidates += [str(sp / "nvidia" / "nccl") for sp in _site_packages()]
    for home in candidates:
        if home and (Path(home) / "include" / "nccl.h").is_file():
            return Path(home)
    return None


def make_plan(without_mpi: bool = False, cpu_only: bool = False) -> Plan:
    bindir = Path(sys.executable).parent
    plan = Plan(python=sys.executable)
    pyver = "%d.%d" % sys.version_info[:2]
    plan.torch = _version("torch")
    plan.tensorflow = _version("tensorflow-cpu", "tensorflow")
    env = {"PYTHON": sys.executable, "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")])}
    if plan.torch:
        plan.reasons.append(f"PyTorch: torch {plan.torch} is installed in this env")
    else:
        env["HOROVOD_WITHOUT_PYTORCH"] = "1"
    if plan.tensorflow:
        plan.reasons.append(f"TensorFlow: tensorflow {plan.tensorflow} is installed in this env")
    else:
        env["HOROVOD_WITHOUT_TENSORFLOW"] = "1"
    if not plan.torch and not plan.tensorflow:
        plan.problems.append("neither torch nor tensorflow is installed in this env, and Horovod is built for the "
                             "frameworks it finds. Install one first: pip install 'hvdp[torch]' (a CPU torch: pip "
                             "install torch --index-url https://download.pytorch.org/whl/cpu) or "
                             "pip install 'hvdp[tensorflow]'")

    mpicxx = None if without_mpi else _which("mpicxx", bindir)
    if mpicxx:
        plan.mpi = mpicxx
        plan.reasons.append(f"MPI and Gloo: mpicxx is at {mpicxx}")
    else:
        env["HOROVOD_WITHOUT_MPI"] = "1"
        plan.reasons.append("Gloo only: " + ("--without-mpi" if without_mpi else
                            "no mpicxx on PATH (for MPI: `module load openmpi`, conda install -c conda-forge "
                            "openmpi, or your system's OpenMPI, then rerun)"))

    if plan.torch:
        plan.torch_cuda = _torch_cuda()
    if plan.torch_cuda and not cpu_only:
        (cuda, how), nccl = _cuda_home(bindir), _nccl_home()
        if cuda and nccl:
            plan.pip_cuda = _pip_cuda13() and cuda.parts[-2:] == ("nvidia", "cu13")
            incomplete = toolkit_problems(cuda, how, plan.torch_cuda, plan.pip_cuda)
            plan.problems += [p + "; or pass --cpu-only to build without NCCL" for p in incomplete]
            plan.gpu = None if incomplete else "NCCL"
            env.update(HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_CUDA_HOME=str(cuda), CUDA_HOME=str(cuda),
                       HOROVOD_NCCL_HOME=str(nccl))
            env["PATH"] = os.pathsep.join([str(cuda / "bin"), env["PATH"]])
            plan.reasons.append(f"NCCL GPU operations: torch is a CUDA {plan.torch_cuda} build, the CUDA toolkit "
                                f"in {cuda} ({how}), NCCL in {nccl}")
        else:
            missing = ([] if cuda else ["a CUDA toolkit (nvcc: set CUDA_HOME, `module load cuda`, or pip install "
                                        f"'cuda-toolkit[nvcc,crt,nvvm,cccl]=={plan.torch_cuda}.*')"]) + \
                      ([] if nccl else ["NCCL (pip install nvidia-nccl-cu%s, or set HOROVOD_NCCL_HOME)"
                                        % plan.torch_cuda.split(".")[0]])
            plan.problems.append(f"torch {plan.torch} is a CUDA {plan.torch_cuda} build but " + " and ".join(missing)
                                 + " is missing; install it, or pass --cpu-only to build without NCCL")
    elif plan.torch_cuda:
        plan.reasons.append(f"no GPU operations: --cpu-only (torch is a CUDA {plan.torch_cuda} build)")

    # The tools the build runs, each with the command that brings it without root.
    cxx = os.environ.get("CXX") or _which("g++", bindir) or _which("c++", bindir)
    if not cxx:
        plan.problems.append("no C++ compiler (g++): `module load gcc` on a cluster, conda install -c conda-forge "
                             "gxx_linux-64 in a conda env, or ask for g++ (apt-get install g++)")
    if not _which("cmake", bindir):
        plan.problems.append(f"no cmake: {sys.executable} -m pip install cmake (or 'hvdp[build]', which brings "
                             f"cmake, wheel and setuptools<82)")
    if not _which("make", bindir):
        plan.problems.append("no make: `module load make`, conda install -c conda-forge make, or apt-get install make")
    if not _which("patch", bindir):
        plan.problems.append("no patch (it applies hvdp's fixes to Horovod's source): conda install -c conda-forge "
                             "patch, or apt-get install patch")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        plan.problems.append(f"no Python headers ({header} is missing): install python{pyver}-dev "
                             f"(apt-get install python{pyver}-dev), or use a Python that ships them (conda, pyenv, "
                             f"python.org)")
    need = [dist for dist in ("setuptools", "wheel") if not _version(dist)]
    if need:
        plan.problems.append(f"no {' and '.join(need)} in this env (Horovod builds without isolation, against "
                             f"this env's frameworks): {sys.executable} -m pip install 'setuptools<82' wheel (or 'hvdp[build]')")
    plan.env = env
    return plan


def describe(plan: Plan, recipe: Path) -> str:
    version = _pins(recipe).get("horovod", "?")
    lines = [f"hvdp build-horovod: Horovod {version} for {plan.python} (Python {sys.version.split()[0]})"]
    lines += [f"  with {r}" for r in plan.reasons]
    lines.append(f"  recipe: {recipe / 'scripts' / 'build_horovod.sh'} (its fixes: {recipe / 'csrc' / 'horovod'})")
    cache = os.environ.get("HVDP_CACHE_DIR") or str(Path(os.environ.get("XDG_CACHE_HOME") or
                                                          Path.home() / ".cache") / "hvdp")
    lines.append(f"  wheel cache: {cache}/wheels/<key> (a rerun with nothing changed reuses it)")
    lines += [f"  problem: {p}" for p in plan.problems]
    return "\n".join(lines)


def _pins(recipe: Path) -> dict:
    path = recipe / "constraints.txt"
    text = path.read_text() if path.is_file() else ""
    return dict(line.split("==", 1) for line in text.split() if "==" in line)


def run(args) -> int:
    try:
        recipe = resources.root()
    except FileNotFoundError as e:
        print(f"hvdp build-horovod: {e}", file=sys.stderr)
        return 2
    plan = make_plan(without_mpi=args.without_mpi, cpu_only=args.cpu_only)
    print(describe(plan, recipe), flush=True)
    if plan.problems:
        print(f"hvdp build-horovod: cannot build: fix the {len(plan.problems)} problem(s) above and rerun",
              file=sys.stderr)
        return 2
    if args.print_plan:
        return 0
    start = time.monotonic()
    env = dict(os.environ, **plan.env)
    if plan.pip_cuda:  # the symlinks `make setup-cuda` adds to pip's CUDA wheels, by the same shell function
        layout = subprocess.run(["bash", "-c", 'source "$1" && cuda_layout "$2"', "cuda_layout",
                                 str(recipe / "scripts" / "cuda_stack.sh"), sys.executable])
        if layout.returncode != 0:
            print("hvdp build-horovod: pip's CUDA toolkit is incomplete (above)", file=sys.stderr)
            return 2
    build = subprocess.run(["bash", str(recipe / "scripts" / "build_horovod.sh")], env=env,
                           stdout=subprocess.PIPE, text=True)
    if build.returncode != 0:
        print(f"hvdp build-horovod: the build failed (exit {build.returncode}); its output is above", file=sys.stderr)
        return 1
    wheel = build.stdout.strip().splitlines()[-1]
    print(f"hvdp build-horovod: wheel {wheel} ({time.monotonic() - start:.0f} s)", flush=True)
    if args.no_install:
        print(wheel)
        return 0
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    # The wheel replaces any Horovod of the same version; its dependencies come in the second step.
    for cmd in (pip + ["--no-deps", "--force-reinstall", wheel], pip + [wheel]):
        if subprocess.run(cmd).returncode != 0:
            print(f"hvdp build-horovod: installing {wheel} failed: {' '.join(cmd)}", file=sys.stderr)
            return 1
    print(f"hvdp build-horovod: installed in {sys.prefix} ({time.monotonic() - start:.0f} s in all); "
          f"check it with: hvdp doctor", flush=True)
    return 0
