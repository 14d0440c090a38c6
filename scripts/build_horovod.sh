#!/usr/bin/env bash
# Build Horovod from its PyPI sdist against the frameworks installed in $PYTHON's environment, with the
# source fixes today's frameworks need, and cache the wheel outside the repo. Used by `make setup`
# (scripts/setup.sh) and by the Dockerfile (docker/image.sh): one build recipe for both. Its inputs: the pins
# in constraints.txt, this script, and the C++ sources and patches in csrc/horovod/.
#
#   PYTHON=$PWD/.venv/bin/python scripts/build_horovod.sh     -> prints the path of the cached wheel
#
# Environment: HVDP_CACHE_DIR (default ~/.cache/hvdp), HOROVOD_GPU_OPERATIONS (e.g. NCCL for the CUDA image;
# it becomes part of the cache key), MAKEFLAGS (default -j$(nproc)), HOROVOD_WITHOUT_{MPI,TENSORFLOW,PYTORCH}=1
# to leave one out (they win over the HOROVOD_WITH_* set below). `hvdp build-horovod` (hvdp/tools/
# build_horovod.py) runs this same script from the installed package, after choosing those for the env.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
csrc="$root/csrc/horovod"
PYTHON="${PYTHON:-python3}"
pin() { sed -n "s/^$1==//p" "$root/constraints.txt"; }
HOROVOD_VERSION="$(pin horovod)"

# The source changes, applied to an unpacked Horovod tree ($1). `build_horovod.sh --patch DIR` applies them
# alone, to work on them.
apply_fixes() {
    # Fix 1: PyTorch >= 2.1 headers need C++17; Horovod 0.28.1 compiles its core and torch op as C++14.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$1/CMakeLists.txt" "$1/horovod/torch/CMakeLists.txt"
    # Fix 2: xla_mpi_ops.cc (a GPU-only XLA custom call) includes tensorflow/compiler/xla headers that
    # TensorFlow >= 2.16 no longer ships; without HOROVOD_ENABLE_XLA_OPS it is never used, so leave it out.
    sed -i '/xla_mpi_ops.cc/d' "$1/horovod/tensorflow/CMakeLists.txt"
    # Fix 3: Gloo ignores --network-interface (HOROVOD_GLOO_IFACE) for the contexts the collectives use:
    # GlooContext::InitializeForProcessSet reads its own never-set gloo_iface_, so Gloo falls back to the
    # address the hostname resolves to (127.0.x.x on Debian's default /etc/hosts) and ranks on other hosts
    # cannot connect. Copy the interface from the global context, as timeout_ and hostname_ already are.
    sed -i '/void GlooContext::InitializeForProcessSet/,/CreateDevice/ s/^  device_attr.iface = gloo_iface_;/  gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;/' \
        "$1/horovod/common/gloo/gloo_context.cc"
    grep -q 'CMAKE_CXX_STANDARD 14' "$1/CMakeLists.txt" "$1/horovod/torch/CMakeLists.txt" && { echo "patch failed" >&2; exit 1; }
    grep -q 'gloo_iface_ = global_context.gloo_iface_;' "$1/horovod/common/gloo/gloo_context.cc" || { echo "gloo patch failed" >&2; exit 1; }
    # Fix 4: bfloat16 (horovod#4047): a HOROVOD_BFLOAT16 type, its MPI and Gloo reductions (widened to
    # float32, rounded once per step), scaling (on the CPU and in the CUDA kernels), NCCL's ncclBfloat16, and torch's
    # BFloat16Tensor bindings.
    patch -s -p1 -d "$1" < "$csrc/patches/bfloat16.patch"
    grep -q 'HOROVOD_BFLOAT16 = 10' "$1/horovod/common/message.h" || { echo "bfloat16 patch failed" >&2; exit 1; }
    # Fix 5: horovod.torch's synchronize() polled its handle in a sched_yield loop, one busy core per rank
    # while it waits; it now blocks on a condition variable that the background thread signals.
    patch -s -p1 -d "$1" < "$csrc/patches/torch_wait.patch"
    grep -q 'handle_manager.WaitHandle(handle)' "$1/horovod/torch/mpi_ops_v2.cc" || { echo "torch wait patch failed" >&2; exit 1; }
    # Fix 6: horovod.ray and horovod.spark on today's Ray and without pyarrow (hvdp.ray, hvdp.spark): Ray's
    # deprecated get_runtime_context().node_id and ray.state.current_node_id() replaced; a one-node elastic
    # job no longer waits (until elastic_timeout) for a second host to probe interfaces; the elastic adapter's
    # shutdown() stops a driver whose start timed out instead of failing an assertion; a placement group
    # that timed out is removed instead of left pending; horovod.spark.run imports without pyarrow.
    patch -s -p1 -d "$1" < "$csrc/patches/ray.patch"
    grep -q 'get_runtime_context().get_node_id()' "$1/horovod/ray/worker.py" \
        && grep -q 'ray.util.remove_placement_group(pg)' "$1/horovod/ray/strategy.py" \
        && grep -q 'self.driver.stop()' "$1/horovod/ray/elastic_v2.py" || { echo "ray patch failed" >&2; exit 1; }
    # Fix 7: under Gloo the stall inspector never warned nor shut a job down (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
    # ignored: ranks left in different collectives waited forever). GlooController::Initialize reserve()d
    # global_ranks_ and wrote the ranks past its end, so the vector stayed empty and CheckForStalledTensors,
    # which counts the process set's ranks by its size(), saw none missing. resize() it, as MPI's controller does.
    sed -i 's/^  global_ranks_.reserve(size_);/  global_ranks_.resize(size_);/' "$1/horovod/common/gloo/gloo_controller.cc"
    grep -q '^  global_ranks_.resize(size_);' "$1/horovod/common/gloo/gloo_controller.cc" || { echo "gloo ranks patch failed" >&2; exit 1; }
    # Fix 8: Python 3.12 removed distutils from the standard library (PEP 632; pypa/setuptools#4655 is this
    # build failing there). The torch op's CMakeLists asked distutils.sysconfig for Python's include directory
    # (and setuptools' stand-in answers with the path Python was configured for, wrong for a relocated Python:
    # a site's module, a copied pyenv), and horovod.runner.js_run, which horovodrun imports, took
    # find_executable from distutils.spawn. Use sysconfig and shutil.which, there since Python 3.3.
    sed -i 's/"from distutils.sysconfig import get_python_inc; print(get_python_inc())"/"import sysconfig; print(sysconfig.get_paths()[\x27include\x27])"/' \
        "$1/horovod/torch/CMakeLists.txt"
    sed -i 's/^from distutils.spawn import find_executable$/from shutil import which as find_executable/' "$1/horovod/runner/js_run.py"
    ! grep -rq 'distutils' "$1/horovod/torch/CMakeLists.txt" "$1/horovod/runner/js_run.py" \
        || { echo "distutils patch failed" >&2; exit 1; }
    # Fix 9: a CUDA torch with no GPU operations asked for (`hvdp build-horovod --cpu-only`; PyPI's torch for
    # 3.12/3.13 is a CUDA build): FindPytorch called torch a CUDA build whenever torch sees a CUDA_HOME (any nvcc
    # on PATH, or /usr/local/cuda, even without the runtime's headers and libcudart), and the torch op then
    # required the CUDA toolkit. Unless Horovod's own configure chose CUDA (HOROVOD_GPU_OPERATIONS, which the
    # cache key names), build torch's CPU extension: it serves CPU tensors, as --cpu-only says.
    sed -i 's/^string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)$/&\nif(NOT HAVE_CUDA)\n    set(Pytorch_CUDA FALSE)\nendif()/' \
        "$1/cmake/Modules/FindPytorch.cmake"
    grep -q '^    set(Pytorch_CUDA FALSE)$' "$1/cmake/Modules/FindPytorch.cmake" \
        || { echo "torch cpu-only patch failed" >&2; exit 1; }
    # Fix 10: torch >= 2.14's headers need C++20 (`#error C++20 or later compatible compiler is required to use
    # PyTorch`), and pip gives 2.14 on 3.12 and 3.13; the torch op is compiled as C++17 (fix 1) for older ones.
    sed -i 's/^    set(CMAKE_CXX_STANDARD 17)$/&\n    if(NOT Pytorch_VERSION VERSION_LESS "2.14.0")\n        set(CMAKE_CXX_STANDARD 20)\n    endif()/' \
        "$1/horovod/torch/CMakeLists.txt"
    grep -q '^        set(CMAKE_CXX_STANDARD 20)$' "$1/horovod/torch/CMakeLists.txt" || { echo "torch C++20 patch failed" >&2; exit 1; }
    # Fix 11: the MPI controller's negotiation waited in a blocking MPI_Allreduce every cycle, and OpenMPI's
    # blocking wait spins: a rank whose peer was computing, sleeping or paused burnt a core in its background
    # thread (measured: 10 and 20 s of CPU in 30 s, np=2). Its bit-vector all-reduces now start
    # non-blocking and are tested with naps of 10 us to 1 ms between tests (issue 37).
    patch -s -p1 -d "$1" < "$csrc/patches/polite_wait.patch"
    grep -q 'AllreducePolitely(bitvector, count, MPI_BAND' "$1/horovod/common/mpi/mpi_controller.cc" \
        || { echo "polite wait patch failed" >&2; exit 1; }
    # Fix 12: the background loop negotiated every cycle (1 ms) whether or not there was anything to do: a
    # rank sleeping, or waiting for a late peer, used 10-15% of a core (MPI and Gloo alike). A rank with
    # nothing queued for 10 cycles now negotiates every HVDP_IDLE_CYCLE_MS (20; 0 turns it off) and is
    # woken at once when it enqueues work; no collective waits on a rank that has not enqueued it.
    patch -s -p1 -d "$1" < "$csrc/patches/idle_cycle.patch"
    grep -q 'WaitForWork(state.seen_work' "$1/horovod/common/operations.cc" || { echo "idle cycle patch failed" >&2; exit 1; }
    # Fix 13: a cycle started only when the last one's cycle time (1 ms) was up, so each lone small allreduce
    # waited out the rest of a cycle (1.07 ms at 4 KiB against mpi4py's 3.8 us, np=2). A cycle now starts as
    # soon as a tensor that no negotiation has taken yet is enqueued (at once if one came during the last
    # cycle); tensors that come while a cycle negotiates or runs are taken together by the next one and fuse.
    # A rank whose tensor waits for a late peer starts its next cycle at once too, so that the peer's cycle,
    # which starts when it enqueues that tensor, does not wait for this rank's cycle time (whole runs of
    # 200 ms waits were seen with a 200 ms cycle); where every rank waits so (a stall), cycles keep their
    # time instead of spinning. HVDP_PROMPT_START=0 turns it off (fix 12 alone), for measuring both.
    patch -s -p1 -d "$1" < "$csrc/patches/prompt_start.patch"
    grep -q 'uint64_t consumed = ConsumedCount();' "$1/horovod/common/operations.cc" \
        && grep -q 'state.awaiting_peer = waiting' "$1/horovod/common/operations.cc" || { echo "prompt start patch failed" >&2; exit 1; }
    # Fix 14: Gloo's TCP device loop spun. Its handler returns at once when a user thread holds the pair's
    # lock (to post a send or a recv), and the socket is level-triggered in epoll, so the loop called it
    # again at once, keeping that thread, preempted on the same CPU, off it until the scheduler's tick: under
    # Gloo 2-48% of 4 KiB all-reduces took 4 or 8 ms instead of 0.35 (np=2). The loop now yields the CPU.
    patch -s -p1 -d "$1" < "$csrc/patches/gloo_loop_yield.patch"
    grep -q 'std::this_thread::yield();' "$1/third_party/gloo/gloo/transport/tcp/pair.cc" \
        || { echo "gloo loop yield patch failed" >&2; exit 1; }
    # Fix 15: the timeline's writer thread yielded in a loop while its queue was empty: with the timeline on
    # (HOROVOD_TIMELINE), a rank waiting 20 s in a collective used 20 s of CPU (1.0 core), MPI and Gloo alike
    # (issue 52). It now sleeps on a condition variable that each enqueue, a new file and shutdown signal.
    patch -s -p1 -d "$1" < "$csrc/patches/timeline_wait.patch"
    grep -q 'wake_.wait_for(lock' "$1/horovod/common/timeline.cc" || { echo "timeline wait patch failed" >&2; exit 1; }
    # Fix 17: NCCL from pip (nvidia-nccl-cu13, torch's own dependency: what a GPU server's venv has) ships
    # lib/libnccl.so.2 and no libnccl.so, and FindNCCL looked only for libnccl_static.a and libnccl.so, so
    # the NCCL build failed on a complete toolkit (issue 46). It also takes the versioned name.
    sed -i 's/^\(            NAMES "nccl"\)$/\1 "libnccl.so.2"/' "$1/cmake/Modules/FindNCCL.cmake"
    grep -q '^            NAMES "nccl" "libnccl.so.2"$' "$1/cmake/Modules/FindNCCL.cmake" \
        || { echo "pip nccl patch failed" >&2; exit 1; }
    # Fix 18: horovodrun asks whether Horovod has Gloo and MPI by loading each framework's extension in a child
    # process, TensorFlow's first: a PyTorch-only job printed TensorFlow's oneDNN/absl banners (5 lines per
    # launch) and paid its import, whenever TensorFlow was installed (issue 46). Try torch's first.
    sed -i "s/^EXTENSIONS = \['tensorflow', 'torch', 'mxnet'\]$/EXTENSIONS = ['torch', 'tensorflow', 'mxnet']/" \
        "$1/horovod/common/util.py"
    grep -q "^EXTENSIONS = \['torch', 'tensorflow', 'mxnet'\]$" "$1/horovod/common/util.py" \
        || { echo "extension order patch failed" >&2; exit 1; }
    # Fix 19: horovodrun's rendezvous server forgot which ranks had finished every scope whenever one scope
    # was complete (it cleared all the scopes' lists), so a scope a rank had finished before another's
    # completion never counted as complete and kept its keys. The next init after hvd.shutdown() under Gloo
    # read a peer's stale address: "connect [127.0.0.1]:17332: Connection refused", thrown in Horovod's
    # background thread, SIGABRT (issue 52: 1 in 15 runs of Horovod's duplicate-name tests, whose tearDown
    # shuts down after each test). Only the completed scope's list is dropped now.
    sed -i 's/^                        self.server.finished_list.clear()$/                        del self.server.finished_list[scope]/' \
        "$1/horovod/runner/http/http_server.py"
    grep -q '^                        del self.server.finished_list\[scope\]$' "$1/horovod/runner/http/http_server.py" \
        || { echo "rendezvous scope patch failed" >&2; exit 1; }
    # Addition (not a repair): hvdp's shared-memory allreduce for ranks on one host, tried before MPI's.
    # csrc/horovod/shm_operations.cc says how it works; it is off unless HVDP_SHM_ALLREDUCE=1.
    cp "$csrc/shm_operations.h" "$csrc/shm_operations.cc" "$1/horovod/common/ops/"
    sed -i 's|"${PROJECT_SOURCE_DIR}/horovod/common/ops/mpi_operations.cc"|&\n                "${PROJECT_SOURCE_DIR}/horovod/common/ops/shm_operations.cc"|' "$1/CMakeLists.txt"
    sed -i 's|^#include "ops/mpi_operations.h"|&\n#include "ops/shm_operations.h"|' "$1/horovod/common/operations.cc"
    sed -i 's|^        std::shared_ptr<AllreduceOp>(new MPIAllreduce(&state)));|        std::shared_ptr<AllreduceOp>(new ShmAllreduce(\&state)));\n    allreduce_ops.push_back(\n&|' \
        "$1/horovod/common/operations.cc"
    grep -q 'new ShmAllreduce(&state)' "$1/horovod/common/operations.cc" && grep -q 'ops/shm_operations.cc' "$1/CMakeLists.txt" \
        || { echo "shm allreduce patch failed" >&2; exit 1; }
    # Fix 16: Horovod's own TensorFlow/Keras API on Keras 3 (issue 51; horovod#4290, fixed upstream only in the
    # unmerged #4317): Keras 3's variables have no ref() (a helper keys them by the tf.Variable they hold) and are
    # not tf.Variables (local variables, broadcast_variables, a tf.function's arguments); Keras 3's optimizers
    # have no compute_gradients/_aggregate_gradients and fit calls apply(), so horovod.tensorflow.keras's
    # DistributedOptimizer all-reduces there (and accumulates backward_passes_per_step); the callbacks use
    # learning_rate (no lr) and tf.keras.backend's get_value/set_value; elastic state reads Keras 3's
    # optimizer.variables list; SyncBatchNormalization passes no `fused` and takes Keras 3's _moments(inputs, mask).
    patch -s -p1 -d "$1" < "$csrc/patches/keras3.patch"
    grep -q '^def var_ref(var):' "$1/horovod/tensorflow/util.py" \
        && grep -q '^class _Keras3DistributedOptimizer(object):' "$1/horovod/_keras/__init__.py" \
        && ! grep -rq '[a-z]\.ref()' "$1/horovod/_keras" "$1/horovod/tensorflow/__init__.py" \
            "$1/horovod/tensorflow/gradient_aggregation.py" "$1/horovod/tensorflow/gradient_aggregation_eager.py" \
        || { echo "keras 3 patch failed" >&2; exit 1; }
}

if [ "${1:-}" = "--patch" ]; then
    apply_fixes "$2"
    exit 0
fi

# The key names everything the binary depends on: the installed frameworks, python, the GPU ops and
# this recipe itself: this script and every file under csrc/horovod/, by content and by name (a new
# source fix must not reuse a wheel built without it).
recipe="$(cd "$root" && find scripts/build_horovod.sh csrc/horovod -type f | LC_ALL=C sort \
          | while read -r f; do printf '%s\n' "$f"; cat "$f"; done | sha256sum | cut -c1-8)"
# A build without MPI (HOROVOD_WITHOUT_MPI=1: `hvdp build-horovod` where no mpicxx, `make setup-cuda`) says so.
key="$("$PYTHON" - "$HOROVOD_VERSION" "${HOROVOD_GPU_OPERATIONS:-cpu}" "$recipe" "${HOROVOD_WITHOUT_MPI:-}" <<'PY'
import platform, sys
from importlib.metadata import version
hv, gpu, recipe, without_mpi = sys.argv[1:]
def installed(*dists):
    for dist in dists:
        try:
            return version(dist)
        except Exception:
            pass
    return "none"
tf = installed("tensorflow-cpu", "tensorflow")
mpi = "_nompi" if without_mpi not in ("", "0") else ""
print(f"horovod-{hv}_torch-{installed('torch')}_tf-{tf}_cp{sys.version_info.major}{sys.version_info.minor}"
      f"_{platform.machine()}_{gpu.lower()}{mpi}_{recipe}")
PY
)"
cache="${HVDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdp}/wheels/$key"
if ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    ls "$cache"/horovod-*.whl
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "building Horovod $HOROVOD_VERSION ($key); this takes about 10 minutes on 2 cores" >&2
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" >&2
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
src="$work/horovod-$HOROVOD_VERSION"

apply_fixes "$src"

mkdir -p "$work/out"
(
    cd "$src"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
    # CMAKE_POLICY_VERSION_MINIMUM: gloo asks for cmake 2.8, which cmake >= 4 refuses unless told.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    export HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}"
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$work/out" . >&2
)
mkdir -p "$cache"
mv "$work"/out/horovod-*.whl "$cache/"
ls "$cache"/horovod-*.whl
