# hvdp: `make test` and `make train` are all a user needs; both run `make setup` first.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
NP    ?= 2

.PHONY: setup test test-fast soak train bench docker-test clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q tests

# The in-process core tests only: seconds, no launcher.
test-fast:
	$(PY) -m pytest -q tests/core

# The in-flight collectives stress test at length: ITERATIONS per launch (about 1 s each at np=2).
ITERATIONS ?= 1000
soak: setup
	HVDP_SOAK_ITERATIONS=$(ITERATIONS) $(PY) -m pytest -q tests/torch/test_inflight.py

train: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) examples/train_torch.py

bench: setup
	$(VENV)/bin/hvdp bench --np $(NP)

docker-test: setup
	bash scripts/test_image.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
