# cohort: build, test, demo.
#
#   make            release build into build/ (-O2, -Werror), and the Python
#                   package into build/python
#   make test       installs missing packages, builds the sanitizer build
#                   into build/asan/ and runs every test against it (the
#                   Python tests against the release build: see python/python.mk)
#   make demo       installs missing packages and runs a local cohort
#   make chaos      the long chaos trials (TRIALS=N, SEED=S): tests/chaos/
#   make image      the container image localhost/cohort:$(cat VERSION)
#                   (and :dev) with podman (scripts/image.sh, Dockerfile)
#
# Sources are found by directory, so a new module is a new .c/.h pair and
# nothing more: src/<subsystem>/ -> the libraries below, operator/ sidecar/
# cli/ -> binaries, tests/unit/ -> one Criterion binary, tests/tools/NAME.c ->
# one client binary each for the process tests.
#
# The libraries (docs/architecture.md, "Layout"):
#   libcohort.a        the trainer library: include/cohort.h and exactly the
#                      modules it needs, as one object whose only global
#                      names are the public cohort_* API
#   libcohort-k8s.a    the operator's Kubernetes code (src/k8s/)
#   lib/libcohort-core.a  every module outside src/k8s/ with its internal
#                      names, for the binaries and the unit tests

# `make` alone builds everything; without this the first rule of the
# generated trees below would be the default.
.DEFAULT_GOAL := all

BUILD    ?= build
ASAN_DIR := $(BUILD)/asan
PYTHON   ?= /usr/bin/python3

CC       ?= cc
OBJCOPY  ?= objcopy
PKGS     := grpc libprotobuf-c libcjson libcurl yaml-0.1 libcrypto
WARN     := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
# Everything is compiled with hidden visibility: only what include/cohort.h
# marks public survives into libcohort.a's symbol table.
# The project's version, from the one file that holds it: the operator's
# default sidecar image is ghcr.io/cohort-dev/cohort:$(VERSION). Anything
# else that needs it (the image's labels, the chart) reads it from here
# with `make -s print-version`, never from a copy.
VERSION  := $(shell cat VERSION)
# -ffp-contract=off: no FMA contraction anywhere, so that a kernel's
# result does not depend on the instruction set it was compiled for
# (src/engine/dtype.c compiles its kernels for several, and every member
# of a cohort must compute the same bytes).
BASE_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) -g -fvisibility=hidden -ffp-contract=off \
               -Iinclude -Isrc \
               -DCOHORT_VERSION='"$(VERSION)"' $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
# The shared libgrpc pulls in abseil, re2 and the rest itself (see
# pkg-config --libs grpc for the static list).
LDLIBS   := -lgrpc -lgpr -lprotobuf-c -lcjson -lcurl -lyaml -lcrypto -lpthread -lm
OPT_CFLAGS  := -O2
ASAN_CFLAGS := -O1 -fno-omit-frame-pointer -fsanitize=address,undefined,float-cast-overflow \
               -fno-sanitize-recover=undefined,float-cast-overflow
ASAN_LDFLAGS := -fsanitize=address,undefined,float-cast-overflow

# ---- GPU support (docs/gpu.md) ----------------------------------------------
# src/gpu/ is compiled against CUDA's and NCCL's own headers, with -Werror
# and -DCOHORT_GPU, where both are found under CUDA_HOME; elsewhere it
# compiles to its refusals ("no GPU support in this build") and needs no
# CUDA header. Either way no binary links libcuda or libnccl: src/gpu/
# loads them at run time, so one binary runs on machines with and without
# a driver. `make GPU=off` builds without it where the headers exist.
CUDA_HOME ?= /usr/local/cuda
GPU ?= $(if $(and $(wildcard $(CUDA_HOME)/include/cuda.h),$(wildcard $(CUDA_HOME)/include/nccl.h)),on,off)
GPU_CFLAGS := $(if $(filter on,$(GPU)),-DCOHORT_GPU -I$(CUDA_HOME)/include)
ifeq ($(MAKELEVEL)$(GPU),0off)
$(info GPU support is off: $(if $(filter file undefined,$(origin GPU)),no cuda.h and nccl.h under CUDA_HOME=$(CUDA_HOME),GPU=off was given) (docs/gpu.md).)
endif
$(BUILD)/obj/src/gpu/%.o $(ASAN_DIR)/obj/src/gpu/%.o: BASE_CFLAGS += $(GPU_CFLAGS)
# src/gpu/ is compiled again when GPU support is turned on or off: the
# stamp holds the flags and changes only with them.
GPU_STAMP := $(BUILD)/gpu-flags
$(shell mkdir -p $(BUILD) && (echo '$(GPU_CFLAGS)' | cmp -s - $(GPU_STAMP) || \
        echo '$(GPU_CFLAGS)' > $(GPU_STAMP)))
$(foreach t,$(BUILD) $(ASAN_DIR),$(patsubst %.c,$(t)/obj/%.o,$(wildcard src/gpu/*.c))): $(GPU_STAMP)

# make test-gpu: the checks that need a GPU (tests/gpu/README.md), against
# the sanitizer build; they skip, saying why, where there is none. The
# sanitizer build compiles them, so make test keeps them building.
GPU_CHECK := $(ASAN_DIR)/tests/gpu/gpu_check
$(GPU_CHECK): $(ASAN_DIR)/obj/tests/gpu/gpu_check.o $(ASAN_DIR)/lib/libcohort-core.a
	@mkdir -p $(dir $@)
	$(CC) $(ASAN_LDFLAGS) -o $@ $^ $(LDLIBS)
asan: $(GPU_CHECK)
# A stand-in for libcuda.so.1 (tests/gpu/fake_cuda.c), for the driver
# paths' tests on machines without a driver; it needs cuda.h.
FAKE_CUDA := $(ASAN_DIR)/tests/gpu/fake/libcuda.so.1
$(FAKE_CUDA): tests/gpu/fake_cuda.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(WARN) -Wno-missing-prototypes -g -fPIC -shared \
		-I$(CUDA_HOME)/include -o $@ $<
# A stand-in for libnccl.so.2 (tests/gpu/fake_nccl.c), its ranks threads
# of one process, beside a stand-in driver that has cuStreamQuery: the
# NCCL path of tests/gpu/gpu_check without a GPU.
FAKE_NCCL_DIR := $(ASAN_DIR)/tests/gpu/fake-nccl
$(FAKE_NCCL_DIR)/libnccl.so.2: tests/gpu/fake_nccl.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(WARN) -Wno-missing-prototypes -g -fPIC -shared \
		-I$(CUDA_HOME)/include -o $@ $< -lpthread
$(FAKE_NCCL_DIR)/libcuda.so.1: tests/gpu/fake_cuda.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -DFAKE_CUDA_STREAM_QUERY $(WARN) -Wno-missing-prototypes -g \
		-fPIC -shared -I$(CUDA_HOME)/include -o $@ $<
ifeq ($(GPU),on)
asan: $(FAKE_CUDA) $(FAKE_NCCL_DIR)/libnccl.so.2 $(FAKE_NCCL_DIR)/libcuda.so.1
endif
.PHONY: test-gpu
test-gpu: deps
	$(MAKE) -j$$(nproc) $(GPU_CHECK) python $(BUILD)/cohort-operator $(BUILD)/cohort-sidecar \
		$(BUILD)/cohortctl
	$(GPU_CHECK)
	PYTHONPATH=$(abspath $(PY_BUILD)) COHORT_BIN=$(abspath $(BUILD)) $(PYTHON) -m pytest -q -rs \
		-p no:cacheprovider tests/python/test_py_gpu.py -k real_gpu
# ---- end of GPU support -----------------------------------------------------

PROTOS     := $(wildcard proto/*.proto)
LIB_SRCS   := $(wildcard src/*/*.c)
K8S_SRCS   := $(wildcard src/k8s/*.c)
CORE_SRCS  := $(filter-out $(K8S_SRCS),$(LIB_SRCS))
# The trainer library: the core less what only servers run (the broker,
# the sidecar's trainer service, flag parsing).
TRAINER_SRCS := $(filter-out src/base/opt.c src/membership/broker.c src/membership/brokerd.c \
                  src/accumulator/trainerd.c src/averager/avserve.c,$(CORE_SRCS))
OP_SRCS    := $(wildcard operator/*.c)
SC_SRCS    := $(wildcard sidecar/*.c)
CLI_SRCS   := $(wildcard cli/*.c)
UNIT_SRCS  := $(wildcard tests/unit/*.c)
TOOLS      := $(patsubst tests/tools/%.c,%,$(wildcard tests/tools/*.c))
EXAMPLES   := $(patsubst examples/c/%.c,%,$(wildcard examples/c/*.c))
CHAOS      := $(patsubst tests/chaos/%.c,%,$(wildcard tests/chaos/*.c))

# Generated protobuf-c sources live beside each build's objects.
gen_srcs = $(patsubst proto/%.proto,$(1)/gen/%.pb-c.c,$(PROTOS))
objs     = $(patsubst %.c,$(1)/obj/%.o,$(2))
gen_objs = $(patsubst $(1)/gen/%.c,$(1)/obj/gen/%.o,$(call gen_srcs,$(1)))

define build_tree
# $(1): output dir, $(2): extra CFLAGS, $(3): extra LDFLAGS
$(1)/gen/%.pb-c.c $(1)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(1)/gen
	protoc-c --proto_path=proto --c_out=$(1)/gen $$<

$(1)/obj/%.o: %.c $(call gen_srcs,$(1))
	@mkdir -p $$(dir $$@)
	$$(CC) $$(BASE_CFLAGS) $(2) -I$(1)/gen -MMD -MP -c $$< -o $$@

$(1)/obj/gen/%.o: $(1)/gen/%.c
	@mkdir -p $$(dir $$@)
	$$(CC) $$(BASE_CFLAGS) $(2) -I$(1)/gen -Wno-missing-prototypes -c $$< -o $$@

$(1)/lib/libcohort-core.a: $(call objs,$(1),$(CORE_SRCS)) $(call gen_objs,$(1))
	@mkdir -p $$(dir $$@)
	@rm -f $$@
	ar rcs $$@ $$^

$(1)/libcohort-k8s.a: $(call objs,$(1),$(K8S_SRCS))
	@rm -f $$@
	ar rcs $$@ $$^

# One relocatable object, then every hidden name made local: a trainer that
# links this sees cohort_* and nothing else of ours.
$(1)/libcohort.a: $(call objs,$(1),$(TRAINER_SRCS)) $(call gen_objs,$(1))
	@mkdir -p $(1)/lib
	$$(LD) -r -o $(1)/lib/cohort-trainer.o $$^
	$$(OBJCOPY) --localize-hidden $(1)/lib/cohort-trainer.o
	@rm -f $$@
	ar rcs $$@ $(1)/lib/cohort-trainer.o

$(1)/cohort-operator: $(call objs,$(1),$(OP_SRCS)) $(1)/libcohort-k8s.a $(1)/lib/libcohort-core.a
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

$(1)/cohort-sidecar: $(call objs,$(1),$(SC_SRCS)) $(1)/lib/libcohort-core.a
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

$(1)/cohortctl: $(call objs,$(1),$(CLI_SRCS)) $(1)/lib/libcohort-core.a
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

# Each examples/c/NAME.c is one trainer: build/examples/NAME. It links the
# trainer library as a user's trainer would, so a name missing from the
# public API fails here.
$(1)/examples/%: $(1)/obj/examples/c/%.o $(1)/libcohort.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

# Each tests/tools/NAME.c is a client the process tests drive (a raw
# broker call for the attack tests): build/tests/tools/NAME.
$(1)/tests/tools/%: $(1)/obj/tests/tools/%.o $(1)/lib/libcohort-core.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

# Each tests/chaos/NAME.c is a trainer of the chaos trials
# (tests/chaos/README.md): build/tests/chaos/NAME. Like an example, it
# links the trainer library and nothing else of ours.
$(1)/tests/chaos/%: $(1)/obj/tests/chaos/%.o $(1)/libcohort.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS)

$(1)/tests/unit: $(call objs,$(1),$(UNIT_SRCS)) $(1)/libcohort-k8s.a $(1)/lib/libcohort-core.a
	@mkdir -p $$(dir $$@)
	$$(CC) $(3) -o $$@ $$^ $$(LDLIBS) -lcriterion

-include $(shell find $(1)/obj -name '*.d' 2>/dev/null)
endef

$(eval $(call build_tree,$(BUILD),$(OPT_CFLAGS),))
$(eval $(call build_tree,$(ASAN_DIR),$(ASAN_CFLAGS),$(ASAN_LDFLAGS)))
# What COHORT_VERSION reaches is rebuilt when VERSION changes.
$(BUILD)/obj/operator/main.o $(ASAN_DIR)/obj/operator/main.o: VERSION

.PHONY: print-version
print-version:
	@echo $(VERSION)

BINS = cohort-operator cohort-sidecar cohortctl libcohort.a libcohort-k8s.a

# Generated sources are kept: they are inputs to the objects, not temporaries.
.SECONDARY:

.PHONY: all asan deps test layers unit proc chaos netfault kube demo demo-membership bench sandbox clean \
        bins install image image-test
all: $(addprefix $(BUILD)/,$(BINS)) $(addprefix $(BUILD)/examples/,$(EXAMPLES)) \
     $(addprefix $(BUILD)/tests/tools/,$(TOOLS)) $(addprefix $(BUILD)/tests/chaos/,$(CHAOS)) python

include python/python.mk

asan: $(addprefix $(ASAN_DIR)/,$(BINS)) $(addprefix $(ASAN_DIR)/examples/,$(EXAMPLES)) \
      $(addprefix $(ASAN_DIR)/tests/tools/,$(TOOLS)) $(addprefix $(ASAN_DIR)/tests/chaos/,$(CHAOS)) \
      $(ASAN_DIR)/tests/unit

deps:
	@scripts/install-deps.sh

# The release binaries the image holds, and nothing else (no Python, no
# test tools): the Dockerfile's builder stage runs `make install`.
bins: $(addprefix $(BUILD)/,cohort-operator cohort-sidecar cohortctl) \
      $(addprefix $(BUILD)/examples/,$(EXAMPLES))

# Example trainers are installed as cohort-example-NAME: the name pods run
# (examples/k8s/), which the sandbox maps to build/examples/NAME.
PREFIX  ?= /usr/local
install: bins
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(addprefix $(BUILD)/,cohort-operator cohort-sidecar cohortctl) \
		$(DESTDIR)$(PREFIX)/bin/
	for e in $(EXAMPLES); do \
	    install -m 0755 $(BUILD)/examples/$$e $(DESTDIR)$(PREFIX)/bin/cohort-example-$$e || exit 1; \
	done

# The container image, with Debian's podman (docs/install.md, "The image").
# IMAGE_ARGS go to podman build, e.g. --build-arg RUNTIME_BASE=...
image:
	scripts/image.sh $(IMAGE_ARGS)

# The image's smoke test: skips, saying why, where podman cannot run.
image-test:
	$(PYTHON) -m pytest -q -rs -p no:cacheprovider tests/image

# Tests run against the sanitizer build. halt_on_error keeps a sanitizer
# report from being mistaken for a flaky failure.
export ASAN_OPTIONS  := detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS := print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS  := suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0

# Each stage says how long it took (scripts/stage.sh).
test: deps
	scripts/check-layers.py
	scripts/install-kubectl.sh
	scripts/stage.sh build $(MAKE) -j$$(nproc) asan all
	scripts/stage.sh unit $(MAKE) unit
	scripts/stage.sh proc $(MAKE) proc
	scripts/stage.sh netfault $(MAKE) netfault
	scripts/stage.sh kube $(MAKE) kube
	scripts/stage.sh python $(MAKE) python-test
	scripts/stage.sh image $(MAKE) image-test
	scripts/stage.sh fuzz $(MAKE) -j$$(nproc) fuzz-check

# The pytest suites that run many processes per test (proc, kube,
# python-test) run TEST_JOBS test processes side by side (pytest-xdist):
# a test spends most of its time waiting on its processes, so two of them
# take about two thirds of the time one does on two cores. --dist loadfile
# keeps each file's tests, and its module fixtures, in one process.
# TEST_JOBS=0 runs them one by one in pytest's own process, as does a
# machine without pytest-xdist (scripts/install-deps.sh installs it).
TEST_JOBS ?= 2
PYTEST_PAR = $(PYTHON) -m pytest -q -p no:cacheprovider \
	$(shell $(PYTHON) -c 'import xdist' 2>/dev/null && printf '%s' '-n $(TEST_JOBS) --dist loadfile')

# No folder of src/ includes above the layers its README.md names.
layers:
	scripts/check-layers.py

unit:
	$(ASAN_DIR)/tests/unit --jobs=2

# tests/chaos/test_chaos.py is the short chaos suite: four trials, and two
# with the operator killed in the Kubernetes stand-in, about two minutes on
# two loaded cores.
proc:
	COHORT_BIN=$(CURDIR)/$(ASAN_DIR) $(PYTEST_PAR) tests/proc tests/chaos

# The long chaos trials (tests/chaos/README.md) against the release build:
#   make chaos [TRIALS=100] [SEED=S] [CHAOS_ARGS='--kinds broker --keep']
#   make chaos CHAOS_ARGS='--kinds operator,trainer,pod'   (in the stand-in)
# Each trial prints its seed; `make chaos SEED=S TRIALS=1` replays one.
TRIALS ?= 10
chaos: $(addprefix $(BUILD)/,cohort-operator cohort-sidecar) \
       $(addprefix $(BUILD)/tests/chaos/,$(CHAOS))
	COHORT_BIN=$(CURDIR)/$(BUILD) $(PYTHON) tests/chaos/chaos.py --trials $(TRIALS) \
		$(if $(SEED),--seed $(SEED)) $(CHAOS_ARGS)

# Network faults between hosts in network namespaces (docs/netfault.md):
# needs root, ip and iptables; skipped with the reason elsewhere (-rs).
netfault:
	COHORT_BIN=$(CURDIR)/$(ASAN_DIR) $(PYTHON) -m pytest -q -rsx -p no:cacheprovider tests/netfault

# The API server stand-in and process kubelet, with the real kubectl and
# helm. Its podman tests (test_cluster_podman.py, test_kubelet_podman.py)
# build the image first (scripts/image.sh: seconds when nothing changed,
# 10 to 15 minutes cold), once; image-test then finds it in the cache.
# Skips are listed with their reasons (-rs).
kube:
	COHORT_BIN=$(CURDIR)/$(ASAN_DIR) $(PYTEST_PAR) -rs tests/kube

# A Kubernetes stand-in in the foreground: kubectl works against it.
sandbox: deps
	scripts/install-kubectl.sh
	$(MAKE) -j$$(nproc) all
	$(PYTHON) tests/kube/sandbox.py

demo: deps
	$(MAKE) -j$$(nproc) all
	scripts/demo-run.sh

# The control plane alone: a broker and sidecars, an eviction, a leader change.
demo-membership: deps
	$(MAKE) -j$$(nproc) all
	scripts/demo.sh

bench: deps
	$(MAKE) -j$$(nproc) all
	bench/broker.sh

clean:
	rm -rf $(BUILD)

# ---- fuzzing (tests/fuzz/README.md) -----------------------------------------
# One libFuzzer harness per parser, tests/fuzz/fuzz_NAME.c -> build/fuzz/NAME,
# built with clang against the modules compiled in a tree of their own
# (build/fuzz/obj) with the fuzzer's instrumentation, ASan and UBSan.
#
#   make fuzz [FUZZ_SECONDS=60]  every harness N seconds on its corpus (or
#        [FUZZ_RUNS=N]           N inputs); what it finds goes to
#                                build/fuzz/corpus/NAME, its log to
#                                build/fuzz/logs/NAME.log, crashes to
#                                build/fuzz/crashes/
#   make fuzz-merge              adds what those runs found that covers new
#                                code to the repository's tests/fuzz/corpus
#   make fuzz-check              every harness a few seconds (make test)
#   make fuzz-seeds              rewrites the generated seeds in the corpus
FUZZ_DIR      := $(BUILD)/fuzz
FUZZ_CC       ?= clang
FUZZ_SECONDS  ?= 60
FUZZ_CHECK_SECONDS ?= 3
FUZZ_NAMES    := $(sort $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c)))
FUZZ_BINS     := $(addprefix $(FUZZ_DIR)/,$(FUZZ_NAMES))
FUZZ_SAN      := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS   := $(BASE_CFLAGS) -I$(FUZZ_DIR)/gen -O1 -fno-omit-frame-pointer $(FUZZ_SAN) \
                 -fsanitize=fuzzer-no-link
FUZZ_OBJS     := $(call objs,$(FUZZ_DIR),$(LIB_SRCS)) $(call gen_objs,$(FUZZ_DIR))
# Per harness: inputs no longer than the messages they stand for.
FUZZ_FLAGS_tlink := -max_len=1100
FUZZ_FLAGS_tlink_trainer := -max_len=2048
FUZZ_FLAGS_peerwire := -max_len=1200
FUZZ_FLAGS_avstate := -max_len=400
FUZZ_FLAGS_broker := -max_len=128
FUZZ_FLAGS_reconcile := -max_len=2048
FUZZ_FLAGS_opt := -max_len=256
FUZZ_FLAGS_secret := -max_len=300
FUZZ_FLAGS_ident := -max_len=800
FUZZ_FLAGS_codec := -max_len=16400
# A small quarantine and short allocation stacks: twice the executions a
# second where inputs allocate a lot (cJSON, the broker), with the same
# checks; rerun a crash without them for the full report.
FUZZ_ASAN_OPTIONS := quarantine_size_mb=32:malloc_context_size=8
# The recipes loop over the harnesses in the shell, $$t naming one: this
# sets $$flags to its dictionary and its FUZZ_FLAGS_NAME, and fuzz_run runs
# it with libFuzzer's flags and corpus directories to follow.
fuzz_rparen := )
fuzz_case = $(1)$(fuzz_rparen) flags="$(strip $(if $(wildcard tests/fuzz/$(1).dict),\
            -dict=tests/fuzz/$(1).dict) $(FUZZ_FLAGS_$(1)))";;
fuzz_flags = case $$t in $(foreach n,$(FUZZ_NAMES),$(call fuzz_case,$(n))) esac
fuzz_run = ASAN_OPTIONS=$(ASAN_OPTIONS):$(FUZZ_ASAN_OPTIONS) \
           $(FUZZ_DIR)/$$t -artifact_prefix=$(FUZZ_DIR)/crashes/$$t- -timeout=30 $$flags

$(FUZZ_DIR)/gen/%.pb-c.c $(FUZZ_DIR)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(FUZZ_DIR)/gen
	protoc-c --proto_path=proto --c_out=$(FUZZ_DIR)/gen $<

$(FUZZ_DIR)/obj/%.o: %.c $(call gen_srcs,$(FUZZ_DIR))
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

$(FUZZ_DIR)/obj/gen/%.o: $(FUZZ_DIR)/gen/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -Wno-missing-prototypes -c $< -o $@

$(FUZZ_DIR)/lib/libcohort-fuzz.a: $(FUZZ_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

$(FUZZ_BINS): $(FUZZ_DIR)/%: $(FUZZ_DIR)/obj/tests/fuzz/fuzz_%.o $(FUZZ_DIR)/lib/libcohort-fuzz.a
	$(FUZZ_CC) -fsanitize=fuzzer $(FUZZ_SAN) -o $@ $^ $(LDLIBS)

$(FUZZ_DIR)/seeds: $(FUZZ_DIR)/obj/tests/fuzz/seeds.o $(FUZZ_DIR)/lib/libcohort-fuzz.a
	$(FUZZ_CC) $(FUZZ_SAN) -o $@ $^ $(LDLIBS)

-include $(shell find $(FUZZ_DIR)/obj -name '*.d' 2>/dev/null)

.PHONY: fuzz fuzz-build fuzz-check fuzz-merge fuzz-seeds
fuzz-build: $(FUZZ_BINS)

fuzz: $(FUZZ_BINS)
	@mkdir -p $(FUZZ_DIR)/crashes $(FUZZ_DIR)/logs
	@set -e; for t in $(FUZZ_NAMES); do \
	    mkdir -p $(FUZZ_DIR)/corpus/$$t; \
	    echo "fuzz: $$t, $(if $(FUZZ_RUNS),$(FUZZ_RUNS) inputs,$(FUZZ_SECONDS) s)"; \
	    $(fuzz_flags); $(fuzz_run) -print_final_stats=1 \
	        $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS)) \
	        $(FUZZ_DIR)/corpus/$$t tests/fuzz/corpus/$$t 2>$(FUZZ_DIR)/logs/$$t.log \
	        || { tail -n 60 $(FUZZ_DIR)/logs/$$t.log; exit 1; }; \
	    grep -E '^#[0-9]+[[:space:]]' $(FUZZ_DIR)/logs/$$t.log | tail -n 1; \
	    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' \
	        $(FUZZ_DIR)/logs/$$t.log | tr '\n' ' '; echo; \
	done

fuzz-merge: $(FUZZ_BINS)
	@set -e; for t in $(FUZZ_NAMES); do \
	    mkdir -p $(FUZZ_DIR)/corpus/$$t; \
	    $(fuzz_flags); $(fuzz_run) -merge=1 tests/fuzz/corpus/$$t $(FUZZ_DIR)/corpus/$$t; \
	done

# A few seconds each, from the repository's corpus; new inputs go to a
# scratch directory, so the corpus is only read.
fuzz-check: $(FUZZ_BINS)
	@mkdir -p $(FUZZ_DIR)/crashes
	@set -e; for t in $(FUZZ_NAMES); do \
	    rm -rf $(FUZZ_DIR)/check/$$t; mkdir -p $(FUZZ_DIR)/check/$$t; \
	    echo "fuzz-check: $$t"; \
	    $(fuzz_flags); $(fuzz_run) -max_total_time=$(FUZZ_CHECK_SECONDS) -print_final_stats=1 \
	        $(FUZZ_DIR)/check/$$t tests/fuzz/corpus/$$t 2>$(FUZZ_DIR)/check/$$t.log \
	        || { cat $(FUZZ_DIR)/check/$$t.log; exit 1; }; \
	    grep -E '^stat::number_of_executed_units|^stat::new_units_added' $(FUZZ_DIR)/check/$$t.log \
	        | tr '\n' ' '; echo; \
	done

fuzz-seeds: $(FUZZ_DIR)/seeds
	@mkdir -p tests/fuzz/corpus
	$(FUZZ_DIR)/seeds tests/fuzz/corpus
	$(PYTHON) tests/fuzz/seeds.py tests/fuzz/corpus
