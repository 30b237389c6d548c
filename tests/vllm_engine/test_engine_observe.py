"""The exporter inside a REAL vLLM engine in observe-only mode ("observe" MoEInference: EPLB on,
step interval 10^9 so vLLM never rearranges, ``logBalancedness`` on, no served name), and its
balancedness against the balancedness vLLM itself logs.

"vLLM on CPU with the test bridge"; the rendered args run with the adaptations listed in
test_engine_full.py / harness.py.

Comparing like with like. vLLM's ``log_balancedness`` line (rank 0, every step) is computed from
ONE step's load pass, all-reduced over the EP ranks: per layer the tokens each rank processes,
then ``avg_tokens = sum over layers of mean over ranks``, ``max_tokens = sum over layers of max
over ranks``, ``balancedness = avg_tokens / max_tokens`` -- it sums over layers before comparing
ranks. The exporter's ``moe_eplb_balancedness{layer}`` is ``mean over ranks / max over ranks`` per
layer over a time window, from the rank counters. So:

* for a window holding exactly one engine step, vLLM's three numbers are recomputed from the
  exporter's rank-counter increase (to the printed precision), and the exporter's per-layer gauge
  equals ``mean/max`` of the same increase per layer;
* over many steps only ``avg_tokens`` is additive: the sum of vLLM's logged ``avg_tokens`` equals
  ``sum over layers of mean over ranks`` of the counter increase; a ratio of sums is not a sum of
  ratios, so vLLM's per-step balancedness cannot be compared with a windowed gauge directly.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pytest

from moe_eplb.contracts import metric_names as mn
from moe_eplb_harness.vllm_engine import harness
from moe_eplb_harness.vllm_engine import tiny_model as tm

from .conftest import record_note, record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

L, E, EP = tm.NUM_LAYERS, tm.NUM_EXPERTS, 2
WINDOW_SECONDS = 3.0  # the exporter's balancedness window in this engine


@dataclass
class Observe:
    engine: harness.Engine
    rendered: harness.Rendered


@pytest.fixture(scope="module")
def observe(cpu_wheel, tiny_model, bridge_dir, engine_root):
    work = os.path.join(engine_root, "observe")
    os.makedirs(work, exist_ok=True)
    rendered = harness.render(harness.manifest("observe", {"MOE_EPLB_BALANCEDNESS_WINDOW_SECONDS":
                                                           str(WINDOW_SECONDS)}), work)
    engine = harness.Engine(rendered, tiny_model, bridge_dir, work)
    try:
        engine.start()
        record_time("observe engine: start until /health (s)", engine.ready_seconds)
        engine.complete("warm up", 2)
        engine.wait_exported()[0]
        yield Observe(engine, rendered)
    finally:
        engine.stop()


def _settled_log(engine: harness.Engine, quiet_s: float = 1.0, timeout_s: float = 15.0) -> str:
    """The engine's log once no balancedness line has been added for ``quiet_s`` (the engine is
    idle): vLLM's engine-core process writes a step's line after the step's counters were exported,
    so a log read right after an export can still lack the last step's line."""
    deadline = time.monotonic() + timeout_s
    log = engine.log()
    n, since = len(harness.vllm_balancedness_lines(log)), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        log = engine.log()
        m = len(harness.vllm_balancedness_lines(log))
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return log


def _rank_tokens(s: harness.Samples) -> np.ndarray:
    return s.matrix(mn.RANK_TOKENS, "layer", "rank", (L, EP))


def test_one_step_balancedness_equals_vllms_logged_line(observe):
    engine = observe.engine
    a = engine.wait_exported()[0]
    log_mark = len(_settled_log(engine))
    time.sleep(WINDOW_SECONDS + 0.3)  # let scrape A be the window's baseline
    out = engine.complete("The quick brown fox jumps over the lazy dog, again and again.", 1)
    assert out["usage"]["completion_tokens"] == 1
    b, _ = engine.wait_exported()
    assert b.total(mn.ENGINE_STEPS) - a.total(mn.ENGINE_STEPS) == 1, "one prefill step, nothing else"
    delta = _rank_tokens(b) - _rank_tokens(a)  # [L, EP] tokens each rank processed in that step
    assert delta.sum() > 0
    (line,) = harness.vllm_balancedness_lines(_settled_log(engine)[log_mark:])
    avg = delta.mean(axis=1).sum()
    mx = delta.max(axis=1).sum()
    assert line["avg"] == pytest.approx(round(avg, 2), abs=0.005)
    assert line["max"] == int(mx)
    assert line["balancedness"] == pytest.approx(round(avg / mx, 4), abs=5e-5)
    # the exporter's gauge: the same step, per layer
    for layer in range(L):
        gauge = b.value(mn.BALANCEDNESS, layer=str(layer))
        assert gauge == pytest.approx(delta[layer].mean() / delta[layer].max())
    per_layer = delta.mean(axis=1) / delta.max(axis=1)
    # vLLM's pooled number is a token-weighted mediant of the per-layer values: never below the worst
    assert per_layer.min() - 1e-9 <= avg / mx <= per_layer.max() + 1e-9
    record_note("observe: one prefill step", f"vLLM logged balancedness {line['balancedness']:.4f} "
                f"(avg_tokens {line['avg']:.2f}, max_tokens {line['max']}); exporter per layer "
                f"{', '.join(f'{x:.4f}' for x in per_layer)}")


def test_many_steps_vllm_avg_tokens_add_up_to_the_rank_counters(observe):
    engine = observe.engine
    a = engine.wait_exported()[0]
    log_mark = len(_settled_log(engine))
    t0 = time.monotonic()
    harness.workload(engine, rounds=1, max_tokens=16, concurrency=4)
    record_time("observe engine: workload (8 requests x 16 tokens)", time.monotonic() - t0)
    b = engine.wait_exported()[0]
    steps = b.total(mn.ENGINE_STEPS) - a.total(mn.ENGINE_STEPS)
    lines = harness.vllm_balancedness_lines(_settled_log(engine)[log_mark:])
    assert len(lines) == steps > 16  # vLLM logs every step (log_balancedness_interval 1)
    delta = _rank_tokens(b) - _rank_tokens(a)
    logged_avg = sum(x["avg"] for x in lines)
    assert logged_avg == pytest.approx(delta.mean(axis=1).sum(), abs=0.005 * len(lines))
    # max is not additive: the sum of per-step maxima is at least the maximum of the sums
    assert sum(x["max"] for x in lines) >= delta.max(axis=1).sum()


def test_observe_only_counts_load_and_never_rearranges(observe):
    engine = observe.engine
    s = engine.wait_exported()[0]
    assert s.total(mn.EXPERT_TOKENS) > 0
    assert s.total(mn.REARRANGEMENTS) == 0 and "Rearranging experts" not in engine.log()
    replicas = s.matrix(mn.EXPERT_REPLICAS, "layer", "expert", (L, E))
    np.testing.assert_array_equal(replicas, np.ones((L, E)))
    (labels, _), = s.select(mn.CONFIG_INFO)
    assert labels["step_interval"] == "1000000000" and labels["num_redundant_experts"] == "0"
    expert = s.matrix(mn.EXPERT_TOKENS, "layer", "expert", (L, E))
    np.testing.assert_array_equal(expert.sum(axis=1), _rank_tokens(s).sum(axis=1))


def test_without_served_name_model_name_is_the_model_path(observe):
    engine = observe.engine
    assert "--served-model-name" not in observe.rendered.container["args"]
    s = engine.wait_exported()[0]
    vllm = harness.Samples(engine.vllm_metrics_text())
    ours = {lab[mn.LABEL_MODEL] for _, lab, _ in s.samples}
    theirs = {lab["model_name"] for _, lab, _ in vllm.samples if "model_name" in lab}
    assert ours == theirs == {engine.model_dir}
