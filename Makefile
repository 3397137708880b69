# The two commands: `make demo` and `make test`.  Both create or reuse .venv/ and build
# Horovod 0.28.1 into it when needed (scripts/setup_env.sh; the wheel is cached in
# ~/.cache/hvd_gqsgd so only the first run on a machine pays the ~5 minute build).

VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
PYTEST_ARGS ?=
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup test demo lint clean

setup:
	@VENV=$(VENV) bash scripts/setup_env.sh

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/horovodrun --gloo -np $(NP) -H localhost:$(NP) $(PY) examples/torch_digits.py

lint: setup
	$(VENV)/bin/ruff check hvd_gqsgd tests examples
	$(VENV)/bin/mypy hvd_gqsgd

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
