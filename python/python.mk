# python/python.mk: the Python package, included by the Makefile.
#
#   make python         builds the cohort package into $(BUILD)/python, so
#                       that PYTHONPATH=$(BUILD)/python imports it
#   make python-test    runs tests/python against it
#
# One recipe builds the package for make and for `pip install ./python`:
# python/setup.py, which compiles libcohort with -fPIC itself (the
# Makefile's objects are not position-independent). It is the release
# (-O2) build: a sanitizer build cannot be loaded into /usr/bin/python3
# without LD_PRELOAD. setup.py rebuilds only what changed.

PY_BUILD := $(BUILD)/python
PY_TMP   := $(BUILD)/python-tmp

.PHONY: python python-test

python:
	cd python && COHORT_WERROR=1 COHORT_GPU=$(GPU) CUDA_HOME=$(CUDA_HOME) $(PYTHON) setup.py -q build -j $$(nproc) \
		--build-base $(abspath $(PY_TMP)) --build-lib $(abspath $(PY_BUILD)) \
		--build-temp $(abspath $(PY_TMP))/temp

# The tests drive the release binaries of the same build: the extension is
# the release build, a cohort of torch trainers is slow enough on two cores
# without sanitizers under its sidecars, and the C side's sanitizer
# coverage comes from tests/proc.
# With GPU support, tests/python/test_py_gpu.py runs a CUDA model's path
# against the stand-in driver (tests/gpu/fake_cuda.c, not sanitized), which
# the sidecars and the trainers load from COHORT_FAKE_CUDA_DIR.
python-test: python $(BUILD)/cohort-operator $(BUILD)/cohort-sidecar $(BUILD)/cohortctl \
		$(if $(filter on,$(GPU)),$(FAKE_CUDA))
	PYTHONPATH=$(abspath $(PY_BUILD)) COHORT_BIN=$(abspath $(BUILD)) \
		$(if $(filter on,$(GPU)),COHORT_FAKE_CUDA_DIR=$(abspath $(dir $(FAKE_CUDA)))) \
		$(PYTEST_PAR) tests/python
