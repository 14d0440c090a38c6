# hvdp: `make test` and `make train` are all a user needs; both run `make setup` first.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
NP    ?= 2

.PHONY: setup test test-fast soak train bench docker-test docker-test-cuda clean setup-cuda test-cuda-build gpu-wheels test-install test-horovod soak-horovod soak-life

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q --durations=0 --durations-min=10 tests

# The in-process core tests only: seconds, no launcher.
test-fast:
	$(PY) -m pytest -q tests/core

# Horovod's own parallel tests (../shared/peer/horovod-0.28.1, unmodified; tests/peer_deselect.txt says which
# cannot pass and why) and tests/peer_keras3.py's Keras-3 ports, every file whole, at np=2 and np=3 under Gloo
# and MPI, against the Horovod `make setup` built: tests/test_peer_horovod.py. `make test` runs a part of them
# at np=2 (its time budget). Not part of `make test`.
test-horovod: setup
	HVDP_PEER_FULL=1 $(PY) -m pytest -q --durations=20 tests/test_peer_horovod.py

# hvdp installed as a user without root would (tests/test_install.py, as root: it creates a throwaway user):
# a fresh venv, `pip install` of a copy of the checkout, `hvdp doctor`, `hvdp build-horovod`'s preflight
# errors. About a minute; no Horovod build (that is ~10 minutes: docs/install.md). Not part of `make test`.
# Horovod's own suites whole, PEER_ROUNDS times in a row under Gloo and MPI at np=2 (issue 52): a run that does
# not end in 900 s is a hang and fails; one JSON line per run in PEER_LOG, then the table docs/support.md quotes.
PEER_ROUNDS ?= 20
PEER_LOG ?= build/soak-horovod.jsonl
soak-horovod: setup
	mkdir -p $(dir $(PEER_LOG)) && rm -f $(PEER_LOG)
	HVDP_PEER_FULL=1 HVDP_PEER_NP=2 HVDP_PEER_ROUNDS=$(PEER_ROUNDS) HVDP_PEER_TIMEOUT=900 \
		HVDP_PEER_LOG=$(abspath $(PEER_LOG)) $(PY) -m pytest -q tests/test_peer_horovod.py -k test_peer_suite; \
	status=$$?; $(PY) -c "from tests.test_peer_horovod import summarize; print(summarize('$(PEER_LOG)'))"; \
	exit $$status

test-install: setup
	HVDP_TEST_INSTALL=1 $(PY) -m pytest -q tests/test_install.py

# The stress tests at length: the in-flight collectives, ITERATIONS per launch (about 1 s each at np=2), and
# the DataLoader worker start-ups, EPOCHS per launch (about 4.5 start-ups per rank and 0.5 s per epoch at np=2).
ITERATIONS ?= 1000
EPOCHS ?= 400
soak: setup
	HVDP_SOAK_ITERATIONS=$(ITERATIONS) $(PY) -m pytest -q tests/torch/test_inflight.py
	HVDP_SOAK_EPOCHS=$(EPOCHS) $(PY) -m pytest -q tests/torch/test_worker_starts.py

# One job's whole life at length on the tests' Slurm cluster (tests/slurm/life.py; needs root and the Slurm
# packages): LIFE_CYCLES cycles of `scontrol requeue`, kill -9 of a rank and a resubmission, for a life whose world
# size never changes (bit for bit) and one resized 2 -> 4 -> 2 ranks; the short life runs in `make test`.
LIFE_CYCLES ?= 3
soak-life: setup
	HVDP_LIFE_CYCLES=$(LIFE_CYCLES) $(PY) -m pytest -q -s --durations=5 tests/slurm/test_sbatch.py -k long_jobs_life

train: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) examples/train_torch.py

bench: setup
	$(VENV)/bin/hvdp bench --np $(NP)

# The image (scripts/test_image.sh), then docs/launchers.md's MPIJob run on it: docker/sshd.Dockerfile's image
# in three network-namespace pods (tests/multihost/test_mpijob.py).
docker-test: setup
	bash scripts/test_image.sh
	HVDP_DOCKER_TEST=1 $(PY) -m pytest -q tests/multihost/test_mpijob.py

# The CUDA variant of the image (PyTorch, CUDA 13, NCCL from pip; ~4 GB of wheels, Horovod compiled in the
# build), built for real and its job run on the CPU: docs/gpus.md.
docker-test-cuda: setup
	HVDP_DEVICE=cuda bash scripts/test_image.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The CUDA 13 + NCCL Horovod (PyTorch, Gloo, no MPI) in .venv-cuda, compiled without a GPU; not part of
# `make test` (a ~4-minute build and a multi-GB download). scripts/setup_cuda.sh prints the wheel's path.
CUDA_VENV ?= .venv-cuda
setup-cuda:
	@VENV=$(abspath $(CUDA_VENV)) bash scripts/setup_cuda.sh

# The PyTorch tests under that build, CPU tensors only. Its MPI launches skip (tests/launch.py) and so do
# the TensorFlow tests (tests/conftest.py: it is not installed there), each saying why; the doctor's
# full-stack check (TensorFlow and MPI) is left out: setup-cuda checks what this build must have. So is the
# horovodrun half of the no-MPI message test: it fakes a Gloo-only Horovod inside the worker, but under a real
# one `horovodrun --mpi` itself refuses ("MPI support has not been built") before any worker starts.
CUDA_TESTS ?= tests/core tests/torch tests/faults tests/test_examples_torch.py tests/test_cli.py \
	tests/test_imports.py tests/test_api_docs.py tests/test_resume_resize.py
test-cuda-build: setup-cuda
	PATH=$(abspath $(CUDA_VENV))/bin:$$PATH $(CUDA_VENV)/bin/python -m pytest -q $(CUDA_TESTS) \
		--deselect tests/test_cli.py::test_doctor_explains_the_stack \
		--deselect "tests/faults/test_bad_input.py::test_mpi_launch_of_a_horovod_built_without_mpi_says_how_to_fix[horovodrun]"

# What scripts/gpu_check.sh installs on a GPU machine without network (docs/gpus.md): the CUDA Horovod wheel,
# its dependencies as cp312 wheels (the versions .venv-cuda tested) and the bundled digits as .npz.
GPU_WHEELS ?= build/gpu-wheels
gpu-wheels: setup-cuda setup
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	cp "$$(cat $(CUDA_VENV)/.hvdp-stamp.horovod)" $(GPU_WHEELS)/
	$(CUDA_VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS) \
		$$($(CUDA_VENV)/bin/python -m pip freeze | grep -iE '^(cloudpickle|psutil|pyyaml|packaging|numpy)==')
	$(PY) -c "from sklearn.datasets import load_digits; import numpy as np; d = load_digits(); \
		np.savez('$(GPU_WHEELS)/digits.npz', x=d.images[:, None] / 16.0, y=d.target)"
	@du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS)
