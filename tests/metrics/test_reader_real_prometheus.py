"""The load reader against a real Prometheus 2.42 (skipped without the binary).

The exporter's counters are backfilled with ``promtool tsdb create-blocks-from openmetrics`` (a
sample every 5 s, three hours ago), Prometheus serves them, and ``read_load_trace`` reads them over
its HTTP API (raw samples plus baselines): the trace it builds is exact, whole numbers included.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import layer_groups, read_load_trace, with_matcher
from tests.metrics.backfill import backfilled_prometheus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.prometheus,
]

T, L, E = 8, 3, 4
SCRAPE = 5  # seconds between samples
BUCKET = 15
# expert (1, 3) never received a token (the exporter never created its counter)
LOAD = (np.arange(T * L * E).reshape(T, L, E) % 7 + 1) * 30.0
LOAD[:, 1, 3] = 0
POD = 'namespace="ns",moeinference="moe",pod="moe-0",model_name="m"'
STEPS = np.array([300, 300, 270, 300, 0, 150, 300, 300])
PREFIX_QUERIES = np.array([900, 900, 900, 900, 0, 600, 900, 900], float)  # queried prompt tokens per bucket
PREFIX_HIT = np.array([0.6, 0.6, 0.5, 0.5, 0.0, 0.4, 0.4, 0.4])


def _openmetrics(t0: int) -> str:
    """The exporter's counters as OpenMetrics text with timestamps (as a PodMonitor's relabelling
    stores them): a sample at ``t0`` and every 5 s after, three per 15 s bucket."""
    per = BUCKET // SCRAPE
    times = [t0 + i * SCRAPE for i in range(T * per + 1)]
    lines = [f"# TYPE {metric_names.EXPERT_TOKENS.removesuffix('_total')} counter"]
    for l in range(L):
        for e in range(E):
            if (l, e) == (1, 3):
                continue  # never received a token: the exporter never created the counter
            values = 1e6 + np.concatenate([[0.0], np.cumsum(np.repeat(LOAD[:, l, e] / per, per))])
            lines += [f'{metric_names.EXPERT_TOKENS}{{{POD},layer="{l}",expert="{e}"}} {v:.1f} {ts}'
                      for ts, v in zip(times, values)]
    lines.append(f"# TYPE {metric_names.ENGINE_STEPS.removesuffix('_total')} counter")
    values = 5e5 + np.concatenate([[0.0], np.cumsum(np.repeat(STEPS / per, per))])
    lines += [f'{metric_names.ENGINE_STEPS}{{{POD}}} {v:.1f} {ts}' for ts, v in zip(times, values)]
    lines.append(f"# TYPE {metric_names.EXPORTER_START_TIME} gauge")
    lines += [f'{metric_names.EXPORTER_START_TIME}{{{POD}}} {t0 - 3600} {ts}' for ts in times]
    # vLLM's prefix-cache counters (per engine) and its CacheConfig info gauge, which has no model_name
    for name, per_bucket in ((vllm_facts.PREFIX_CACHE_QUERIES, PREFIX_QUERIES), (vllm_facts.PREFIX_CACHE_HITS,
                                                                                 PREFIX_QUERIES * PREFIX_HIT)):
        lines.append(f"# TYPE {name.removesuffix('_total')} counter")
        values = np.concatenate([[0.0], np.cumsum(np.repeat(per_bucket / per, per))])
        lines += [f'{name}{{{POD},engine="0"}} {v:.1f} {ts}' for ts, v in zip(times, values)]
    lines.append(f"# TYPE {vllm_facts.CACHE_CONFIG_INFO} gauge")
    info = 'namespace="ns",moeinference="moe",pod="moe-0",engine="0",num_gpu_blocks="22000",block_size="16"'
    lines += [f'{vllm_facts.CACHE_CONFIG_INFO}{{{info}}} 1 {ts}' for ts in times]
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    work = tmp_path_factory.mktemp("prom-trace")
    t0 = (int(time.time()) - 3 * 3600) // BUCKET * BUCKET
    with backfilled_prometheus(work, _openmetrics(t0)) as base:
        yield base, t0


def _read(prom, **kw):
    base, t0 = prom
    if "client" not in kw:
        kw["prometheus_url"] = base
    return read_load_trace(namespace="ns", name="moe", window_seconds=T * BUCKET,
                           bucket_seconds=BUCKET, now=t0 + T * BUCKET + 1, **kw)


def test_the_reader_gives_the_exact_trace(prom):
    trace = _read(prom, num_experts=E)
    assert trace.load.shape == (T, L, E) and trace.bucket_seconds == BUCKET and trace.model == "m"
    np.testing.assert_array_equal(trace.bucket_steps, STEPS)
    np.testing.assert_array_equal(trace.load, LOAD)  # exact: raw samples, no extrapolation
    assert trace.meta["interpolated_fraction"] == 0.0


def test_prefix_cache_telemetry_and_vllms_unlabelled_cache_config(prom):
    """The prefix-cache counters give queries and hit rate per bucket; vLLM's cache_config_info
    carries no model_name, yet a read for one model finds it."""
    trace = _read(prom, num_experts=E, model="m")
    tel = trace.telemetry
    np.testing.assert_allclose(tel.prefix_cache_queries, PREFIX_QUERIES)
    np.testing.assert_allclose(tel.prefix_cache_hit_rate, np.where(PREFIX_QUERIES > 0, PREFIX_HIT, np.nan))
    assert (tel.kv_cache_blocks, tel.kv_block_size, tel.kv_cache_tokens) == (22000, 16, 352000)


def test_dense_families_are_read_in_groups_of_layers_with_the_same_trace(prom):
    """An answer holds at most ~max_samples_per_answer raw samples (the operator's memory bound):
    the expert tokens (layers of 4, 3 and 4 series, 25 samples each in the window) come in groups
    of whole layers; the trace is the same as from one answer."""
    base, t0 = prom
    start, end = float(t0), float(t0 + T * BUCKET)
    client = PrometheusClient(base)
    sel = f'{metric_names.EXPERT_TOKENS}{{namespace="ns", moeinference="moe"}}'
    assert layer_groups(client, sel, start, end, max_samples=10_000) is None  # 275 samples: one answer
    assert layer_groups(client, sel, start, end, max_samples=200) == ['layer=~"0|1"', 'layer=~"2"']
    assert layer_groups(client, sel, start, end, max_samples=60) == ['layer=~"0"', 'layer=~"1"', 'layer=~"2"']
    steps = f'{metric_names.ENGINE_STEPS}{{namespace="ns"}}'  # no layer label: one group of its own
    assert layer_groups(client, steps, start, end, max_samples=10) == ['layer=""']
    assert with_matcher(sel, 'layer=~"2"') == (f'{metric_names.EXPERT_TOKENS}{{namespace="ns", moeinference="moe", '
                                               'layer=~"2"}')
    assert with_matcher("x", 'layer=""') == 'x{layer=""}' and with_matcher("x{}", 'a="b"') == 'x{a="b"}'

    whole, grouped = PrometheusClient(base), PrometheusClient(base)
    a = _read(prom, num_experts=E, client=whole)
    b = _read(prom, num_experts=E, client=grouped, max_samples_per_answer=60)
    np.testing.assert_array_equal(b.load, LOAD)
    np.testing.assert_array_equal(b.load, a.load)
    np.testing.assert_array_equal(b.bucket_steps, a.bucket_steps)
    assert grouped.attempts > whole.attempts  # the expert tokens came in 3 answers (plus baselines), not 1


def test_a_shape_the_series_contradict_is_an_error(prom):
    with pytest.raises(LoadReadError, match=r"num_layers: is 2 but the answer has a series for layer 2") as ei:
        _read(prom, num_layers=2)
    assert ei.value.reason == "InconsistentSeries"


def test_trace_from_prometheus_command_writes_the_same_trace(prom, tmp_path):
    from click.testing import CliRunner

    from moe_eplb.cli import main
    from moe_eplb.eplb.workload.tracefile import load_trace

    base, t0 = prom
    out = tmp_path / "t.npz"
    result = CliRunner().invoke(main, ["trace", "from-prometheus", "--url", base, "--namespace", "ns", "--name", "moe",
                                       "--hours", str(T * BUCKET / 3600), "--bucket-seconds", str(BUCKET),
                                       "--end", str(t0 + T * BUCKET + 1), "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = load_trace(out)
    np.testing.assert_array_equal(trace.load, LOAD)
    np.testing.assert_array_equal(trace.bucket_steps, STEPS)
    missing = CliRunner().invoke(main, ["trace", "from-prometheus", "--url", base, "--name", "nobody",
                                        "--end", str(t0 + T * BUCKET + 1), "-o", str(tmp_path / "x.npz")])
    assert missing.exit_code == 1 and "NoData" in missing.output and not (tmp_path / "x.npz").exists()
