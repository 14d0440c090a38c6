# Sourced by scripts/setup_cuda.sh and docker/image.sh: the CUDA stack's pins (the CPU stack's live in
# constraints.txt) and the step that makes its pip wheels look like a CUDA install to nvcc and CMake.
#
# PyPI's torch 2.11.0 is its CUDA 13.0 build and requires exactly this toolkit and NCCL; the toolkit's
# compiler pieces come through one spec, so that pip cannot pair nvcc 13.0 with a newer crt/nvvm, and cccl
# is there for cuda_fp16.h's <nv/target>.
CUDA_TORCH=2.11.0
CUDA_TOOLKIT=13.0.2
CUDA_NCCL=2.28.9
CUDA_CMAKE=4.4.3                # a CMake that knows CUDA 13 (gloo's cmake 2.8 floor: build_horovod.sh handles it)
CUDA_SETUPTOOLS="setuptools<82" # torch 2.11.0 requires it; Horovod builds with --no-build-isolation, so it is this one
# What pip installs for it (the specs, one a line).
cuda_packages() {
    printf '%s\n' "torch==$CUDA_TORCH" "cuda-toolkit[nvcc,crt,nvvm,cccl]==$CUDA_TOOLKIT" \
        "nvidia-nccl-cu13==$CUDA_NCCL" "cmake==$CUDA_CMAKE" "$CUDA_SETUPTOOLS"
}

# cuda_constraints CONSTRAINTS_TXT: that file without the CPU stack's framework pins (torch, TensorFlow,
# Keras, Horovod), with the CUDA stack's (a constraint names no extras): the other tools keep their tested
# versions, and nothing can move torch or the toolkit.
cuda_constraints() {
    grep -v -E '^(torch|tensorflow-cpu|tensorflow|keras|horovod)==' "$1"
    cuda_packages | sed 's/\[[^]]*\]//'
}

# cuda_layout PYTHON: sets CUDA_HOME and NCCL_HOME to the wheels' directories in PYTHON's site-packages,
# after checking they hold nvcc, the runtime and NCCL, and adds the names a CUDA install has there.
# nvcc.profile links with -L$TOP/lib64, the wheels ship lib/: without the first link CMake's CUDA compiler
# check fails with `cannot find -lcudadevrt`. The wheels hold only the runtime's versioned names, where a
# CUDA install also has the linker's: Horovod's FindCUDAToolkit looks for libcudart.so (`Could NOT find
# CUDAToolkit (missing: CUDA_CUDART)` without it; the build itself links cudart_static), FindNCCL for
# libnccl.so. Returns 1 with a message on stderr when a piece is missing.
cuda_layout() {
    local site
    site="$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    CUDA_HOME="$site/nvidia/cu13"
    NCCL_HOME="$site/nvidia/nccl"
    local need
    for need in "$CUDA_HOME/bin/nvcc" "$CUDA_HOME/lib/libcudart.so.13" "$NCCL_HOME/lib/libnccl.so.2"; do
        [[ -e $need ]] || { echo "no $need: the CUDA wheels' install ($(cuda_packages | tr '\n' ' ')) failed" >&2; return 1; }
    done
    [[ -e "$CUDA_HOME/lib64" ]] || ln -s lib "$CUDA_HOME/lib64"
    [[ -e "$CUDA_HOME/lib/libcudart.so" ]] || ln -s libcudart.so.13 "$CUDA_HOME/lib/libcudart.so"
    [[ -e "$NCCL_HOME/lib/libnccl.so" ]] || ln -s libnccl.so.2 "$NCCL_HOME/lib/libnccl.so"
    export CUDA_HOME NCCL_HOME
}
