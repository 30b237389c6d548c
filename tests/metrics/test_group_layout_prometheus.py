"""The load reader against a real Prometheus: the same trace from one L x E copy per replica group
(the leader's merged counter) as from every pod's own copy.

The real collectors' ``/metrics`` bodies of both layouts (``simulate`` in
``test_reader_group_layout.py``: 4 pods, a worker restart, a leader restart, a group restart) are
backfilled as the scrapes Prometheus would have stored (``promtool tsdb create-blocks-from
openmetrics``), and ``read_load_trace`` reads each layout over Prometheus' HTTP API: raw samples with
baselines, and the regular pods summed at the bucket edges (the workers, which export no expert
series, left out of the sums).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_eplb.contracts import metric_names
from moe_eplb.metrics.reader import read_load_trace, trace_from_scraped_rounds
from tests.metrics.backfill import backfilled_prometheus, openmetrics_text
from tests.metrics.test_reader_group_layout import PODS, simulate

pytestmark = [
    pytest.mark.integration,
    pytest.mark.prometheus,
]

BUCKET = 10
FAMILIES = (metric_names.EXPERT_TOKENS, metric_names.ENGINE_STEPS, metric_names.EXPORTER_START_TIME,
            metric_names.EXPORTER_GROUP_PODS, metric_names.RANK_TOKENS)


def _openmetrics(layouts: dict[str, list], shift: float) -> str:
    """Every round's bodies of each layout as timestamped samples (labels as the PodMonitor adds them)."""
    rows: dict[str, dict[tuple, list[str]]] = {f: {} for f in FAMILIES}
    for name, rounds in layouts.items():
        for rnd in rounds:
            for pod, body in rnd.bodies.items():
                w = pod.rsplit("-", 1)[1]
                extra = {"namespace": "ns", metric_names.MOEINFERENCE_LABEL: name, "pod": pod,
                         metric_names.GROUP_LABEL: "0", metric_names.GROUP_WORKER_LABEL: w,
                         metric_names.GROUP_SIZE_LABEL: str(PODS)}
                for fam in text_string_to_metric_families(body.decode()):
                    for s in fam.samples:
                        if s.name not in rows:
                            continue
                        labels = {**s.labels, **extra}
                        key = tuple(sorted(labels.items()))
                        text = ",".join(f'{k}="{v}"' for k, v in key)
                        rows[s.name].setdefault(key, []).append(f"{s.name}{{{text}}} {s.value} {rnd.time + shift:.3f}")
    return openmetrics_text({f: [line for series in rows[f].values() for line in series] for f in FAMILIES})


def test_real_prometheus_reads_the_same_trace_from_both_layouts(tmp_path):
    (tmp_path / "pods").mkdir()
    old, new = simulate(tmp_path / "pods")
    t0 = (int(time.time()) - 3 * 3600) // BUCKET * BUCKET
    shift = t0 - 1000.0
    text = _openmetrics({"old": old, "new": new}, shift)
    (tmp_path / "prom").mkdir()
    with backfilled_prometheus(tmp_path / "prom", text) as url:
        def read(name: str, window: float = 90, **kw):
            return read_load_trace(namespace="ns", name=name, window_seconds=window, bucket_seconds=BUCKET,
                                   prometheus_url=url, now=t0 + 100 + 1, pods_per_engine=PODS, **kw)

        a, b = read("old"), read("new")
        bare = read("new", telemetry=False)  # the per-replica reads' way: load and steps, no telemetry
        raw = read("new", at_edges=False)
        # after the group's restart every pod is regular: summed at the bucket edges by Prometheus
        late_old, late_new = read("old", 30), read("new", 30)
    assert (late_old.meta["read"], late_new.meta["read"]) == ("edges", "edges"), late_new.meta["read"]
    assert (late_old.meta["pods_at_edges"], late_new.meta["pods_at_edges"]) == (PODS, 1)
    np.testing.assert_array_equal(late_old.load, late_new.load)
    np.testing.assert_array_equal(late_old.bucket_steps, late_new.bucket_steps)
    np.testing.assert_array_equal(late_new.load, b.load[-3:])
    np.testing.assert_array_equal(a.load, b.load)
    np.testing.assert_array_equal(bare.load, b.load)
    np.testing.assert_array_equal(bare.bucket_steps, b.bucket_steps)
    assert bare.telemetry is None and b.telemetry is not None and bare.meta["read"] == b.meta["read"]
    np.testing.assert_array_equal(a.bucket_steps, b.bucket_steps)
    np.testing.assert_array_equal(raw.load, b.load)
    assert a.load.sum() > 0 and a.load.shape[0] == 9
    # the pure scrape route on the same rounds, on the same grid, agrees
    grid = np.arange(1010.0, 1101.0, BUCKET)
    direct = trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
    np.testing.assert_array_equal(direct.load, b.load)
    assert a.telemetry is not None and b.telemetry is not None
    np.testing.assert_allclose(a.telemetry.rank_load, b.telemetry.rank_load)
