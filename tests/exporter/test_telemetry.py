"""Served model name, step telemetry, KV-cache size and idle flush: against
vLLM 0.32's REAL ``EplbState`` (``add_model``, ``prepare_forward``, ``step``) from the CPU wheel.
The same properties are checked inside a serving engine by tests/vllm_engine/; the parts that need no
vLLM are in test_pod_series.py."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from moe_eplb.contracts import metric_names
from moe_eplb.exporter import hook
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.recorder import IDLE_GAP_SECONDS, SnapshotWriter, StateRecorder, kv_cache_bytes
from tests.exporter.exporter_helpers import StandInModelConfig, logical_counts, make_moe_model, route, vllm_world


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _install(es, **kw):
    recs = []

    def factory(state, layout):
        rec = StateRecorder(state, layout, kw.get("writer"), flush_seconds=kw.get("flush_seconds", 1e9),
                            clock=kw.get("clock", time.monotonic), idle_flush=kw.get("idle_flush", False))
        recs.append(rec)
        return rec

    assert hook.patch_eplb_state(es.EplbState, factory)
    return recs


def _model_config(model, served, tag=""):
    """What EplbState.add_model reads of a ModelConfig (exporter_helpers.StandInModelConfig)."""
    return StandInModelConfig(model, served, tag=tag)


def _state(es, L=2, E=4, R=0, interval=10**6, models=(("org/tiny", "tiny-served", None),)):
    import torch
    from vllm.config import ParallelConfig, set_current_vllm_config

    vc = vllm_world()
    pc = ParallelConfig()
    pc.eplb_config.window_size = 4
    pc.eplb_config.step_interval = interval
    pc.eplb_config.num_redundant_experts = R
    pc.eplb_config.use_async = False
    pc.eplb_config.communicator = "torch_gloo"
    state = es.EplbState(pc, torch.device("cpu"))
    out = []
    with set_current_vllm_config(vc):
        for i, (path, served, eplb_name) in enumerate(models):
            model = make_moe_model(L, E, R)
            mc = _model_config(path, served, tag=str(i))
            if eplb_name is None:
                state.add_model(model, mc)
            else:
                state.add_model(model, mc, model_name=eplb_name)
            out.append((model, mc))
    return state, out


pytestmark = pytest.mark.vllm


def test_model_name_is_the_served_name_not_the_path(real_eplb):
    recs = _install(real_eplb)
    state, [(model, mc)] = _state(real_eplb)
    route(model, np.zeros((2, 3, 2), np.int64))
    state.step()
    (rec,) = recs
    assert [m.handle.name for m in rec.models] == ["tiny-served"]
    # vLLM's own EPLB state still calls the model by its path (its log line); only the label changes
    assert next(iter(state.model_states.values())).model_name == "org/tiny"
    assert rec.snapshot().models[0].name == "tiny-served"


def test_without_served_name_vllm_falls_back_to_the_path(real_eplb):
    recs = _install(real_eplb)
    # vLLM resolves an unset --served-model-name to the model path (ModelConfig.served_model_name)
    state, [(model, _)] = _state(real_eplb, models=(("/models/tiny", "/models/tiny", None),))
    state.step()
    assert recs[0].models[0].handle.name == "/models/tiny"


def test_drafter_is_named_after_the_served_main_model(real_eplb):
    recs = _install(real_eplb)
    # vLLM 0.32 registers the drafter first, under model_name "<draft path> (draft)"
    state, _ = _state(real_eplb, models=(("org/draft", "org/draft", "org/draft (draft)"),
                                         ("org/main", "main-served", None)))
    state.step()
    assert sorted(m.handle.name for m in recs[0].models) == ["main-served", "main-served (draft)"]


def test_step_tokens_come_from_prepare_forward_and_match_the_load(real_eplb):
    clock = FakeClock()
    recs = _install(real_eplb, clock=clock)
    state, [(model, mc)] = _state(real_eplb)
    rng = np.random.default_rng(0)
    tokens_per_step = [5, 1, 0, 17, 64]  # 0: a dummy step (no forward)
    total = np.zeros((2, 4))
    for n in tokens_per_step:
        dummy = n == 0
        if not dummy:
            state.prepare_forward(mc, n)
            clock.t += 0.004  # forward
            ids = rng.integers(0, 4, size=(2, n, 2))
            route(model, ids)
            total += logical_counts(ids, 4)
        clock.t += 0.001
        state.step(is_dummy=dummy)
        clock.t += 0.002  # sampling, scheduling: part of the next step
    (rec,) = recs
    rec.flush_now()
    (m,) = rec.models
    assert m.step_tokens_sum == sum(tokens_per_step)
    # tokens x top_k = the load this rank routed in every MoE layer
    assert m.step_tokens_sum * 2 == total[0].sum() == m.rank_tokens[0].sum()
    expected = np.zeros(len(metric_names.STEP_TOKENS_BUCKETS) + 1, np.int64)
    for n in tokens_per_step:
        expected[np.searchsorted(metric_names.STEP_TOKENS_BUCKETS, n, side="left")] += 1
    np.testing.assert_array_equal(m.step_tokens_buckets, expected)
    assert int(m.step_seconds_buckets.sum()) == len(tokens_per_step) == m.steps


def test_step_duration_spans_step_ends_and_excludes_idle_waits(real_eplb):
    clock = FakeClock()
    recs = _install(real_eplb, clock=clock)
    state, [(model, mc)] = _state(real_eplb)

    def one_step(forward=0.010, rest=0.003):
        state.prepare_forward(mc, 4)
        clock.t += forward
        state.step()
        clock.t += rest  # sampling + scheduling of the next step, before its forward starts

    one_step()  # first step: timed from its forward's start: 0.010
    one_step()  # 0.003 + 0.010 since the previous step's end
    one_step()
    clock.t += IDLE_GAP_SECONDS + 5.0  # the engine waits for a request
    one_step()  # timed from its own forward start: 0.010, not 5 s
    (m,) = recs[0].models
    assert m.step_seconds_sum == pytest.approx(0.010 + 0.013 + 0.013 + 0.010)
    assert int(m.step_seconds_buckets.sum()) == 4
    assert m.step_seconds_buckets[-1] == 0  # nothing in +Inf: the idle wait was not counted


def test_exporter_times_its_own_per_step_work(real_eplb):
    recs = _install(real_eplb)
    state, [(model, mc)] = _state(real_eplb)
    for _ in range(20):
        state.prepare_forward(mc, 3)
        route(model, np.ones((2, 3, 2), np.int64))
        state.step()
    rec = recs[0]
    assert rec.recorded_steps == 20
    assert 0 < rec.exporter_seconds < 20 * 0.05  # a few hundred microseconds per step on CPU at most


def test_idle_engine_exports_its_last_counts(real_eplb, tmp_path):
    """Read-backs used to start only from a step: the last flush interval before the engine went idle
    stayed unexported until the next request. The idle-flush thread writes it."""
    import torch

    writer = SnapshotWriter(str(tmp_path))
    recs = _install(real_eplb, writer=writer, flush_seconds=0.2, idle_flush=True)
    state, [(model, mc)] = _state(real_eplb)
    rng = np.random.default_rng(3)
    total = np.zeros((2, 4))
    try:
        for _ in range(30):  # busy for well over one flush interval, then idle
            ids = rng.integers(0, 4, size=(2, 3, 2))
            # vLLM's model runner steps under inference mode (the recorder's tensors are then
            # inference tensors, which the idle thread may update only in that mode)
            with torch.inference_mode():
                state.prepare_forward(mc, 3)
                route(model, ids)
                state.step()
            total += logical_counts(ids, 4)
            time.sleep(0.01)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = snap.read_all(str(tmp_path))
            if got and got[0].models[0].steps == 30:
                break
            time.sleep(0.05)
        (ws,) = snap.read_all(str(tmp_path))
        (ms,) = ws.models
        assert ms.steps == 30, "the last steps before going idle were not exported"
        np.testing.assert_array_equal(ms.expert_tokens, total)
        assert ms.step_tokens_sum == 90 and int(ms.step_seconds_buckets.sum()) == 30
        assert ws.recorded_steps == 30
        # a snapshot is consistent: its step telemetry covers exactly the steps whose load it holds
        assert ms.step_tokens_sum * 2 == ms.rank_tokens[0].sum()
    finally:
        recs[0].close()


def test_snapshot_counts_only_steps_whose_load_landed(real_eplb, tmp_path):
    clock = FakeClock()
    writer = SnapshotWriter(str(tmp_path))
    recs = _install(real_eplb, writer=writer, flush_seconds=1.0, clock=clock)
    state, [(model, mc)] = _state(real_eplb)
    for _ in range(5):
        state.prepare_forward(mc, 2)
        route(model, np.ones((2, 2, 2), np.int64))
        clock.t += 0.3
        state.step()  # the read-back starts after the step that crosses 1 s (step 4)
    writer.flush()
    (ws,) = snap.read_all(str(tmp_path))
    assert ws.models[0].steps == 4 and ws.models[0].step_tokens_sum == 8
    assert ws.models[0].expert_tokens.sum() == 4 * 2 * 2 * 2  # steps x tokens x top-k x layers
    del recs


def test_kv_cache_bytes_counts_each_storage_once():
    import torch
    from vllm.config import VllmConfig

    vc = VllmConfig()
    shared = torch.zeros((4, 16, 8), dtype=torch.float32)  # 2 KiB, bound to two layers (KV sharing)
    own = torch.zeros((2, 16, 8), dtype=torch.bfloat16)  # 512 B
    ctx = vc.compilation_config.static_forward_context
    ctx["model.layers.0.self_attn.attn"] = types.SimpleNamespace(kv_cache=shared)
    ctx["model.layers.1.self_attn.attn"] = types.SimpleNamespace(kv_cache=shared[1:])  # a view: same storage
    ctx["model.layers.2.self_attn.attn"] = types.SimpleNamespace(kv_cache=[own])  # per-virtual-engine list
    ctx["model.layers.0.mlp.experts"] = types.SimpleNamespace()  # not attention: no kv_cache
    assert kv_cache_bytes(vc) == 4 * 16 * 8 * 4 + 2 * 16 * 8 * 2
    assert kv_cache_bytes(VllmConfig()) is None  # before the cache exists
    assert kv_cache_bytes(None) is None


def test_all_workers_of_a_pod_share_one_counter_start_time(real_eplb, monkeypatch):
    """The pod's first vLLM process sets MOE_EPLB_EXPORTER_START_TIME; every worker inherits it, so
    moe_eplb_exporter_start_time_seconds does not change when a later worker reports."""
    from moe_eplb.exporter import plugin, settings

    monkeypatch.setenv(settings.ENV_START_TIME, "1234.5")
    monkeypatch.delenv(settings.ENV_DIR, raising=False)
    s = settings.Settings.from_env()
    assert s.start_time == 1234.5
    recs = []
    factory = plugin._recorder_factory(s)

    def keep(state, layout):
        rec = factory(state, layout)
        recs.append(rec)
        return rec

    assert hook.patch_eplb_state(real_eplb.EplbState, keep)
    state, _ = _state(real_eplb)
    state.step()
    try:
        assert recs[0].models[0].start_time == 1234.5
    finally:
        recs[0].close()
