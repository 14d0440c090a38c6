#!/usr/bin/env bash
# The steps of the Dockerfile, as one script the Dockerfile runs stage by stage (and test_image.sh reads
# for the package list). It runs from the build context's layout: /src/docker/image.sh, /src/constraints.txt,
# /src/scripts/build_horovod.sh and /src/csrc/horovod/. Works on python:3.11-slim-bookworm, on a bare Debian bookworm and on Ubuntu
# (CUDA images): what the base lacks is installed with apt.
#
#   image.sh system build|runtime   apt packages: compilers and MPI headers for the build stage, MPI and
#                                   ssh for the runtime stage; python3 with venv and headers if missing
#   image.sh frameworks             /opt/hvdp/venv: the pinned frameworks, mpi4py, Horovod (via
#                                   build_horovod.sh); from /tmp/wheels first, else the index
#   image.sh hvdp                   hvdp itself (a separate layer: code changes skip the frameworks)
#   image.sh packages               the framework requirements, one a line (test_image.sh downloads them)
#   image.sh constraints            the pins they are installed under
#
# HVDP_DEVICE=cuda: PyTorch only (no TensorFlow: one Horovod links one CUDA runtime, and TensorFlow 2.21's
# GPU build wants CUDA 12 where torch 2.11 has 13), torch 2.11.0's CUDA 13.0 build, the CUDA toolkit and
# NCCL as pip wheels (scripts/cuda_stack.sh, the same pins as `make setup-cuda`), and Horovod with NCCL,
# MPI and Gloo. Any Debian or Ubuntu base works: nothing comes from NVIDIA's apt repository or registry.
#
# Environment (the Dockerfile's build args): HVDP_DEVICE cpu|cuda, TORCH_INDEX_URL (auto: the PyTorch CPU
# index for cpu, PyPI for cuda; only asked for the frameworks), PIP_CERT (a CA bundle visible during the build).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(dirname "$here")"
DEVICE="${HVDP_DEVICE:-cpu}"
VENV=/opt/hvdp/venv
WHEELS=/tmp/wheels
say() { printf '[image] %s\n' "$*"; }
pin() { sed -n "s/^$1==//p" "$src/constraints.txt"; }
case "$DEVICE" in cpu|cuda) ;; *) echo "HVDP_DEVICE=$DEVICE: use cpu or cuda" >&2; exit 2 ;; esac

# The CUDA pins and cuda_layout, read when needed (the `system` steps run before the file is in the context).
cuda_stack() { source "$src/scripts/cuda_stack.sh"; }

packages() {
    # torch pinned exactly: a bare `torch` is a multi-GB CUDA build on PyPI.
    if [[ $DEVICE == cuda ]]; then
        cuda_stack && cuda_packages
    else
        printf '%s\n' "tensorflow-cpu==$(pin tensorflow-cpu)" "torch==$(pin torch)" "keras==$(pin keras)"
    fi
    printf '%s\n' "scikit-learn==$(pin scikit-learn)" \
        "tensorboard==$(pin tensorboard)" "tqdm==$(pin tqdm)" cffi cloudpickle psutil pyyaml packaging numpy \
        setuptools wheel build "cython>=3.0.1"  # the last four build mpi4py and hvdp without the index
}

constraints() {
    if [[ $DEVICE == cuda ]]; then
        cuda_stack && cuda_constraints "$src/constraints.txt"
    else
        cat "$src/constraints.txt"
    fi
}

python_ok() {  # a python3 >= 3.10 with venv, ensurepip and its C headers (Horovod and mpi4py compile)
    command -v python3 >/dev/null && python3 - <<'PY' 2>/dev/null
import ensurepip, os, sys, sysconfig, venv
sys.exit(not (sys.version_info >= (3, 10) and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))))
PY
}

system() {
    local want=(openmpi-bin openssh-client ca-certificates)
    # python:3.11-slim has its own python3 in /usr/local; a bare Debian or Ubuntu base gets the distro's,
    # in both stages, so the venv copied from the build stage finds the same interpreter.
    if [[ $1 == build ]]; then
        want+=(libopenmpi-dev g++ make cmake patch)
        python_ok || want+=(python3 python3-venv python3-dev)
    else
        command -v python3 >/dev/null || want+=(python3)
    fi
    say "apt-get install ${want[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
    rm -rf /var/lib/apt/lists/*
}

pip_install() {  # the context's wheels alone when they suffice, else the index too (TORCH_INDEX=1: and torch's)
    local vpy="$VENV/bin/python"
    if compgen -G "$WHEELS/*.whl" >/dev/null \
       && "$vpy" -m pip install -q --no-index --find-links "$WHEELS" "$@" 2>/dev/null; then
        return
    fi
    say "not everything is in docker/wheels; using the package index"
    local index=()
    local url="${TORCH_INDEX_URL:-auto}"
    [[ ${TORCH_INDEX:-0} == 1 ]] || url=
    [[ $url == auto ]] && { [[ $DEVICE == cpu ]] && url=https://download.pytorch.org/whl/cpu || url=; }
    [[ -n $url ]] && index=(--extra-index-url "$url")
    "$vpy" -m pip install -q --find-links "$WHEELS" "${index[@]}" "$@"
}

python_stack() {
    [[ -n "${PIP_CERT:-}" ]] || unset PIP_CERT
    python3 -m venv "$VENV"
    mapfile -t reqs < <(packages)
    say "installing ${reqs[*]}"
    constraints > /tmp/constraints.txt
    TORCH_INDEX=1 pip_install -c /tmp/constraints.txt "${reqs[@]}"
    # mpi4py built against the image's OpenMPI (its wheels carry their own MPI).
    pip_install --no-binary mpi4py "mpi4py==$(pin mpi4py)"
    # Horovod: build_horovod.sh finds a wheel under $HVDP_CACHE_DIR/wheels/<key> when the context
    # brought one whose key (horovod, torch, tensorflow, python, arch, gpu ops) matches; else it compiles.
    mkdir -p /tmp/hvdp-cache
    [[ -d $WHEELS/horovod ]] && ln -sfn "$WHEELS/horovod" /tmp/hvdp-cache/wheels
    local gpu=()
    if [[ $DEVICE == cuda ]]; then
        cuda_stack && cuda_layout "$VENV/bin/python"
        gpu=(HOROVOD_GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-NCCL}" HOROVOD_WITHOUT_TENSORFLOW=1
             HOROVOD_CUDA_HOME="$CUDA_HOME" HOROVOD_NCCL_HOME="$NCCL_HOME" PATH="$CUDA_HOME/bin:$VENV/bin:$PATH")
    fi
    wheel="$(env "${gpu[@]}" HVDP_CACHE_DIR=/tmp/hvdp-cache PYTHON="$VENV/bin/python" "$src/scripts/build_horovod.sh" | tail -1)"
    say "installing $wheel"
    "$VENV/bin/python" -m pip install -q --no-deps "$wheel"
}

hvdp() {
    [[ -n "${PIP_CERT:-}" ]] || unset PIP_CERT
    pip_install "$src"
    "$VENV/bin/python" -m pip check
    find "$VENV" -name __pycache__ -prune -exec rm -rf {} +
    rm -rf /root/.cache/pip
}

case "${1:-}" in
    system) system "${2:?build or runtime}" ;;
    frameworks) python_stack ;;
    hvdp) hvdp ;;
    packages) packages ;;
    constraints) constraints ;;
    *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
