#!/usr/bin/env bash
# `make setup-cuda`: a CUDA 13 + NCCL Horovod for PyTorch in .venv-cuda, compiled from pip packages alone
# (the CUDA toolkit, NCCL and torch's CUDA build are all wheels; compiling needs no GPU). No MPI: Gloo is
# the controller, so `horovodrun --gloo` launches it. No TensorFlow. The wheel is cached outside the repo
# by scripts/build_horovod.sh, under the same key scheme as `make setup`'s, and is what a GPU machine takes.
# Idempotent like scripts/setup.sh: a rerun with nothing to do takes seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
here="$root/scripts"
VENV="${VENV:-$root/.venv-cuda}"
say() { printf '\033[1m[setup-cuda]\033[0m %s\n' "$*"; }
die() { printf '[setup-cuda] error: %s\n' "$*" >&2; exit 1; }
source "$here/packages.sh"

source "$here/cuda_stack.sh"  # the pins (CUDA_TORCH, CUDA_TOOLKIT, CUDA_NCCL, ...) and cuda_layout

# 1. Python: 3.12 from pyenv unless $PYTHON names one (torch 2.11.0's CUDA wheels exist for 3.10-3.13).
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
else
    PY="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3 2>/dev/null | sort -V | tail -1)"
    [[ -n "$PY" ]] || PY="$(command -v python3.12 || true)"
    [[ -n "$PY" ]] || die "no Python 3.12 found (pyenv install 3.12, or set PYTHON=/path/to/python3.12)"
fi
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$pyver" in
    3.10|3.11|3.12|3.13) ;;
    *) die "python $pyver: torch $CUDA_TORCH's CUDA wheels need 3.10-3.13; set PYTHON=/path/to/python3.12" ;;
esac

# 2. System packages: only a C++ toolchain (no MPI). nvcc, its headers and NCCL come from pip.
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v patch >/dev/null || missing+=(patch)  # build_horovod.sh applies csrc/horovod/patches/*.patch
apt_install setup-cuda "${missing[@]}"

# 3. The virtual environment and the CUDA stack. A .gitignore inside keeps it out of `git status` (Python
#    >= 3.13's venv writes the same file).
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV (python $pyver)"
    "$PY" -m venv "$VENV"
fi
[[ -e "$VENV/.gitignore" ]] || echo '*' > "$VENV/.gitignore"
VPY="$VENV/bin/python"
have="$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$have" == "$pyver" ]] || die "$VENV has python $have, not $pyver: remove it (rm -rf $VENV) and rerun make setup-cuda"
stamp="$VENV/.hvdp-stamp"
want="$(find "$root/constraints.txt" "$root/setup.cfg" "$here/setup_cuda.sh" "$here/cuda_stack.sh" -type f | LC_ALL=C sort | xargs cat \
        | sha256sum | cut -c1-16)"
cons="$VENV/constraints-cuda.txt"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    cuda_constraints "$root/constraints.txt" > "$cons"
    say "installing torch $CUDA_TORCH (CUDA), cuda-toolkit $CUDA_TOOLKIT (nvcc, crt, nvvm, cccl), nvidia-nccl-cu13 $CUDA_NCCL"
    "$VPY" -m pip install -q --upgrade pip wheel "$CUDA_SETUPTOOLS"
    mapfile -t cuda_reqs < <(cuda_packages)
    "$VPY" -m pip install -q -c "$cons" "${cuda_reqs[@]}" numpy cloudpickle psutil pyyaml packaging
    rm -f "$stamp.horovod"
fi
cuda="$("$VPY" -c 'import torch; print(torch.version.cuda or "")')"
[[ "$cuda" == 13.0* ]] || die "torch in $VENV is not the CUDA 13.0 build (torch.version.cuda='$cuda'): rm -rf $VENV and rerun"

# 4. The wheels' layout, made to look like a CUDA install to nvcc and CMake (scripts/cuda_stack.sh).
cuda_layout "$VPY" || die "rm -rf $VENV and rerun make setup-cuda"

# 5. Horovod with NCCL, Gloo and PyTorch, built by the same recipe as `make setup`'s (its source fixes,
#    its cache). build_horovod.sh asks for MPI and TensorFlow; Horovod's HOROVOD_WITHOUT_* win over its
#    HOROVOD_WITH_*. The cache key holds torch, python, tf-none and `nccl`; only this script builds that key.
wheel="$(env PYTHON="$VPY" PATH="$CUDA_HOME/bin:$VENV/bin:$PATH" \
             HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
             HOROVOD_CUDA_HOME="$CUDA_HOME" CUDA_HOME="$CUDA_HOME" HOROVOD_NCCL_HOME="$NCCL_HOME" \
             "$here/build_horovod.sh" | tail -1)"
if [[ "$(cat "$stamp.horovod" 2>/dev/null)" != "$wheel" ]] || ! "$VPY" -c "import horovod" 2>/dev/null; then
    say "installing $wheel"
    "$VPY" -m pip install -q --no-deps --force-reinstall "$wheel"
    echo "$wheel" > "$stamp.horovod"
    fresh=1
fi

# 6. hvdp itself, editable, with its test tools.
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    "$VPY" -m pip install -q -c "$cons" -e "$root[dev]"
    echo "$want" > "$stamp"
fi

# 7. The proof: PyTorch, Gloo and NCCL in, MPI out (a wheel with MPI under this key was not built here).
check="$("$VPY" -m hvdp.tools.doctor 2>/dev/null || true)"
for what in PyTorch Gloo NCCL; do
    grep -q "\[X\] $what" <<<"$check" || { echo "$check"; die "horovod was not built with $what: delete $(dirname "$wheel") and rerun make setup-cuda"; }
done
grep -q "\[ \] MPI" <<<"$check" || { echo "$check"; die "this Horovod has MPI: $wheel is not this script's build; delete $(dirname "$wheel") and rerun"; }
if [[ -n "${fresh:-}" ]]; then  # Horovod's own listing, once per install (it takes ~25 s)
    "$VENV/bin/horovodrun" --check-build
fi
size="$(du -h "$wheel" | cut -f1)"
say "ready: horovod $(sed -n 's/^horovod==//p' "$root/constraints.txt") with PyTorch, Gloo and NCCL (no MPI) in $VENV"
say "the wheel to carry to a GPU machine ($size): $wheel"
