#!/usr/bin/env bash
# The closed autotune loop with ONE REAL vLLM engine as the pod, CPU only ("vLLM on CPU with the
# test bridge"): the simulated cluster of `moe-eplb demo` (emulated API, fake kubelet, a real
# Prometheus, the real operator with autotune Apply) on the real clock, whose one pod is a real
# `vllm serve` (vLLM 0.32.0 CPU wheel, tiny Qwen3-MoE, TP 2 = EP 2, sync EPLB) started from the args
# the operator rendered; the tuner's change restarts it with the new --eplb-config and the judge
# reads its real counters. Prints progress, then as its LAST line one JSON object
# (see harness/moe_eplb_harness/vllm_engine/closed_loop.py).
#
#   bash scripts/demo_vllm_cpu.sh [--workdir DIR] [--keep] [--timeout S]
#
# Python: $PYTHON if set, else .venv/bin/python when it already has the engine's packages, else
# `make setup-vllm` first. Needs the `prometheus` binary (Debian package prometheus). Offline.
# About 4 minutes on two cores; gives up after --timeout (default 600 s).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/vllm_cpu_env.sh
vllm_cpu_env demo-vllm-cpu "kopf, kmock"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 900 "$PY" -m moe_eplb_harness.vllm_engine.closed_loop "$@"
