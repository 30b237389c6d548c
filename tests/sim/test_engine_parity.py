"""The simulated engines export what the real exporter exports (issue 14): every ``moe_eplb_*``
family, with the same type, label names and histogram buckets -- so the demo, the closed-loop tests
and the dashboards' sample data exercise the series a real pod serves, nothing more or less."""

from __future__ import annotations

import asyncio

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from moe_eplb.eplb.workload import synth
from moe_eplb.exporter.collector import families
from moe_eplb_harness.engines.engine import EngineRun, EngineSettings, SimClock, SimulatedEngine
from tests.exporter.exporter_helpers import tiny_exporter_pods


def _shape(text: str) -> dict[str, tuple[str, frozenset, tuple[float, ...]]]:
    """family -> (type, label names, histogram bucket bounds) of the moe_eplb_* families in ``text``."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("moe_eplb_"):
            continue
        labels = {frozenset(k for k in s.labels if k != "le") for s in fam.samples}
        assert len(labels) == 1, (fam.name, labels)
        les = sorted({float(s.labels["le"]) for s in fam.samples if "le" in s.labels})
        out[fam.name] = (fam.type, labels.pop(), tuple(les))
    return out


def _real_exporter_text() -> str:
    pods = tiny_exporter_pods()

    class _Collector:
        def collect(self):
            return families(pods)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()


async def _simulated_exporter_text() -> str:
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=0.2,
                           bucket_seconds=15, seed=2)
    eng = SimulatedEngine(trace, EngineSettings("m", ep_size=4), SimClock.started_now(scale=500.0),
                          EngineRun(startup_seconds=1.0, tick=0.02))
    await eng.start()
    try:
        for _ in range(100):  # until it has stepped and rearranged (simulated minutes)
            await asyncio.sleep(0.05)
            if eng.replay.steps > 0 and eng.replay.rearrangements > 0:
                break
        return eng.exposition().decode()
    finally:
        await eng.stop()


def test_simulated_engine_exports_every_series_the_real_exporter_does():
    real = _shape(_real_exporter_text())
    sim = _shape(asyncio.run(_simulated_exporter_text()))
    assert set(sim) == set(real), f"only simulated: {set(sim) - set(real)}; only real: {set(real) - set(sim)}"
    for name in real:
        assert sim[name] == real[name], (name, sim[name], real[name])
