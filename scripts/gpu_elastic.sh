#!/usr/bin/env bash
# GPU run of an elastic wide-EP resize (issue 39): vLLM >= 0.33's external elastic EP, driven the way the
# operator drives it (the product's own relay and the operator's reading of it), on one machine with
# >= 3 GPUs. A sibling of scripts/gpu_smoke.sh; NOT RUN YET (no machine with several GPUs was lent):
# the first run on GPUs is what it is for.
#
#   MODEL=/models/DeepSeek-V2-Lite bash scripts/gpu_elastic.sh     # results under $OUT/gpu_elastic
#
# What it does (time-boxed; every stage PASS, FAIL or SKIP with the reason in summary.txt):
#  1. env     nvidia-smi, a Python with CUDA torch and vLLM >= 0.33, >= 3 GPUs, a local MoE model ($MODEL).
#  2. launch  the founding ranks 0-1 as `moe-eplb render` renders them (one rank a "pod": --data-parallel-rank,
#             --enable-elastic-ep, --elastic-ep-max-dp-size N, sync EPLB), each on its own GPU and port;
#             waits for /health and one completion on each.
#  3. grow    starts rank 2 .. N-1 as the operator's joining pods (VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1,
#             --data-parallel-size N), asks every old rank through moe_eplb.exporter.elastic_relay, follows
#             vLLM's phases with moe_eplb.controller.elastic.rank_report until every old rank answered,
#             with completions sent all the while; records the timeline (phase, seconds, served/refused).
#  4. shrink  back to 2 ranks the same way, then stops the retired ranks' processes.
set -u
OUT="${OUT:-/tmp/out}"
RES="$OUT/gpu_elastic"
mkdir -p "$RES"
SUMMARY="$RES/summary.txt"
: > "$SUMMARY"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "[gpu_elastic] $*"; }
result() { echo "$1 $2: $3" | tee -a "$SUMMARY"; }

nvidia-smi > "$RES/nvidia-smi.txt" 2>&1 || true
PY=""
for cand in ${PYTHON:-} python3 python; do
  command -v "$cand" >/dev/null 2>&1 || continue
  if timeout 120 "$cand" -c "import torch, vllm, sys; v = tuple(int(x) for x in vllm.__version__.split('.')[:2]); \
sys.exit(0 if torch.cuda.device_count() >= 3 and v >= (0, 33) else 1)" >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  result SKIP env "needs a Python with CUDA torch, vLLM >= 0.33 and >= 3 GPUs"; exit 0
fi
if [ -z "${MODEL:-}" ] || [ ! -e "${MODEL}/config.json" ]; then
  result SKIP env "set MODEL to a local MoE checkpoint directory (e.g. DeepSeek-V2-Lite, Qwen1.5-MoE-A2.7B)"; exit 0
fi
result PASS env "$($PY -c 'import vllm, torch; print("vLLM", vllm.__version__, "GPUs", torch.cuda.device_count())')"

timeout 1500 "$PY" - "$RES" "$MODEL" <<'EOF' 2>&1 | tee "$RES/run.log"
import json, os, signal, subprocess, sys, threading, time, urllib.error, urllib.request

from moe_eplb.api.spec import parse
from moe_eplb.controller.elastic import rank_report
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.exporter.elastic_relay import ElasticRelay
from moe_eplb.render.elastic import joiner_args
from moe_eplb.render.engine_args import engine_args

res_dir, model = sys.argv[1], sys.argv[2]
import torch
gpus = torch.cuda.device_count()
n = min(gpus, 4)
cfg = json.load(open(os.path.join(model, "config.json")))
experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
spec = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "gpu", "namespace": "default"},
        "spec": {"model": {"name": model, "architecture": cfg["architectures"][0],
                           "moe": {"numExperts": experts, "numMoeLayers": cfg.get("num_hidden_layers", 1),
                                   "topK": cfg.get("num_experts_per_tok", 2)}},
                 "engine": {"image": "vllm/vllm-openai:v0.34.0", "maxModelLen": 2048, "drainSeconds": 0,
                            "gpuMemoryUtilization": 0.85},
                 "parallelism": {"tensor": 1, "data": 2, "nodes": 2, "elastic": {"enabled": True, "maxData": n}},
                 "replicas": 2, "eplb": {"enabled": True, "windowSize": 1000, "stepInterval": 3000}}}
inf = parse(spec)
procs, timeline = {}, []
PORT = 8100


def argv_of(rank: int, size: int, joiner: bool) -> list[str]:
    args = joiner_args(inf, inf.effective, size) if joiner else engine_args(inf, inf.effective) + [
        "--data-parallel-size-local", "1", "--data-parallel-rpc-port", "13345", "--data-parallel-address", "127.0.0.1"]
    args = ["127.0.0.1" if a.endswith(".gpu") or a == "gpu-0.gpu" else a for a in args]
    args[args.index("--port") + 1] = str(PORT + rank)
    return ["vllm", "serve", *args, "--data-parallel-rank", str(rank)]


def start(rank: int, size: int, joiner: bool) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(rank))
    if joiner:
        env["VLLM_ELASTIC_EP_SCALE_UP_LAUNCH"] = "1"
    log = open(os.path.join(res_dir, f"rank{rank}.log"), "w")
    procs[rank] = subprocess.Popen(argv_of(rank, size, joiner), env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)


def get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def complete(rank: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT + rank}/v1/completions", method="POST",
                                 data=json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


answers: list[tuple[float, int, int]] = []
stop = threading.Event()


def load(ranks) -> None:
    while not stop.is_set():
        for r in list(ranks):
            answers.append((time.time(), r, complete(r)))


def resize(old: list[int], target: int, op: str) -> bool:
    relays = [ElasticRelay((f"http://127.0.0.1:{PORT + r}",)) for r in old]
    t0, seen = time.time(), None
    for r in relays:
        r.scale({"op": op, "new_data_parallel_size": target, "drain_timeout": 120})
    while time.time() - t0 < 1200:
        reports = [rank_report(r.status(), op) for r in relays]
        if reports[0].phase != seen:
            seen = reports[0].phase
            timeline.append({"op": op, "t": round(time.time() - t0, 2), "phase": seen, "epoch": reports[0].epoch})
        if all(x.op_state == plan.DONE for x in reports):
            codes = sorted({x.op_code for x in reports})
            timeline.append({"op": op, "t": round(time.time() - t0, 2), "done": codes,
                             "detail": [x.op_detail for x in reports if x.op_code != 200]})
            return codes == [200]
        time.sleep(0.5)
    return False


ok = True
try:
    for r in (0, 1):
        start(r, 2, False)
    t0 = time.time()
    while time.time() - t0 < 900 and not all(get(f"http://127.0.0.1:{PORT + r}/health") == 200 for r in (0, 1)):
        time.sleep(2)
    launched = [complete(r) for r in (0, 1)]
    print("LAUNCH", launched, round(time.time() - t0, 1), "s", flush=True)
    ok = launched == [200, 200]
    serving = [0, 1]
    threading.Thread(target=load, args=(serving,), daemon=True).start()
    for r in range(2, n):
        start(r, n, True)
    time.sleep(5)
    grown = resize([0, 1], n, "gpu-grow")
    serving[:] = list(range(n))
    time.sleep(5)
    print("GROW", grown, [complete(r) for r in range(n)], flush=True)
    shrunk = resize(list(range(n)), 2, "gpu-shrink")
    serving[:] = [0, 1]
    print("SHRINK", shrunk, [complete(r) for r in (0, 1)], flush=True)
    ok = ok and grown and shrunk
finally:
    stop.set()
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    json.dump({"timeline": timeline, "answers": answers}, open(os.path.join(res_dir, "timeline.json"), "w"))
print("RESULT", "PASS" if ok else "FAIL", flush=True)
EOF
if grep -q "^RESULT PASS" "$RES/run.log"; then
  result PASS resize "grow 2 -> N and shrink back through the relays (timeline.json)"
else
  result FAIL resize "see run.log and rank*.log"
fi
