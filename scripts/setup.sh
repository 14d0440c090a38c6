#!/usr/bin/env bash
# `make setup`: from a fresh clone to a working Horovod with PyTorch and TensorFlow in .venv.
# Idempotent: every step checks before it acts, and a rerun with nothing to do takes seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
here="$root/scripts"
VENV="${VENV:-$root/.venv}"
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
source "$here/packages.sh"

# 1. Python: the pins are tested on CPython 3.11 (tensorflow 2.21 and torch 2.13 wheels exist for 3.10-3.13).
PY="${PYTHON:-python3}"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$pyver" in
    3.10|3.11|3.12|3.13) ;;
    *) die "python $pyver is not supported by the pinned stack in constraints.txt (needs 3.10-3.13); set PYTHON=/path/to/python3.11" ;;
esac

# 2. System packages: OpenMPI (mpirun + headers for Horovod and mpi4py), a C++ toolchain, Java for Spark.
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v patch >/dev/null || missing+=(patch)  # build_horovod.sh applies csrc/horovod/patches/*.patch
command -v ssh >/dev/null || missing+=(openssh-client)
# The multihost tests run a real sshd per network-namespace host (tests/multihost).
[[ -x /usr/sbin/sshd ]] || command -v sshd >/dev/null || missing+=(openssh-server)
command -v ip >/dev/null || missing+=(iproute2)
# The Slurm tests start a real cluster here (tests/slurm): munged, slurmctld and two slurmd (Debian 12: 22.05,
# with the PMIx plugin srun --mpi=pmix uses); they run no service of the machine's own.
for pair in munged:munge slurmctld:slurmctld slurmd:slurmd; do
    [[ -x /usr/sbin/${pair%:*} ]] || command -v "${pair%:*}" >/dev/null || missing+=("${pair#*:}")
done
command -v sbatch >/dev/null || missing+=(slurm-client)
# Spark 4 (hvdp.spark, tests/clusters) runs on Java 17 or newer: the JAVA_HOME one, else java on PATH.
java_major="$("${JAVA_HOME:+$JAVA_HOME/bin/}java" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1 || true)"
[[ "${java_major:-0}" -ge 17 ]] || missing+=(openjdk-17-jre-headless)
apt_install setup "${missing[@]}"

# 3. The virtual environment and the pinned Python stack. The stamp records what was installed, so a
#    rerun with unchanged pins and setup.cfg skips pip entirely.
[[ -x "$VENV/bin/python" ]] || { say "creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
pin() { sed -n "s/^$1==//p" "$root/constraints.txt"; }
stamp="$VENV/.hvdp-stamp"
want="$(find "$root/constraints.txt" "$root/setup.cfg" "$here/setup.sh" "$here/build_horovod.sh" "$root/csrc/horovod" -type f \
        | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    say "installing the pinned stack (torch $(pin torch), tensorflow-cpu $(pin tensorflow-cpu), keras $(pin keras), pyspark $(pin pyspark), ray $(pin ray))"
    "$VPY" -m pip install -q --upgrade pip setuptools wheel
    # torch pinned exactly: a bare `torch` would pull a multi-GB CUDA build. pyspark and ray are the plain
    # packages hvdp.spark and hvdp.ray need (not Horovod's [spark]/[ray] extras, which pin pyarrow<11).
    "$VPY" -m pip install -q -c "$root/constraints.txt" \
        "torch==$(pin torch)" "tensorflow-cpu==$(pin tensorflow-cpu)" "keras==$(pin keras)" \
        "pyspark==$(pin pyspark)" "ray==$(pin ray)" cloudpickle psutil pyyaml packaging
    # mpi4py built against the system OpenMPI (its wheels carry their own MPI).
    "$VPY" -m pip install -q --no-binary mpi4py "mpi4py==$(pin mpi4py)"
    rm -f "$stamp.horovod"
fi

# 4. Horovod, built once per (horovod, torch, tensorflow, python) and cached outside the repo.
if ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$(pin horovod)')" 2>/dev/null \
   || [[ ! -e "$stamp.horovod" ]]; then
    wheel="$(PYTHON="$VPY" "$here/build_horovod.sh" | tail -1)"
    say "installing $wheel"
    "$VPY" -m pip install -q --no-deps --force-reinstall "$wheel"
    touch "$stamp.horovod"
fi

# 5. hvdp itself, editable, with its test tools.
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    "$VPY" -m pip install -q -c "$root/constraints.txt" -e "$root[dev]"
    echo "$want" > "$stamp"
fi

# 6. The proof: Horovod must report both frameworks and both controllers.
check="$("$VPY" -m hvdp.tools.doctor 2>/dev/null)"  # what `horovodrun --check-build` lists, in seconds
for what in TensorFlow PyTorch MPI Gloo; do
    grep -q "\[X\] $what" <<<"$check" || { echo "$check"; die "horovod was not built with $what; delete the cached wheel (${HVDP_CACHE_DIR:-~/.cache/hvdp}/wheels) and rerun make setup"; }
done
say "ready: horovod $(pin horovod) with TensorFlow, PyTorch, MPI and Gloo in $VENV"
