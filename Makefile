# The two commands: `make demo` and `make test`.  Both create or reuse .venv/ and build
# Horovod 0.28.1 into it when needed (scripts/setup_env.sh; the wheel is cached in
# ~/.cache/hvd_gqsgd so only the first run on a machine pays the ~5 minute build).

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# TensorFlow's C++ logger ignores TF_CPP_MIN_LOG_LEVEL for its first lines (horovodrun itself
# imports TF); drop them from the demo's output.
TF_NOISE := grep -v -e '^I0000 ' -e 'absl::InitializeLog' -e 'cuda drivers'

VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
PYTEST_ARGS ?=
export OMP_NUM_THREADS ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup test demo bench convergence lint clean image image-clean

setup:
	@VENV=$(VENV) bash scripts/setup_env.sh

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# examples/demo.py: examples/torch_digits.py under horovodrun (loopback), then a 64 MB-gradient
# training step on 2 emulated hosts at 1 Gbit/s (root), or its predicted time at 1 and
# 10 Gbit/s elsewhere (DEMO_LINK=predicted forces that), in one table.
DEMO_LINK ?= auto
demo: setup
	$(PY) examples/demo.py --np $(NP) --link $(DEMO_LINK) \
		2>&1 | $(TF_NOISE) | sed -e 's/^\[0\]<stdout>://'


# Bandwidth benchmarks on emulated hosts (root): docs/BENCHMARKS.md and its plot (Horovod,
# torch and TF), its deep-model section, then docs/DDP.md (the DDP hook against DDP's own
# hooks), then docs/FSDP.md (the FSDP2 hook against FSDP2's own reduce-scatters).
bench: setup
	$(PY) benchmarks/netbench.py 2>&1 | $(TF_NOISE)
	$(PY) benchmarks/deep_bench.py 2>&1 | $(TF_NOISE)
	$(PY) benchmarks/ddp_bench.py 2>&1 | $(TF_NOISE)
	$(PY) benchmarks/fsdp_bench.py 2>&1 | $(TF_NOISE)

# Convergence sweep (digits in PyTorch and TF, char-level LM; 2 and 4 ranks; 3 seeds):
# writes docs/CONVERGENCE.md and docs/convergence_*.png; then the FSDP2 hook against plain FSDP2
# (char-level transformer, 4 ranks, 3 seeds) into docs/FSDP.md.
convergence: setup
	$(PY) benchmarks/convergence.py 2>&1 | $(TF_NOISE)
	$(PY) benchmarks/fsdp_convergence.py

# The bundled image, built and run for real (root; docker/README.md): buildah builds
# docker/Dockerfile as `docker build` would, then runs its CMD and IMAGE_DEMO inside it, as
# `docker run --rm hvd_gqsgd $(IMAGE_DEMO)` would.  The first run compiles Horovod in the
# image (14 minutes here); later ones reuse the wheel from the build cache (5.5 minutes).  Not
# part of `make test`.  Everything it keeps is in IMAGE_STORE; `make image-clean` removes it.
IMAGE_STORE ?= /var/tmp/hvd_gqsgd-image
IMAGE_DEMO ?= horovodrun -np 2 -H localhost:2 --gloo python examples/torch_digits.py

image:
	@IMAGE_STORE=$(IMAGE_STORE) IMAGE_DEMO="$(IMAGE_DEMO)" bash scripts/image.sh

image-clean:
	@if [ -d $(IMAGE_STORE) ]; then \
		buildah --root $(IMAGE_STORE)/storage --runroot $(IMAGE_STORE)/run --storage-driver vfs \
			rm --all >/dev/null && rm -rf $(IMAGE_STORE); fi

lint: setup
	$(VENV)/bin/ruff check hvd_gqsgd gqsgd_lab tests examples benchmarks studies scripts
	$(VENV)/bin/mypy hvd_gqsgd

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
