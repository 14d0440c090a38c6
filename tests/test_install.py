"""hvdp as an ordinary package: what a wheel carries (the Horovod build recipe, the benchmark workers), and
`hvdp build-horovod`'s plan and preflight errors, decided from the environment without building anything.

The install as a user without root (a fresh venv, `pip install` of a copy of the checkout, `hvdp doctor`, the
preflight errors from the command line) runs under `make test-install` (HVDP_TEST_INSTALL=1; it creates a
throwaway user, so it needs root). So does the whole path on Python 3.12 and 3.13: `pip install 'hvdp[torch]'`
into a fresh venv, a real `hvdp build-horovod` (~10 minutes on 2 cores, cached for a rerun) and the main job at
np=2; docs/install.md gives the commands and what they took."""

from __future__ import annotations

import filecmp
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from hvdp.tools import build_horovod, resources
from tests.launch import result_line

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [*resources.FILES, *(str(p.relative_to(ROOT)) for d in resources.DIRS for p in sorted((ROOT / d).rglob("*"))
                               if p.is_file() and "__pycache__" not in p.parts)]


def _copy_for_build(dest: Path) -> Path:
    """What a build of the package reads (the metadata, the code, what setup.py ships), copied out of the tree
    so the test neither writes build/ into the checkout nor races another build."""
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", *resources.FILES):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    for name in ("hvdp", *resources.DIRS):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_the_wheel_carries_the_build_recipe_and_the_bench_workers(tmp_path):
    src = _copy_for_build(tmp_path / "src")
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [wheel] = out.glob("hvdp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for rel in SHIPPED:  # the repository's one copy, byte for byte
            assert f"hvdp/_build/{rel}" in names, rel
            assert z.read(f"hvdp/_build/{rel}") == (ROOT / rel).read_bytes(), rel
    assert "hvdp/_build/benchmarks/train_worker.py" in names
    assert "hvdp/_build/csrc/horovod/patches/bfloat16.patch" in names


def test_the_sdist_carries_what_setup_py_ships():
    # python -m build makes the wheel from the sdist: MANIFEST.in must name everything setup.py copies.
    words = (ROOT / "MANIFEST.in").read_text().split()
    assert all(rel in words for rel in resources.FILES), words
    assert all(f"graft {rel}" in " ".join(words) for rel in resources.DIRS), words


def test_the_recipe_is_found_in_the_checkout():
    # An editable install or a checkout reads the repository's files; an installed copy its hvdp/_build/.
    assert resources.root() in (ROOT, ROOT / "hvdp" / "_build")
    for rel in SHIPPED:
        assert filecmp.cmp(resources.path(rel), ROOT / rel, shallow=False), rel


# The plan, with the environment faked: which distributions are installed, what is on PATH.
@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def set_env(dists=("torch",), tools=("g++", "cmake", "make", "patch"), cuda=None):
        versions = {"torch": "2.13.0", "tensorflow": "2.21.0", "setuptools": "80", "wheel": "0.45"}
        installed = {d: versions[d] for d in (*dists, "setuptools", "wheel")}
        monkeypatch.setattr(build_horovod, "_version",
                            lambda *names: next((installed[n] for n in names if n in installed), None))
        monkeypatch.setattr(build_horovod, "_torch_cuda", lambda: cuda)
        for old in bindir.iterdir():
            old.unlink()
        for tool in tools:
            (bindir / tool).write_text("#!/bin/sh\n")
            (bindir / tool).chmod(0o755)
        monkeypatch.setenv("PATH", str(bindir))
        monkeypatch.delenv("CXX", raising=False)
        for var in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH", "HOROVOD_NCCL_HOME", "NCCL_HOME"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(build_horovod, "_which", lambda name, _bindir: shutil.which(name, path=str(bindir)))
        monkeypatch.setattr(build_horovod, "DEFAULT_CUDA_HOME", tmp_path / "no-usr-local-cuda")
    return set_env


def test_plan_without_a_framework_says_how_to_install_one(fake_env):
    fake_env(dists=())
    plan = build_horovod.make_plan()
    assert any("neither torch nor tensorflow" in p and "pip install 'hvdp[torch]'" in p for p in plan.problems)


@pytest.mark.parametrize("tool, fix", [("cmake", "-m pip install cmake"), ("g++", "gxx_linux-64"),
                                       ("make", "no make"), ("patch", "no patch")])
def test_plan_names_a_missing_tool_and_its_fix(fake_env, tool, fix):
    fake_env(tools=[t for t in ("g++", "cmake", "make", "patch") if t != tool])
    problems = build_horovod.make_plan().problems
    assert len(problems) == 1 and fix in problems[0], problems


@pytest.mark.parametrize("dists, mpi", [(("torch",), True), (("tensorflow",), False),
                                        (("torch", "tensorflow"), False)])
def test_plan_builds_what_the_env_has(fake_env, dists, mpi):
    fake_env(dists=dists, tools=("g++", "cmake", "make", "patch") + (("mpicxx",) if mpi else ()))
    plan = build_horovod.make_plan()
    assert plan.problems == []
    assert ("HOROVOD_WITHOUT_PYTORCH" in plan.env) == ("torch" not in dists)
    assert ("HOROVOD_WITHOUT_TENSORFLOW" in plan.env) == ("tensorflow" not in dists)
    assert ("HOROVOD_WITHOUT_MPI" in plan.env) == (not mpi)
    assert "HOROVOD_GPU_OPERATIONS" not in plan.env
    assert plan.env["PYTHON"] == sys.executable


def test_plan_with_a_cuda_torch_and_no_toolkit_says_what_is_missing(fake_env):
    fake_env(cuda="13.0")
    [problem] = build_horovod.make_plan().problems
    assert "CUDA 13.0 build" in problem and "nvidia-nccl-cu13" in problem and "--cpu-only" in problem
    fake_env(cuda="13.0")
    assert build_horovod.make_plan(cpu_only=True).problems == []


@pytest.mark.parametrize("missing", [None, "include/cccl/nv/target"])
def test_plan_with_a_cuda_torch_and_pips_toolkit_builds_nccl(fake_env, monkeypatch, tmp_path, missing):
    # make setup-cuda's stack: cuda-toolkit[nvcc,...] and nvidia-nccl-cu13 from pip, in site-packages/nvidia;
    # its runtime has only libcudart.so.13 (cuda_layout links libcudart.so before the build).
    site = tmp_path / "site-packages"
    home = _toolkit(site / "nvidia/cu13", leave_out="lib64/libcudart.so")
    for gone in filter(None, [missing]):
        (home / gone).unlink()
    (home / "lib").mkdir(exist_ok=True)
    (home / "lib/libcudart.so.13").write_text("")
    (site / "nvidia/nccl/include").mkdir(parents=True)
    (site / "nvidia/nccl/include/nccl.h").write_text("")
    fake_env(cuda="13.0")
    monkeypatch.setattr(build_horovod, "_site_packages", lambda: [site])
    plan = build_horovod.make_plan()
    if missing:  # the file, and the pip command that brings it
        [problem] = plan.problems
        assert str(home / missing) in problem and "-m pip install 'nvidia-cuda-cccl==13.0.*'" in problem, problem
        return
    assert plan.problems == [] and plan.gpu == "NCCL" and plan.pip_cuda
    assert plan.env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert plan.env["HOROVOD_CUDA_HOME"] == str(site / "nvidia/cu13")
    assert plan.env["HOROVOD_NCCL_HOME"] == str(site / "nvidia/nccl")
    assert plan.env["PATH"].startswith(str(site / "nvidia/cu13/bin"))


def _toolkit(root: Path, version: int = 13000, leave_out: str = "") -> Path:
    """A CUDA toolkit's layout as a GPU server has it (lib64 -> lib, a real nvcc that reports its TOP as
    `nvcc --dryrun` does), every piece of TOOLKIT_PIECES but `leave_out`, CUDART_VERSION `version`."""
    for _what, (first, *_), _package in build_horovod.TOOLKIT_PIECES:
        if first != leave_out:
            (root / first).parent.mkdir(parents=True, exist_ok=True)
            (root / first).write_text("")
    (root / "include" / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
    if leave_out != "bin/nvcc":
        (root / "bin" / "nvcc").write_text(f'#!/bin/sh\necho "#$ _HERE_={root}/bin"\necho "#$ TOP={root}/bin/.."\n')
        (root / "bin" / "nvcc").chmod(0o755)
    return root


@pytest.fixture
def cuda_server(fake_env, monkeypatch, tmp_path):
    """A CUDA torch, NCCL from pip (HOROVOD_NCCL_HOME here), and no toolkit until the test lays one out."""
    nccl = tmp_path / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include" / "nccl.h").write_text("")
    fake_env(cuda="13.0")
    monkeypatch.setattr(build_horovod, "_site_packages", lambda: [tmp_path / "empty-site-packages"])
    monkeypatch.setenv("HOROVOD_NCCL_HOME", str(nccl))
    return tmp_path


def test_plan_finds_the_toolkit_behind_a_wrapper_nvcc_on_path(cuda_server):
    # issue 46: /usr/local/bin/nvcc was a script exec'ing /usr/local/cuda-13.0/bin/nvcc, and the plan took
    # /usr/local for the toolkit: Horovod's CMake then failed with `Could NOT find CUDAToolkit (missing:
    # CUDAToolkit_INCLUDE_DIR CUDA_CUDART)`.
    home = _toolkit(cuda_server / "cuda-13.0")
    wrapper = cuda_server / "bin" / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    plan = build_horovod.make_plan()
    assert plan.problems == [] and plan.gpu == "NCCL", plan.problems
    assert plan.env["HOROVOD_CUDA_HOME"] == plan.env["CUDA_HOME"] == str(home.resolve())


def test_plan_takes_usr_local_cuda_and_cuda_home_elsewhere(cuda_server, monkeypatch):
    default = _toolkit(cuda_server / "usr-local-cuda")
    monkeypatch.setattr(build_horovod, "DEFAULT_CUDA_HOME", default)
    plan = build_horovod.make_plan()  # no nvcc on PATH, nothing set: torch's default place
    assert plan.problems == [] and plan.env["HOROVOD_CUDA_HOME"] == str(default), plan.problems
    elsewhere = _toolkit(cuda_server / "opt" / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(elsewhere))
    plan = build_horovod.make_plan()
    assert plan.problems == [] and plan.env["HOROVOD_CUDA_HOME"] == str(elsewhere), plan.problems


@pytest.mark.parametrize("missing", ["lib64/libcudart.so", "include/cuda_runtime.h", "include/cccl/nv/target",
                                     "lib64/libcudadevrt.a", "nvvm/bin/cicc", "bin/nvcc"])
def test_plan_names_the_missing_toolkit_file_and_the_fix(cuda_server, monkeypatch, missing):
    home = _toolkit(cuda_server / "cuda", leave_out=missing)
    monkeypatch.setenv("CUDA_HOME", str(home))
    problems = build_horovod.make_plan().problems
    assert len(problems) == 1 and str(home / missing) in problems[0], problems
    assert "point CUDA_HOME at a complete CUDA 13 toolkit" in problems[0] and "--cpu-only" in problems[0], problems


def test_plan_refuses_a_toolkit_of_another_cuda_than_torchs(cuda_server, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(_toolkit(cuda_server / "cuda-12.4", version=12040)))
    [problem] = build_horovod.make_plan().problems
    assert "is CUDA 12.4, but torch is a CUDA 13.0 build" in problem, problem


def test_the_command_stops_before_building_when_a_tool_is_missing(fake_env, capsys):
    fake_env(tools=("g++", "make", "patch"))
    rc = build_horovod.run(type("Args", (), {"print_plan": False, "without_mpi": False, "cpu_only": False,
                                             "no_install": False})())
    out = capsys.readouterr()
    assert rc == 2 and "pip install cmake" in out.out and "cannot build" in out.err


# --- as a user without root: `make test-install` ---------------------------------------------------------

USER = "hvdp-install-test"
install = pytest.mark.skipif(os.environ.get("HVDP_TEST_INSTALL") != "1" or os.geteuid() != 0
                             or shutil.which("useradd") is None,
                             reason="make test-install (HVDP_TEST_INSTALL=1, as root: it creates a throwaway user)")


def _system_python() -> str:
    """A Python 3 a user without root can run: /usr/bin/python3, else this one if others may read it."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if os.access(candidate, os.X_OK) and not str(Path(candidate).resolve()).startswith("/root/"):
            return candidate
    pytest.skip("no python3 outside /root for an unprivileged user (pyenv's live under /root)")


@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory):
    home = Path(f"/home/{USER}")
    subprocess.run(["userdel", "-r", USER], capture_output=True)
    subprocess.run(["useradd", "-m", "-d", str(home), "-s", "/bin/bash", USER], check=True)
    try:
        _copy_for_build(home / "hvdp")
        subprocess.run(["chown", "-R", f"{USER}:", str(home)], check=True)

        def as_user(cmd: str, timeout=600, path=None):
            env = {"HOME": str(home), "PATH": path or "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
            return subprocess.run(["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                                   "bash", "-c", cmd], capture_output=True, text=True, cwd=home, timeout=timeout)
        proc = as_user(f"{_system_python()} -m venv venv && venv/bin/pip install -q ./hvdp")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield as_user
    finally:
        subprocess.run(["userdel", "-r", USER], capture_output=True)


@install
def test_unprivileged_install_imports_and_carries_the_recipe(unprivileged):
    proc = unprivileged("id -u && venv/bin/python -c 'import hvdp, sys; from hvdp.tools import resources; "
                        "print(hvdp.__file__); print(resources.root())'")
    uid, where, recipe = proc.stdout.split()
    assert proc.returncode == 0 and uid != "0", proc.stderr
    assert "/venv/lib/" in where and recipe.endswith("site-packages/hvdp/_build")
    proc = unprivileged("venv/bin/pip freeze")
    assert not any(line.lower().startswith(("torch", "tensorflow", "horovod")) for line in proc.stdout.split())
    for rel in SHIPPED:
        assert Path(recipe, rel).read_bytes() == (ROOT / rel).read_bytes(), rel


@install
def test_unprivileged_doctor_says_what_is_missing(unprivileged):
    proc = unprivileged("venv/bin/hvdp doctor")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "run `hvdp build-horovod`" in out and "pip install torch" in out and "make setup" not in out, out


@install
def test_unprivileged_build_horovod_without_a_framework_is_a_clear_error(unprivileged):
    proc = unprivileged("venv/bin/hvdp build-horovod")
    assert proc.returncode == 2 and "neither torch nor tensorflow" in proc.stdout and "Traceback" not in proc.stderr


@install
def test_unprivileged_build_horovod_without_cmake_is_a_clear_error(unprivileged, tmp_path):
    # A PATH with the compiler and the tools but no cmake: a directory of links the user may read.
    tools = Path(f"/home/{USER}/tools")
    tools.mkdir(exist_ok=True)
    for tool in ("g++", "make", "patch", "bash", "env", "sh"):
        if shutil.which(tool) and not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    proc = unprivileged("venv/bin/hvdp build-horovod --print-plan", path=str(tools))
    assert proc.returncode == 2 and "no cmake" in proc.stdout and "-m pip install cmake" in proc.stdout, proc.stdout


# The whole path on a newer Python, as a cluster user would take it: a fresh venv from that Python, hvdp with the
# torch pip gives there (on PyPI a CUDA build of several GB; it runs on the CPU), Horovod built for it (Gloo
# only, no GPU operations), and the main job at np=2. The pip cache and the Horovod wheel live outside the
# user's HOME (which userdel -r removes), so a rerun downloads and builds nothing.
CACHE = Path(os.environ.get("HVDP_TEST_INSTALL_CACHE", "/var/tmp/hvdp-install-test-cache"))


def _python_for_users(version: str) -> str | None:
    """A Python `version` that a user without root can run: $HVDP_TEST_PYTHON_3_12 (for 3.12), else
    /opt/python-3.12*/bin/python3.12 (where a site's module, or a copy of pyenv's, would put it), else
    python3.12 on PATH; none under /root (pyenv's versions there are not readable by others)."""
    given = os.environ.get(f"HVDP_TEST_PYTHON_{version.replace('.', '_')}")
    candidates = [given] if given else [*sorted(glob.glob(f"/opt/python-{version}*/bin/python{version}")),
                                        shutil.which(f"python{version}")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and not str(Path(candidate).resolve()).startswith("/root/"):
            return candidate
    return None


@install
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_unprivileged_build_and_main_job_on_python(unprivileged, version, framework):
    python = _python_for_users(version)
    if python is None:
        pytest.skip(f"no Python {version} a user without root can run: set HVDP_TEST_PYTHON_{version.replace('.', '_')}"
                    f" or put one in /opt/python-{version}.x (pyenv's under /root are not readable by others)")
    probe = unprivileged(f"{python} -c 'import sys; print(sys.version)'")
    if probe.returncode != 0:
        pytest.skip(f"{python} does not run as {USER}: {probe.stderr.strip()[-300:]}")
    home = Path(f"/home/{USER}")
    shutil.copytree(ROOT / "examples", home / "examples", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(["chown", "-R", f"{USER}:", str(CACHE), str(home / "examples")], check=True)
    venv = f"venv-{version}-{framework}"
    example = {"torch": "train_torch.py", "tensorflow": "train_keras.py"}[framework]
    env = f"export HVDP_CACHE_DIR={CACHE}/hvdp PIP_CACHE_DIR={CACHE}/pip PATH=$HOME/{venv}/bin:$PATH; "
    steps = {  # the commands docs/install.md gives, in order
        "pip install": f"{python} -m venv {venv} && pip install -q './hvdp[{framework}]' scikit-learn wheel "
                       f"'setuptools<82'",
        "build": "hvdp build-horovod --without-mpi --cpu-only",
        "job": f"horovodrun --gloo -np 2 -H localhost:2 python examples/{example}",
        # the installed copy's own tools (issue 31 item 4): verify, and the bench's training comparison
        # (its all-reduce section needs MPI and mpi4py, its input pipeline nothing this test adds)
        "verify": f"hvdp verify --framework {'torch' if framework == 'torch' else 'keras'} --np 2 --gloo",
        "bench": f"hvdp bench --quick --steps 2 --models cnn --frameworks {framework} --skip-gpt --skip-allreduce "
                 f"--skip-pipeline --json bench-{version}-{framework}.json",
    }
    took, out = {}, {}
    for step, cmd in steps.items():
        start = time.monotonic()
        proc = unprivileged(env + cmd, timeout=3600)
        took[step], out[step] = round(time.monotonic() - start), proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{step} on Python {version}: {cmd}\n{out[step][-4000:]}"
    assert "with Gloo only" in out["build"] and "installed in" in out["build"], out["build"]
    assert "PASS" in out["verify"], out["verify"][-3000:]
    bench = json.loads((home / f"bench-{version}-{framework}.json").read_text())
    assert bench["training"]["framework"] == framework, bench["training"]
    rates = bench["training"]["models"]["cnn"]["samples_per_sec_per_rank"]
    assert len(rates) >= 3 and all(v > 0 for v in rates.values()), rates
    result = result_line(out["job"])  # check_consistency() in the example raised had the replicas diverged
    print(f"Python {version}, {framework}: {took} s; test accuracy {result['test_accuracy']}")
    assert result["world_size"] == 2 and result["test_accuracy"] >= 0.97, result


# A GPU server's three toolkit layouts (issue 46), each built for real as a user without root would: a fresh
# Python 3.11 venv, `pip install './hvdp[torch,build]'` (PyPI's torch, a CUDA 13.0 build, and its
# nvidia-nccl-cu13), `hvdp build-horovod` with no flags (the NCCL variant), `hvdp doctor`, and a Gloo all-reduce
# of CPU tensors at np=2 through the wheel. Each layout gets its own wheel cache, so each one really builds
# (about 10 minutes each on 2 cores); pip's downloads are cached in CACHE for a rerun.
GPU_LAYOUTS = {  # layout: (what the user runs before the build, where the plan must find the toolkit)
    "usr-local-cuda": ("", "/usr/local/cuda-13.0 (the toolkit of /usr/local/bin/nvcc)"),
    "pip-toolkit": ("pip install -q 'cuda-toolkit[nvcc,crt,nvvm,cccl]==13.0.*' && ",
                    "site-packages/nvidia/cu13 (pip's nvidia-cuda-nvcc in this env)"),
    "cuda-home": ("cp -r /usr/local/cuda-13.0 $HOME/toolkits-cuda-13.0 && "
                  "export CUDA_HOME=$HOME/toolkits-cuda-13.0 && ", "toolkits-cuda-13.0 ($CUDA_HOME)"),
}


@install
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_unprivileged_gpu_server_build_with_no_flags_builds_nccl(unprivileged, layout):
    if not Path("/usr/local/cuda-13.0/bin/nvcc").exists():
        pytest.skip("no CUDA 13.0 toolkit in /usr/local/cuda-13.0 (the GPU server layout this test builds on)")
    before, toolkit = GPU_LAYOUTS[layout]
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = CACHE / f"hvdp-gpu-{layout}"
    shutil.rmtree(wheels, ignore_errors=True)  # each layout's own build, every run: the point is the build
    subprocess.run(["chown", "-R", f"{USER}:", str(CACHE)], check=True)
    venv = f"venv-gpu-{layout}"
    env = (f"export HVDP_CACHE_DIR={wheels} PIP_CACHE_DIR={CACHE}/pip PATH=$HOME/{venv}/bin:/usr/local/bin:$PATH; "
           f"rm -rf $HOME/{venv} $HOME/toolkits-cuda-13.0; ")
    allreduce = ("import horovod.torch as hvd, torch; hvd.init(); "
                 "s = hvd.allreduce(torch.full((3,), hvd.rank() + 1.0), op=hvd.Sum); "
                 "print('allreduce', hvd.rank(), s.tolist(), 'nccl_built', bool(hvd.nccl_built()))")
    cmd = (f"{env}/usr/bin/python3.11 -m venv {venv} && pip install -q './hvdp[torch,build]' && {before}"
           f"hvdp build-horovod && hvdp doctor; "
           f"horovodrun --gloo -np 2 -H localhost:2 python -c \"{allreduce}\"")
    start = time.monotonic()
    proc = unprivileged(cmd, timeout=7000)
    out = proc.stdout + proc.stderr
    print(f"{layout}: {time.monotonic() - start:.0f} s in all;",
          *[line for line in out.splitlines() if line.startswith("hvdp build-horovod: wheel")])
    assert "NCCL GPU operations: torch is a CUDA 13" in out and toolkit in out, out[-6000:]
    assert "installed in" in out, out[-6000:]
    assert "Horovod's GPU operations: NCCL" in out, out[-6000:]
    sums = [line for line in out.splitlines() if "allreduce" in line and "nccl_built True" in line]
    assert len(sums) == 2 and all("[3.0, 3.0, 3.0]" in line for line in sums), out[-3000:]
    assert proc.returncode == 0, out[-3000:]
