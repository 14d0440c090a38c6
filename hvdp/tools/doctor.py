"""`hvdp doctor`: versions, what Horovod was built with, the launcher it sees, and a verdict with fixes."""

from __future__ import annotations

import os
import json
import platform
import re
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from hvdp.core.world import World, detect_launcher, gloo_hostname_problem
from hvdp.tools import resources

PACKAGES = ("torch", "tensorflow-cpu", "tensorflow", "keras", "horovod", "mpi4py", "numpy")
LAUNCH_VARS = re.compile(r"^(HOROVOD_|OMPI_COMM_WORLD_|PMI_|SLURM_(PROCID|NTASKS|LOCALID|JOB_ID|NODELIST))")


def add_arguments(parser) -> None:
    parser.add_argument("--no-build-check", action="store_true",
                        help="skip the build check (it imports Horovod's torch and tensorflow modules: a few seconds)")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fix(installed: str, checkout: str = "`make setup`") -> str:
    """The fix to print: an installed hvdp's (pip, `hvdp build-horovod`) or a checkout's (`make setup`)."""
    return "run " + (checkout if not resources.packaged() else installed)


def _pins() -> dict[str, str]:
    """The tested pins from constraints.txt (shipped in the package, or a checkout's)."""
    path = resources.path("constraints.txt")
    if not path.is_file():
        return {}
    return dict(line.split("==", 1) for line in path.read_text().split() if "==" in line)


def _built_by_hvdp() -> bool:
    """Whether the installed Horovod is a wheel from hvdp's build (scripts/build_horovod.sh) with its fixes."""
    try:
        origin = metadata.distribution("horovod").read_text("direct_url.json") or ""
    except metadata.PackageNotFoundError:
        return False
    return "/hvdp/wheels/" in origin or "/wheels/horovod-" in origin


def _torch_lib_has(marker: bytes) -> bool | None:
    """Whether Horovod's PyTorch library contains `marker`; None when the library is not found. Read from
    the library's bytes: nothing is imported."""
    import importlib.util
    spec = importlib.util.find_spec("horovod")
    libs = [p for d in (spec.submodule_search_locations or []) for p in Path(d).glob("torch/mpi_lib_v2*.so")] \
        if spec else []
    if not libs:
        return None
    return marker in libs[0].read_bytes()


def has_shm_allreduce() -> bool | None:
    """Whether the installed Horovod carries hvdp's shared-memory allreduce (csrc/horovod/shm_operations.cc)."""
    return _torch_lib_has(b"hvdp shared-memory allreduce")


def has_bfloat16() -> bool | None:
    """Whether the installed Horovod's torch bindings take bfloat16 tensors (csrc/horovod/patches/bfloat16.patch)."""
    return _torch_lib_has(b"horovod_torch_allreduce_async_torch_BFloat16Tensor")


def _mpi_version() -> str | None:
    if not shutil.which("mpirun"):
        return None
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "unknown"


# One probe per framework, each in its own process (a framework that fails to import, or crashes, takes only
# its own answer with it); both run at once. `horovodrun --check-build` starts a process per question: 25 s.
_PROBE = """
import json, sys
ext = __import__("horovod." + sys.argv[1], fromlist=["mpi_built"])
out = {k: bool(getattr(ext, k + "_built")()) for k in ("mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm")}
if sys.argv[1] == "torch":
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if n and hasattr(torch.cuda, "nccl") else None
    out["gpu"] = {"framework": "torch " + torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
                  "gpus": [torch.cuda.get_device_name(i) for i in range(n)]}
else:
    import tensorflow as tf
    out["gpu"] = {"framework": "tensorflow " + tf.__version__,
                  "cuda": tf.sysconfig.get_build_info().get("cuda_version"), "nccl": None,
                  "gpus": [d.name for d in tf.config.list_physical_devices("GPU")]}
print(json.dumps(out))
"""


def check_build() -> dict[str, bool] | None:
    """What the installed Horovod was built with, as `horovodrun --check-build` lists it: {"TensorFlow": True,
    "PyTorch": True, "MXNet": False, "MPI": True, "Gloo": True, "NCCL": False, ...}; None without Horovod."""
    return _probe_build()[0]


def _probe_build() -> tuple[dict[str, bool] | None, dict[str, dict]]:
    """(check_build()'s answer, {framework: what its probe saw of GPUs}), from one probe per framework."""
    gpus: dict[str, dict] = {}
    if _version("horovod") is None:
        return None, gpus
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    probes = {name: subprocess.Popen([sys.executable, "-c", _PROBE, module], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
              for name, module in (("TensorFlow", "tensorflow"), ("PyTorch", "torch"))}
    ops: dict[str, bool] = {}
    built = {}
    for name, proc in probes.items():
        try:
            out, _ = proc.communicate(timeout=120)
            answer = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            proc.kill()
            answer = None
        built[name] = answer is not None
        if answer is not None:
            gpus[name] = {**answer.pop("gpu"), "horovod_cuda": answer.pop("cuda"), "horovod_rocm": answer.pop("rocm")}
        for k, v in (answer or {}).items():
            ops[k] = ops.get(k, False) or v
    built["MXNet"] = False  # hvdp builds no MXNet support
    return {**built, **{label: ops.get(k, False) for k, label in
                        (("mpi", "MPI"), ("gloo", "Gloo"), ("nccl", "NCCL"), ("ddl", "DDL"), ("ccl", "CCL"))}}, gpus


def run(args) -> int:
    problems: list[str] = []
    print("hvdp doctor\n")
    print(f"  python       {platform.python_version()} ({sys.executable})")
    pins = _pins()
    for dist in PACKAGES:
        have = _version(dist)
        if have is None and dist in ("tensorflow", "tensorflow-cpu"):
            continue
        pin = pins.get(dist)
        note = "" if pin is None or have is None or have.split("+")[0] == pin else f"   (tested: {pin})"
        print(f"  {dist:<12} {have or 'not installed'}{note}")
    if _version("horovod") is None:
        problems.append("horovod is not installed: " + _fix("`hvdp build-horovod` (it builds Horovod for this env's "
                                                            "frameworks and installs it; docs/install.md)"))
    no_tf = _version("tensorflow-cpu") is None and _version("tensorflow") is None
    no_torch = _version("torch") is None
    # A checkout's suite needs both frameworks; an installed hvdp (the user's own env) needs one of them.
    own_env = resources.packaged()
    if no_tf and not (own_env and not no_torch):
        problems.append("tensorflow is not installed (needed by hvdp.tensorflow / hvdp.keras): "
                        + _fix("pip install 'hvdp[tensorflow]', then `hvdp build-horovod`"))
    if no_torch and not (own_env and not no_tf):
        problems.append("torch is not installed (needed by hvdp.torch): " + _fix(
            "pip install torch (CPU only: --index-url https://download.pytorch.org/whl/cpu), "
            "then `hvdp build-horovod`"))
    mpi = _mpi_version()
    print(f"  MPI          {mpi or 'mpirun not found'}")
    if mpi is None:
        problems.append("mpirun not found: install OpenMPI (Debian: apt-get install openmpi-bin libopenmpi-dev; a "
                        "cluster: module load openmpi; conda: conda install -c conda-forge openmpi); without it "
                        "launch with horovodrun --gloo")

    print("\nHorovod was built with:")
    built, gpus = (None, {}) if args.no_build_check or _version("horovod") is None else _probe_build()
    if built is None:
        print("  (not checked)")
    else:
        print("  " + "  ".join(f"[{'X' if v else ' '}] {k}" for k, v in built.items()))
        for need, fix in (("PyTorch", "horovod not built with PyTorch"), ("TensorFlow", "horovod not built with TensorFlow"),
                          ("MPI", "horovod not built with MPI"), ("Gloo", "horovod not built with Gloo")):
            # In an installed hvdp, Horovod is built for what the env has: a framework it lacks, or MPI where
            # there is no mpicxx (Gloo only), is the env's choice, not a problem.
            skip = own_env and ((need == "PyTorch" and no_torch) or (need == "TensorFlow" and no_tf)
                                 or (need == "MPI" and shutil.which("mpicxx") is None))
            if not built.get(need) and not skip:
                problems.append(f"{fix}: " + _fix(
                    "install it, then rerun `hvdp build-horovod`",
                    f"`make setup` (it rebuilds Horovod with HOROVOD_WITH_{need.upper()}=1)"))
    shm = has_shm_allreduce()
    if shm is not None:
        state = os.environ.get("HVDP_SHM_ALLREDUCE", "1 (hvdp's default)")
        print(f"  hvdp's shared-memory allreduce (one host, MPI): "
              + (f"built in; HVDP_SHM_ALLREDUCE={state}" if shm else
                 "not in this Horovod, MPI's allreduce is used (`make setup` builds it in)"))
    bf16 = has_bfloat16()
    if bf16 is not None:
        print("  bfloat16 tensors (torch): " + ("supported" if bf16 else
              "not in this Horovod: a bf16 model fails in prepare() (`make setup` builds the support in)"))

    problems += _print_gpus(built, gpus)

    launcher = detect_launcher()
    world = World.from_env()
    print(f"\nLauncher: {launcher}; rank {world.rank} of {world.size} "
          f"(local {world.local_rank} of {world.local_size})")
    seen = {k: v for k, v in sorted(os.environ.items()) if LAUNCH_VARS.match(k)}
    for k, v in seen.items():
        print(f"  {k}={v}")
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = None
    gloo = gloo_hostname_problem(os.environ, socket.gethostname(), address)
    if gloo and _built_by_hvdp():
        print(f"  note: {gloo}. This Horovod was built by hvdp (scripts/build_horovod.sh fix 3: Gloo keeps the "
              f"--network-interface for its collectives), so this stock-Horovod trap does not apply here.")
    elif gloo:
        problems.append(gloo)
    print("\nRunning on several hosts (same paths on every host, passwordless ssh between them):")
    print("  horovodrun -np 8 -H host1:4,host2:4 --network-interface eth1 python examples/train_torch.py")
    print("  horovodrun -np 8 --hostfile hosts.txt python examples/train_torch.py   (lines: 'host1 slots=4')")
    print("  mpirun -np 8 --hostfile hosts.txt -bind-to none -map-by slot -mca btl_tcp_if_include eth1 \\")
    print("         -x PATH -x PYTHONPATH python examples/train_torch.py")
    print("  sbatch examples/slurm.sbatch   or, inside an allocation: srun --mpi=pmix python examples/train_torch.py")

    print("\nVerdict:", "OK" if not problems else f"{len(problems)} problem(s)")
    for p in problems:
        print(f"  - {p}")
    return 1 if problems else 0


def _print_gpus(built: dict | None, gpus: dict[str, dict]) -> list[str]:
    """The GPUs each framework sees, its CUDA and NCCL, and Horovod's GPU operations; the problems found."""
    print("\nGPUs:")
    if not gpus:
        print("  (not checked)")
        return []
    problems = []
    for name, g in gpus.items():
        seen = ", ".join(f"{i}: {d}" for i, d in enumerate(g["gpus"])) or "none"
        cuda = f"CUDA {g['cuda']}" if g["cuda"] else "a CPU build"
        nccl = f", NCCL {g['nccl']}" if g["nccl"] else ""
        print(f"  {name:<10} {g['framework']} ({cuda}{nccl}); GPUs visible: {seen}")
    ops = "NCCL" if built and built.get("NCCL") else "none (CUDA tensors are staged through host memory)"
    gpu_build = any(g["horovod_cuda"] or g["horovod_rocm"] for g in gpus.values())
    print(f"  Horovod's GPU operations: {ops}; built with CUDA: {'yes' if gpu_build else 'no'}")
    if any(g["gpus"] for g in gpus.values()) and not (built and built.get("NCCL")):
        problems.append("GPUs are visible but this Horovod has no NCCL operations: GPU gradients would go through "
                        "host memory; build it with NCCL (`make setup-cuda`, docs/gpus.md)")
    return problems


if __name__ == "__main__":  # `python -m hvdp.tools.doctor`: the build check alone (scripts/setup.sh)
    print("  ".join(f"[{'X' if v else ' '}] {k}" for k, v in (check_build() or {}).items()))
