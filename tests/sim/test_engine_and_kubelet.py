"""The simulation parts the autotune scenarios and the demo stand on: the simulated engine's EPLB
replay (checked against the project's simulator), its metrics (read back with the load reader's
parser), and the fake kubelet's reading of the rendered pod template."""

from __future__ import annotations

import asyncio
import copy
import urllib.request

import aiohttp
import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.api.spec import OperatorDefaults, parse
from moe_eplb.eplb.replay.simulator import simulate
from moe_eplb.eplb.workload import synth
from moe_eplb.render.objects import render_children
from moe_eplb_harness.engines.engine import (
    EngineFaults,
    EngineRun,
    EngineSettings,
    SimClock,
    SimulatedEngine,
    SimulatedEplb,
)
from tests.autotune.conftest import RESOURCE


@pytest.fixture(scope="module")
def small_trace():
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=0.5,
                          bucket_seconds=15, seed=2, shift_at=0.5)


def _replay_balancedness(trace, settings: EngineSettings, faults: EngineFaults | None = None) -> tuple[float, int]:
    rp = SimulatedEplb(trace.num_layers, trace.num_experts, settings, faults or EngineFaults())
    num = den = 0.0
    for t in range(trace.num_buckets):
        rank = rp.run(trace.load[t], int(trace.bucket_steps[t]))
        num += rank.mean(axis=1).sum()
        den += rank.max(axis=1).sum()
    return num / den, rp.rearrangements


@pytest.mark.parametrize("w,i,r", [(1000, 3000, 0), (250, 500, 4), (4000, 1000, 8)])
def test_engine_replay_agrees_with_simulator(small_trace, w, i, r):
    sim = simulate(small_trace, ep_size=4, window_size=w, step_interval=i, num_redundant_experts=r)
    got, rearrangements = _replay_balancedness(
        small_trace, EngineSettings("m", ep_size=4, knobs=Knobs(w, i, r)))
    assert rearrangements == sim.rearrangements
    assert got == pytest.approx(sim.balancedness, abs=0.01)


def test_settings_change_what_the_engine_reports(small_trace):
    untuned, _ = _replay_balancedness(small_trace, EngineSettings("m", ep_size=4))
    tuned, _ = _replay_balancedness(small_trace, EngineSettings("m", ep_size=4, knobs=Knobs(250, 500, 4)))
    broken, _ = _replay_balancedness(small_trace, EngineSettings("m", ep_size=4, knobs=Knobs(250, 500, 4)),
                                     EngineFaults(clustered_placement=True))
    assert tuned > untuned + 0.05
    assert broken < untuned


def test_indivisible_redundancy_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        SimulatedEplb(4, 16, EngineSettings("m", ep_size=4, knobs=Knobs(1000, 3000, 3)))


@pytest.mark.integration
async def test_engine_serves_exporter_metrics_after_startup(small_trace):
    from moe_eplb.metrics.scrape import parse_exposition

    clock = SimClock.started_now(scale=200.0)
    eng = SimulatedEngine(small_trace, EngineSettings("example/tiny-moe", ep_size=4, share=0.5), clock,
                          EngineRun(startup_seconds=40.0, tick=0.02))
    port = await eng.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503  # still "loading the model"
            await asyncio.sleep(0.6)  # 120 simulated seconds
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200
        # read with a blocking call on the loop (the pod's server thread answers): the replay, a
        # task of this loop, cannot advance between the scrape and the comparison below
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        sample = parse_exposition(text)
        tokens = sample.tokens["example/tiny-moe"]
        assert len(tokens) == 4 * 16
        total = sum(tokens.values())
        assert total == pytest.approx(eng.expert_tokens.sum())
        assert total > 0
        assert sample.steps["example/tiny-moe"] == eng.replay.steps > 0
        assert "moe_eplb_rank_tokens_total{" in text and "moe_eplb_config_info{" in text
        # tokens per rank add up to tokens per expert (each token counted once per top-k slot)
        assert eng.rank_tokens.sum() == pytest.approx(eng.expert_tokens.sum())
    finally:
        await eng.stop()


@pytest.mark.integration
async def test_pods_answer_while_the_event_loop_is_blocked(small_trace):
    """The pods' /metrics and /health are served by threads, not by the event loop the simulated
    cluster shares: a scrape is answered while the loop is busy (here blocked by a synchronous call
    on it), so a backlog of the loop's work no longer turns into Prometheus scrape gaps."""
    clock = SimClock.started_now(scale=200.0)
    eng = SimulatedEngine(small_trace, EngineSettings("example/tiny-moe", ep_size=4, share=0.5), clock,
                          EngineRun(startup_seconds=0.0, tick=0.02, pods=2))
    await eng.start()
    try:
        await asyncio.sleep(0.2)
        assert eng.ready

        def get(port: int, path: str) -> tuple[int, bytes]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return r.status, r.read()
        # blocking calls on the loop's own thread: the old aiohttp servers could not answer them
        for port in eng.ports:
            assert get(port, "/health") == (200, b"ok")
            status, body = get(port, "/metrics")
            assert status == 200 and b"moe_eplb_expert_tokens_total{" in body
        assert body == eng.exposition(1)  # the replay is not advancing: the loop is blocked here
        assert len(eng.ports) == 2 and eng.ports[0] != eng.ports[1]
    finally:
        await eng.stop()
    with pytest.raises(OSError):  # stop() closes the servers
        urllib.request.urlopen(f"http://127.0.0.1:{eng.ports[0]}/health", timeout=5)


def test_kubelet_reads_the_rendered_pod_template():
    from moe_eplb_harness.floor.pods import engine_settings

    res = copy.deepcopy(RESOURCE)
    res["spec"]["eplb"].update(windowSize=2000, stepInterval=4000, numRedundantExperts=4)
    res["metadata"]["generation"] = 1
    deps = [c for c in render_children_of(res) if c["kind"] == "Deployment"]
    assert len(deps) == 1
    s = engine_settings(deps[0]["spec"]["template"]["spec"], share=0.5)
    assert (s.model, s.ep_size, s.knobs, s.num_redundant_experts, s.eplb_enabled) == \
        ("example/tiny-moe", 4, Knobs(2000, 4000, 4), 4, True)
    assert s.share == 0.5


def test_default_prometheus_url_fills_only_an_empty_spec_url():
    res = copy.deepcopy(RESOURCE)
    res["spec"].pop("monitoring", None)
    inf = parse(res)
    prom = OperatorDefaults(prometheus_url="http://prom:9090")
    assert inf.prometheus_url is None
    assert inf.with_operator_defaults(prom).prometheus_url == "http://prom:9090"
    assert inf.with_operator_defaults(OperatorDefaults()) is inf
    res["spec"]["monitoring"] = {"prometheusUrl": "http://mine:9090"}
    assert parse(res).with_operator_defaults(prom).prometheus_url == "http://mine:9090"
    res["spec"]["monitoring"] = {"prometheusUrl": ""}
    assert parse(res).with_operator_defaults(OperatorDefaults()).prometheus_url is None


def render_children_of(resource):
    """``render_children`` of a resource dict (parsed once)."""
    return render_children(parse(resource))


def test_a_stalled_engine_steps_without_rearranging(small_trace):
    """EngineFaults(rearrangement_stalled): EPLB on, steps go on, no rearrangement (the stall alert's case)."""
    settings = EngineSettings("m", ep_size=4, knobs=Knobs(250, 500, 4))
    healthy = SimulatedEplb(small_trace.num_layers, small_trace.num_experts, settings)
    stalled = SimulatedEplb(small_trace.num_layers, small_trace.num_experts, settings,
                            EngineFaults(rearrangement_stalled=True))
    for t in range(small_trace.num_buckets):
        healthy.run(small_trace.load[t], int(small_trace.bucket_steps[t]))
        stalled.run(small_trace.load[t], int(small_trace.bucket_steps[t]))
    assert stalled.steps == healthy.steps > 10 * 500
    assert healthy.rearrangements > 10 and stalled.rearrangements == 0


@pytest.mark.integration
async def test_with_an_api_port_vllm_series_leave_the_exporter_port(small_trace):
    """With pod IPs and ``api_port`` (a node agent's ``api_ports``), vLLM's own series are served on
    the API port only and the exporter's on the exporter port only, as a real pod serves them."""
    from moe_eplb_harness.engines.engine import split_exposition
    from moe_eplb_harness.floor.procs import free_port

    clock = SimClock.started_now(scale=200.0)
    port, api_port = free_port(), free_port()
    eng = SimulatedEngine(small_trace, EngineSettings("example/tiny-moe", ep_size=4), clock,
                          EngineRun(startup_seconds=0.0, tick=0.02, port=port, hosts=("127.0.0.1",), api_port=api_port))
    await eng.start()
    try:
        await asyncio.sleep(0.2)
        texts = {}
        for p in (port, api_port):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=30) as r:
                texts[p] = r.read().decode()
        series = {p: {line.split("{")[0].split(" ")[0] for line in t.splitlines() if line and not line.startswith("#")}
                  for p, t in texts.items()}
        assert series[api_port] and all(s.startswith("vllm:") for s in series[api_port])
        assert "moe_eplb_config_info" in series[port] and not any(s.startswith("vllm:") for s in series[port])
    finally:
        await eng.stop()
    both = b"# HELP vllm:a x\n# TYPE vllm:a gauge\nvllm:a 1\n# HELP moe_b y\nmoe_b 2\n"
    assert split_exposition(both, vllm=True) == b"# HELP vllm:a x\n# TYPE vllm:a gauge\nvllm:a 1\n"
    assert split_exposition(both, vllm=False) == b"# HELP moe_b y\nmoe_b 2\n"
