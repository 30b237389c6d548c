#!/usr/bin/env bash
# GPU smoke test of the moe-eplb exporter, for a one-GPU lease (no internet on that machine).
#
#   bash scripts/gpu_smoke.sh            # from the repository root; results under $OUT/gpu_smoke
#
# The device machine has no internet: if its Python lacks prometheus-client (pure Python), carry the
# dev venv's copy, e.g. with the device tool:
#   run(command="bash scripts/gpu_smoke.sh", timeout_s=480,
#       carry=[".venv/lib/python3.11/site-packages/prometheus_client"])
# The script puts such a carried package (and nothing else of the venv) on PYTHONPATH.
#
# Time-boxed (< 8 min in total); every stage reports PASS, FAIL or SKIP (with the reason) in
# $OUT/gpu_smoke/summary.txt and the exit status is 1 only if a stage that could run FAILED.
#
# Stages
#  1. env      nvidia-smi, a Python with CUDA torch (system python3, or $PYTHON), vLLM if installed.
#  2. cuda     the exporter's worker path on real CUDA tensors (pinned-memory read-back, CUDA events,
#              nothing synchronising the step loop) against a vLLM-0.32-layout EPLB state: counts must
#              equal the known load exactly; then bench/bench_exporter.py --device cuda (per-step cost).
#  3. server   if vLLM (CUDA build) is installed and a small MoE model is on local disk
#              ($MODEL or the first MoE config found under $MODEL_DIRS / the HF cache): `vllm serve` on
#              one GPU with VLLM_PLUGINS=moe_eplb_exporter; checks the API server comes up, answers a
#              completion, and the exporter serves /metrics on its port from the server process.
#              (EPLB itself needs EP size > 1, i.e. 2+ GPUs: on one GPU no expert series appear;
#              the stage proves the plugin loads in vLLM's real process tree without breaking it.)
set -u
OUT="${OUT:-/tmp/out}"
RES="$OUT/gpu_smoke"
mkdir -p "$RES"
SUMMARY="$RES/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
FAILED=0
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
# a carried pure-Python prometheus_client (never the venv's torch or numpy: they would shadow CUDA's)
for d in "$ROOT"/.venv/lib/python3*/site-packages/prometheus_client; do
  if [ -d "$d" ]; then
    PYLIB="$(mktemp -d)" && ln -sfn "$d" "$PYLIB/prometheus_client"
    export PYTHONPATH="$PYTHONPATH:$PYLIB"
    break
  fi
done

say() { echo "[gpu_smoke $(($(date +%s) - START))s] $*"; }
result() { echo "$1 $2: $3" | tee -a "$SUMMARY"; [ "$1" = FAIL ] && FAILED=1; return 0; }

# ---- 1. environment -------------------------------------------------------------------------------
say "environment"
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1 || true
PY=""
for cand in ${PYTHON:-} python3 python "$ROOT/.venv/bin/python"; do
  [ -n "$cand" ] || continue
  command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
  if timeout 60 "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  result SKIP env "no Python with CUDA torch found (tried \$PYTHON, python3, python, .venv); nothing to test"
  exit 0
fi
"$PY" - > "$RES/env.txt" 2>&1 <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0))
for m in ("numpy", "prometheus_client", "vllm"):
    try:
        mod = __import__(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING", type(e).__name__, e)
PYEOF
result PASS env "$(head -1 "$RES/env.txt")"
if ! "$PY" -c "import numpy, prometheus_client" >/dev/null 2>&1; then
  result SKIP cuda "numpy/prometheus_client missing for $PY (pip has no internet here)"
else
# ---- 2. exporter worker path on CUDA --------------------------------------------------------------
say "cuda: recorder on CUDA tensors"
if timeout 180 "$PY" - > "$RES/cuda.txt" 2>&1 <<'PYEOF'
import time, types, numpy as np, torch, sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from bench_exporter import make_state_class
from moe_eplb.exporter import hook
from moe_eplb.exporter.recorder import StateRecorder
dev = torch.device("cuda")
L, E, R, EP = 58, 256, 32, 32
cls = make_state_class(torch, L, E, R, dev)
recs = []
def factory(state, layout):
    r = StateRecorder(state, layout, None, flush_seconds=0.05, ep_info=lambda: (0, EP)); recs.append(r); return r
assert hook.patch_eplb_state(cls, factory)
st = cls()
ms = st.model_states["h"]
rng = np.random.default_rng(0)
expected = np.zeros((L, E)); expected_rank = np.zeros((L, EP))
p2l = ms.physical_to_logical_map.cpu().numpy()
t_steps = []
for i in range(600):
    load = rng.integers(0, 50, size=(L, E + R)).astype(np.int32)
    ms.expert_load_pass.copy_(torch.from_numpy(load).to(dev, non_blocking=True))
    for l in range(L):
        np.add.at(expected[l], p2l[l], load[l])
    expected_rank += load.reshape(L, EP, -1).sum(axis=2)
    t0 = time.perf_counter(); st.step(); t_steps.append(time.perf_counter() - t0)
    if i % 100 == 99:
        time.sleep(0.06)  # let a read-back complete asynchronously
rec = recs[0]
assert bool(st.should_record_tensor.item()), "recording flag not kept on"
assert int(ms.expert_load_pass.abs().sum().item()) == 0, "pass not cleared after the step"
rec.flush_now()
m = rec.models[0]
assert np.array_equal(m.expert_tokens, expected), "expert tokens differ from the known load"
assert np.array_equal(m.rank_tokens, expected_rank), "rank tokens differ"
assert m.steps == 600
print("exact counts over 600 CUDA steps; per-step host time median %.1f us, p99 %.1f us"
      % (np.median(t_steps) * 1e6, np.percentile(t_steps, 99) * 1e6))
PYEOF
then result PASS cuda "$(tail -1 "$RES/cuda.txt")"
else result FAIL cuda "see cuda.txt: $(tail -3 "$RES/cuda.txt" | tr '\n' ' ')"; fi
say "cuda: bench"
if timeout 120 "$PY" bench/bench_exporter.py --device cuda --steps 3000 > "$RES/bench_cuda.txt" 2>&1; then
  result PASS bench "$(grep 'per engine step, median' "$RES/bench_cuda.txt" | tr -s ' ')"
else result FAIL bench "see bench_cuda.txt: $(tail -2 "$RES/bench_cuda.txt" | tr '\n' ' ')"; fi
fi

# ---- 3. a real vLLM server with the plugin ---------------------------------------------------------
say "server: looking for vLLM and a local MoE model"
if ! timeout 120 "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  result SKIP server "vLLM (CUDA build) not installed for $PY"
else
  MODEL_PATH="${MODEL:-}"
  if [ -z "$MODEL_PATH" ]; then
    MODEL_PATH=$(timeout 60 "$PY" - <<'PYEOF'
import glob, json, os
roots = [p for p in os.environ.get("MODEL_DIRS", "").split(":") if p] + [
    os.path.expanduser("~/.cache/huggingface/hub"), "/models", "/data/models", "/root/models", "/mnt/models"]
best = None
for root in roots:
    for cfg in glob.glob(os.path.join(root, "**", "config.json"), recursive=True):
        try:
            c = json.load(open(cfg))
        except Exception:
            continue
        c = c.get("text_config", c)
        if not any(c.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            continue
        d = os.path.dirname(cfg)
        size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(d, "*.safetensors")))
        if size and (best is None or size < best[0]):
            best = (size, d)
print(best[1] if best else "")
PYEOF
)
  fi
  if [ -z "$MODEL_PATH" ]; then
    result SKIP server "no MoE model on local disk (set MODEL=/path or MODEL_DIRS); the machine has no internet"
  else
    PORT=8765; EPORT=9400
    say "server: vllm serve $MODEL_PATH"
    ( export VLLM_PLUGINS=moe_eplb_exporter MOE_EPLB_EXPORTER_PORT=$EPORT HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
      exec timeout 330 "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_PATH" --port $PORT \
        --max-model-len 2048 --gpu-memory-utilization 0.85 --enforce-eager --trust-remote-code ) \
      > "$RES/vllm_server.log" 2>&1 &
    SPID=$!
    ok=""
    for _ in $(seq 1 300); do
      if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then ok=1; break; fi
      kill -0 $SPID 2>/dev/null || break
      sleep 1
    done
    if [ -z "$ok" ]; then
      result FAIL server "vLLM did not become healthy; see vllm_server.log: $(grep -m3 -iE 'error|moe-eplb' "$RES/vllm_server.log" | tr '\n' ' ')"
    else
      curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL_PATH\", \"prompt\": \"Mixture of experts are\", \"max_tokens\": 16}" \
        > "$RES/completion.json" 2>&1
      curl -sf -H 'Accept: application/openmetrics-text;version=1.0.0' -D "$RES/exporter_headers.txt" \
        "http://127.0.0.1:$EPORT/metrics" > "$RES/exporter_metrics.txt" 2>&1
      ecode=$?
      curl -sf "http://127.0.0.1:$PORT/metrics" > "$RES/vllm_metrics.txt" 2>&1
      if [ $ecode -eq 0 ] && grep -qi "text/plain; version=0.0.4" "$RES/exporter_headers.txt" \
         && grep -q '"choices"' "$RES/completion.json" && grep -q "moe-eplb exporter: serving" "$RES/vllm_server.log"; then
        result PASS server "vLLM served a completion with the plugin loaded; exporter on :$EPORT answered $(grep -vc '^#' "$RES/exporter_metrics.txt") series (0 expected without EPLB on one GPU)"
      else
        result FAIL server "exporter/completion check failed (curl $ecode); see vllm_server.log, exporter_headers.txt"
      fi
    fi
    kill $SPID 2>/dev/null; sleep 2; kill -9 $SPID 2>/dev/null; wait $SPID 2>/dev/null
  fi
fi
say "done"
cat "$SUMMARY"
exit $FAILED
