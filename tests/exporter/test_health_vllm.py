"""vLLM's own rearrangement health signals reach the exporter's metrics, against the real
``EplbState`` (installed 0.32; 0.33 and 0.34 sources through tests/test_vllm_sources.py): vLLM 0.34
raises the async worker's failure on every rank and logs each async cycle's duration; earlier
releases have neither, and the exporter then exports neither series."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.exporter import hook
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.recorder import SnapshotWriter, StateRecorder
from moe_eplb.exporter.server import make_registry
from tests.exporter.exporter_helpers import make_real_state, route

pytestmark = pytest.mark.vllm


def _signals(es) -> bool:
    """Whether this vLLM's EPLB code has the 0.34 signals (read from its source, not its version)."""
    from vllm.distributed.eplb import async_worker

    has = vllm_facts.ASYNC_WORKER_FAILED in inspect.getsource(es)
    assert has == (vllm_facts.ASYNC_REARRANGED_LOG in inspect.getsource(async_worker))
    return has


def _install(es, writer=None):
    recs = []

    def factory(state, layout):
        rec = StateRecorder(state, layout, writer, flush_seconds=1e9)
        recs.append(rec)
        return rec

    assert hook.patch_eplb_state(es.EplbState, factory)
    return recs


def _samples(directory) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(make_registry(PodCollector(str(directory)))).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _metrics(directory) -> dict:
    """Sample name -> sample (the last of a name: for series without labels besides model_name)."""
    return {s.name: s for s in _samples(directory)}


def test_async_worker_failure_is_counted_and_vllm_still_raises(real_eplb, tmp_path):
    writer = SnapshotWriter(str(tmp_path))
    recs = _install(real_eplb, writer)
    state, model = make_real_state(L=2, E=4, R=0, window=2, interval=10**6, use_async=False)
    route(model, np.zeros((2, 3, 2), np.int64))
    state.step()  # the recorder exists
    (rec,) = recs
    # what vLLM's async worker leaves when its thread dies mid-rearrangement (async_worker.py)
    ms = next(iter(state.model_states.values()))
    state.is_async, ms.rebalanced = True, True
    worker_error = ValueError("expert transfer failed")
    if not _signals(real_eplb):  # <= 0.33: vLLM never looks at it; nothing is exported
        state.async_worker_error = worker_error
        state.step()
        assert rec.snapshot().models[0].rebalance_failures is None
        rec.flush_now()
        writer.flush()
        names = _metrics(tmp_path)
        assert metric_names.REBALANCE_FAILURES not in names and metric_names.ENGINE_STEPS in names
        return
    assert rec.layout.health_signals
    state.async_worker_error = worker_error
    for _ in range(2):  # vLLM raises at every step; one failure is counted once
        with pytest.raises(RuntimeError, match=vllm_facts.ASYNC_WORKER_FAILED) as raised:
            state.step()
        assert raised.value.__cause__ is worker_error
    assert rec.models[0].rebalance_failures == 1
    # written at once (the worker may be about to die), and exported by the pod
    (on_disk,) = snap.read_all(str(tmp_path))
    assert on_disk.models[0].rebalance_failures == 1
    assert _metrics(tmp_path)[metric_names.REBALANCE_FAILURES].value == 1.0


def test_another_ranks_failure_counts_without_a_local_error(real_eplb, tmp_path):
    """On the ranks whose worker did not fail, vLLM raises the same message without a cause."""
    recs = _install(real_eplb)
    state, model = make_real_state(L=2, E=4, R=0, window=2, interval=10**6)
    state.step()
    (rec,) = recs
    err = RuntimeError(vllm_facts.ASYNC_WORKER_FAILED + "; see the worker logs.")
    rec.step_failed(err)
    rec.step_failed(err)
    rec.step_failed(RuntimeError("something else"))
    expected = 1 if _signals(real_eplb) else None
    assert rec.snapshot().models[0].rebalance_failures == expected


def test_vllm_async_cycle_log_becomes_the_duration_histogram(real_eplb, tmp_path, caplog):
    from vllm.distributed.eplb import async_worker

    writer = SnapshotWriter(str(tmp_path))
    recs = _install(real_eplb, writer)
    state, model = make_real_state(L=2, E=4, R=0, window=2, interval=10**6, use_async=True, name="org/async")
    state.step()
    (rec,) = recs
    caplog.set_level(logging.INFO, logger=vllm_facts.ASYNC_WORKER_LOGGER)  # vLLM's default level lets it through
    try:
        # the lines vLLM's async worker logs on EP rank 0 (its own logger; the second for another model)
        async_worker.logger.info(vllm_facts.ASYNC_REARRANGED_LOG, 2, 2, "org/async", 0.42)
        async_worker.logger.info(vllm_facts.ASYNC_REARRANGED_LOG, 2, 2, "org/other", 9.0)
        async_worker.logger.info(vllm_facts.ASYNC_REARRANGED_LOG, 1, 2, "org/async", 3.0)
        state.step()
        rec.flush_now()
        writer.flush()
        m = rec.snapshot().models[0]
        if not _signals(real_eplb):
            assert m.async_duration_buckets is None and rec._tap is None
            assert metric_names.ASYNC_REARRANGEMENT_SECONDS + "_count" not in _metrics(tmp_path)
            return
        assert rec.layout.is_async and m.async_duration_sum == pytest.approx(3.42)
        got = _metrics(tmp_path)
        assert got[metric_names.ASYNC_REARRANGEMENT_SECONDS + "_count"].value == 2.0
        assert got[metric_names.ASYNC_REARRANGEMENT_SECONDS + "_sum"].value == pytest.approx(3.42)
        buckets = {s.labels["le"]: s.value for s in _samples(tmp_path)
                   if s.name == metric_names.ASYNC_REARRANGEMENT_SECONDS + "_bucket"}
        assert buckets["0.25"] == 0 and buckets["0.5"] == 1 and buckets["5.0"] == 2
    finally:
        rec.close()
