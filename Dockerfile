# hvdp: Horovod 0.28.1 with the pinned PyTorch and TensorFlow/Keras 3 (constraints.txt), OpenMPI and
# Gloo, run as a non-root user. The default CMD is the main job on 2 ranks.
#
#   docker build -t hvdp .                       # CPU (python:3.11-slim-bookworm)
#   docker run --rm hvdp                         # horovodrun -np 2 -H localhost:2 python examples/train_torch.py
#   docker build -t hvdp:cuda --build-arg HVDP_DEVICE=cuda .   # GPU: torch 2.11 (CUDA 13), NCCL, MPI, Gloo
#
# The CUDA variant (PyTorch only) takes the CUDA toolkit and NCCL from pip, so any Debian/Ubuntu base does;
# it runs on hosts with an NVIDIA driver R580+ through the NVIDIA container toolkit (docker run --gpus all).
# `make docker-test-cuda` builds it here and runs the same job on the CPU (docs/gpus.md).
#
# Build args: BASE_IMAGE (any Debian/Ubuntu with apt; python3 >= 3.10 is installed when missing),
# HVDP_DEVICE cpu|cuda, TORCH_INDEX_URL (auto), PIP_CERT (path of a CA bundle visible during the build, for
# networks that inspect TLS; used by pip at build time only). Wheels put in docker/wheels/ (see its README)
# are used before the index; a matching prebuilt Horovod wheel there skips the ~10 min compile.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG HVDP_DEVICE=cpu
ARG TORCH_INDEX_URL=auto
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY docker/image.sh /src/docker/
RUN bash /src/docker/image.sh system build
COPY docker/wheels/ /tmp/wheels/
COPY constraints.txt /src/
COPY scripts/build_horovod.sh scripts/cuda_stack.sh /src/scripts/
COPY csrc/ /src/csrc/
RUN bash /src/docker/image.sh frameworks
COPY setup.cfg setup.py MANIFEST.in pyproject.toml README.md /src/
COPY benchmarks/ /src/benchmarks/
COPY hvdp/ /src/hvdp/
RUN bash /src/docker/image.sh hvdp

FROM ${BASE_IMAGE}
ARG HVDP_DEVICE=cpu
COPY docker/image.sh /tmp/hvdp/docker/
RUN bash /tmp/hvdp/docker/image.sh system runtime && rm -rf /tmp/hvdp \
    && useradd --create-home --uid 1000 --shell /bin/bash app \
    && install -d -o app -g app /workspace
COPY --from=build /opt/hvdp/venv /opt/hvdp/venv
COPY --chown=app:app examples/ /workspace/examples/
# OpenMPI in a container: no ptrace-based single copy (blocked by default seccomp profiles), no core binding.
ENV PATH=/opt/hvdp/venv/bin:$PATH \
    OMPI_MCA_btl_vader_single_copy_mechanism=none \
    OMPI_MCA_hwloc_base_binding_policy=none \
    OMPI_MCA_rmaps_base_mapping_policy=slot \
    PYTHONDONTWRITEBYTECODE=1
USER app
WORKDIR /workspace
CMD ["horovodrun", "-np", "2", "-H", "localhost:2", "python", "examples/train_torch.py"]
