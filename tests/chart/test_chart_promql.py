"""Every PromQL expression in the shipped dashboards and alerts parses, names only metrics the
project or vLLM exports, and runs against a real Prometheus that scrapes those metrics."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import yaml

from moe_eplb.contracts import metric_names as mn
from moe_eplb_harness.floor.prometheus import promtool_binary
from tests.chart import chart_queries as cq
from tests.chart import chart_samples as samples
from tests.chart.chart_support import FAST_ALERTS, render_chart, rule_groups

#: every alert the chart's PrometheusRule renders (13)
ALERTS = ("MoEEPLBBalancednessLow", "MoEEPLBExporterMissing", "MoEEPLBRearrangementsStalled", "MoEEPLBRebalanceFailed",
          "MoEEPLBTuningFailing", "MoEEPLBTuningStale", "MoEEPLBRollback", "MoEEPLBAutoscalerAtMax",
          "MoEEPLBRecoveryStuck", "MoEEPLBRecoveryDegraded", "MoEEPLBResizeStuck", "MoEEPLBResizeFailed",
          "MoEEPLBOperatorDown")

try:
    import promql_parser
except ImportError:  # the Prometheus-backed tests below still run
    promql_parser = None

needs_parser = pytest.mark.skipif(promql_parser is None,
                                  reason="promql-parser is not installed (pip install promql-parser==0.11.0)")


@pytest.fixture(scope="module")
def alert_groups(chart):
    return rule_groups(render_chart(chart))


@pytest.fixture(scope="module")
def queries(alert_groups):
    return cq.dashboard_queries() + cq.alert_queries(alert_groups)


def metric_names(expr: str) -> set[str]:
    """Metric names of every vector selector in a PromQL expression (parsed, not pattern-matched)."""
    found: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                found.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    found.add(m.value)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_catalog_covers_every_pinned_metric():
    pinned = {v for k, v in vars(mn).items() if isinstance(v, str) and k.isupper()
              and v.startswith(mn.PREFIX) and v != mn.PREFIX}
    catalog = set(samples.EXPORTER_METRICS) | set(samples.OPERATOR_METRICS)
    assert pinned == catalog, f"names.py and the test catalog differ: {pinned ^ catalog}"


def _families(collected) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Catalog name -> (type, label names) of prometheus_client metric families as exposed."""
    out = {}
    for fam in collected:
        labels = {tuple(k for k in smp.labels if k != "le") for smp in fam.samples}
        assert len(labels) == 1, f"{fam.name}: samples with different label names {labels}"
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, labels.pop())
    return out


def test_catalog_matches_the_real_exporter():
    """The dashboards' and alerts' assumptions (names, types, label names) are exactly what the
    exporter emits: every family, nothing more, nothing less."""
    from moe_eplb.exporter.collector import families
    from tests.exporter.exporter_helpers import tiny_exporter_pods

    pod = tiny_exporter_pods()
    for pm in pod.values():  # a replica group's leader: every family a pod exports, and the group gauge
        pm.group_pods = 2
    from moe_eplb.contracts.live_protocol import RankStatus

    live = [RankStatus(ep_rank=r, ep_size=2, pid=r, step=5, counter=5, window_size=1000, step_interval=3000)
            for r in range(2)]  # the settings in force, as each rank's live-apply status reports them
    got = _families(families(pod, live=live))
    assert got == samples.EXPORTER_METRICS


def test_catalog_matches_the_operators_metrics():
    """Every moe_eplb_* metric the operator process registers (autotune metrics and the reconcile
    counter) has the catalog's type and label names, and the catalog has no operator metric more."""
    from prometheus_client import REGISTRY

    from moe_eplb.controller import elastic_metrics, main, opmetrics, recovery_metrics

    opmetrics.metrics()
    recovery_metrics.metrics()
    elastic_metrics.metrics()
    main.reconcile_counter()
    got = {}
    for collector in list(REGISTRY._collector_to_names):  # private: labels of child-less metrics
        name = getattr(collector, "_name", "")
        if not name.startswith(mn.PREFIX):
            continue
        kind = collector._type
        got[name + "_total" if kind == "counter" else name] = (kind, tuple(collector._labelnames))
    assert got == samples.OPERATOR_METRICS


def test_every_alert_of_the_issue_is_shipped(alert_groups):
    alerts = {r["alert"] for g in alert_groups for r in g["rules"]}
    assert {"MoEEPLBBalancednessLow", "MoEEPLBExporterMissing", "MoEEPLBRearrangementsStalled", "MoEEPLBRebalanceFailed",
            "MoEEPLBTuningFailing", "MoEEPLBTuningStale", "MoEEPLBRollback", "MoEEPLBOperatorDown",
            "MoEEPLBAutoscalerAtMax", "MoEEPLBRecoveryStuck", "MoEEPLBRecoveryDegraded",
            "MoEEPLBResizeStuck", "MoEEPLBResizeFailed"} == alerts


@needs_parser
def test_every_query_parses_and_names_known_metrics(queries):
    known = samples.known_series()
    assert len(queries) > 40
    unknown = {}
    for q in queries:
        try:
            names = metric_names(q.promql)
        except ValueError as exc:
            pytest.fail(f"{q.where}: does not parse: {exc}\n{q.promql}")
        assert names, f"{q.where}: names no metric"
        if names - known:
            unknown[q.where] = sorted(names - known)
    assert not unknown, f"metrics neither the exporter, the operator nor vLLM export: {unknown}"


def label_uses(expr: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(series name -> label names its matchers use, label names of by/without/on/ignoring clauses,
    label names label_replace/label_join create) of a PromQL expression, parsed."""
    matchers: dict[str, set[str]] = {}
    grouping: set[str] = set()
    created: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names = {m.value for m in node.matchers.matchers if m.name == "__name__"} | ({node.name} if node.name else set())
            for name in names:
                matchers.setdefault(name, set()).update(m.name for m in node.matchers.matchers if m.name != "__name__")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None and node.modifier.matching:
            grouping.update(node.modifier.matching.labels)
        elif isinstance(node, promql_parser.Call) and node.func.name in {"label_replace", "label_join"}:
            created.add(node.args[1].val)  # (v, dst, replacement|separator, src...)
            sources = node.args[3:4] if node.func.name == "label_replace" else node.args[3:]
            grouping.update(a.val for a in sources if a.val)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return matchers, grouping, created


@needs_parser
def test_every_query_uses_only_exported_label_names(queries):
    """Every label a dashboard or alert selects or groups by is one its series carry (the contract's
    label names, vLLM's, or the scrape-time ones): a renamed label (model -> model_name) fails here."""
    known = samples.series_labels()
    bad = {}
    for q in queries:
        matchers, grouping, created = label_uses(q.promql)
        in_scope = set().union(*(known.get(name, set()) for name in matchers)) | created
        for name, used in matchers.items():
            if used - known.get(name, set()):
                bad[f"{q.where}: {name}"] = sorted(used - known[name])
        if grouping - in_scope:
            bad[f"{q.where}: by/on"] = sorted(grouping - in_scope)
    assert not bad, f"label names the series do not carry: {bad}"


@needs_parser
def test_label_check_catches_the_old_label_name():
    matchers, grouping, created = label_uses(
        'sum by (model, le) (rate(x_bucket{model="a", rank="1"}[5m])) / on (pod) '
        'label_replace(y, "dst", "$1", "src", "(.*)")')
    assert matchers == {"x_bucket": {"model", "rank"}, "y": set()}
    assert {"model", "le", "pod", "src"} <= grouping and created == {"dst"}
    known = samples.series_labels()
    assert "model" not in known[mn.EXPERT_TOKENS] and mn.LABEL_MODEL in known[mn.EXPERT_TOKENS]
    assert {"model_name", "engine"} <= known["vllm:generation_tokens_total"]


@needs_parser
def test_metric_name_extraction_sees_every_selector():
    assert metric_names('a_total / on (x) group_left b{c="1"} or {__name__="d"} unless absent(up)') == {
        "a_total", "b", "d", "up"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(x[5m])")  # unclosed parenthesis


@needs_parser
def test_dashboards_use_every_exporter_metric():
    used = set().union(*(metric_names(q.promql) for q in cq.dashboard_queries()))
    # the replica-group bookkeeping gauge tells the load reader which pods' expert counts their group
    # leader exports; the dashboards show the same load from either layout and need not read it
    not_shown = {mn.EXPORTER_GROUP_PODS}
    for name, (kind, _) in samples.EXPORTER_METRICS.items():
        assert name in not_shown or set(samples._series(name, kind)) & used, f"no dashboard panel shows {name}"
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in used, f"the serving view misses {name}"


@pytest.mark.integration  # runs promtool
@pytest.mark.prometheus
def test_promtool_accepts_the_rules(chart, tmp_path):
    for label, values in (("default", {}), ("fast", FAST_ALERTS)):
        path = tmp_path / f"rules-{label}.yml"
        path.write_text(yaml.safe_dump({"groups": rule_groups(render_chart(chart, values))}))
        res = subprocess.run([promtool_binary(), "check", "rules", str(path)], capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        # the alerts of the chart's catalog (docs/runbook.md): EPLB, autotune, fault recovery, elastic
        # resizes, the operator
        assert f"SUCCESS: {len(ALERTS)} rules found" in res.stdout, res.stdout


# --- against a real Prometheus ------------------------------------------------------------------


@pytest.mark.prometheus
def test_dashboard_queries_return_data(prometheus):
    empty, errors = [], []
    for q in cq.dashboard_queries():
        if q.kind == "variable":
            continue
        try:
            res = prometheus.query(q.promql)
        except Exception as exc:  # noqa: BLE001 (reported below with the query)
            errors.append(f"{q.where}: {exc}")
            continue
        if not res:
            empty.append(q.where)
    assert not errors, "\n".join(errors)
    assert not empty, "queries that found no series in the sample data: " + "; ".join(empty)


@pytest.mark.prometheus
def test_dashboard_variables_find_values(prometheus):
    for q in cq.dashboard_queries():
        if q.kind == "variable":
            values = prometheus.api(f"label/{q.label}/values", **{"match[]": q.promql})
            assert values, f"{q.where}: no values for {q.promql}"
        elif q.kind == "variable-query":
            res = prometheus.query(q.promql.replace("[30s]", "[10s]"))
            # Grafana's query_result lines: {labels} value timestamp; the variable's regex extracts
            lines = ["{" + ", ".join(f'{k}="{v}"' for k, v in r["metric"].items()) + "}" for r in res]
            pattern = re.compile(q.regex.strip("/"))
            values = [m.group(1) for line in lines if (m := pattern.search(line))]
            assert values, f"{q.where}: nothing extracted from {lines}"
    ns = prometheus.api("label/moeinference/values", **{"match[]": mn.CONFIG_INFO})
    assert ns == sorted([samples.DEMO, samples.MULTINODE, samples.STALLED])


@pytest.mark.prometheus
def test_layer_variable_defaults_to_the_most_imbalanced_layer(prometheus):
    (q,) = [q for q in cq.dashboard_queries() if q.kind == "variable-query" and "variable layer" in q.where]
    res = prometheus.query(q.promql.replace("[30s]", "[10s]"))
    layers = [r["metric"]["layer"] for r in res]
    assert layers[0] == "2" and sorted(layers) == ["0", "1", "2", "3"]  # layer 2: max/mean 1.9, others 1.6
    assert float(res[0]["value"][1]) == pytest.approx(1200 / 600, rel=0.05)


@pytest.mark.prometheus
def test_heatmap_and_balance_values(prometheus):
    hot = prometheus.query(cq.substitute(
        f'topk(1, sum by (layer, expert) (rate({mn.EXPERT_TOKENS}{{moeinference="$moeinference", layer=~"$layer"}}[3s])))'))  # a full window
    assert hot[0]["metric"]["expert"] == "0"
    assert float(hot[0]["value"][1]) == pytest.approx(1000.0, rel=0.15)
    bal = prometheus.query(f'avg({mn.BALANCEDNESS}{{moeinference="{samples.DEMO}"}})')
    assert float(bal[0]["value"][1]) == pytest.approx(sum(samples.BALANCEDNESS) / 4)


@pytest.mark.prometheus
def test_dashboard_balancedness_falls_back_to_rank_counters(prometheus):
    """The overview stats show balancedness for an engine whose exporter has no gauge."""
    stat = next(q for q in cq.dashboard_queries() if "Balancedness (mean of layers)" in q.where)
    res = prometheus.query(stat.promql.replace(f'moeinference="{samples.DEMO}"',
                                               f'moeinference="{samples.MULTINODE}"'))
    assert float(res[0]["value"][1]) == pytest.approx(MULTINODE_MEAN_BALANCEDNESS, rel=0.05)
    res = prometheus.query(stat.promql)  # the gauge wins where it exists
    assert float(res[0]["value"][1]) == pytest.approx(sum(samples.BALANCEDNESS) / 4)


@pytest.mark.prometheus
def test_alert_rules_evaluate_without_errors(prometheus):
    deadline = time.time() + 15
    while True:
        groups = prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("2") and
                         not r["lastEvaluation"].startswith("0001") for r in rules):
            break
        assert time.time() < deadline, f"rules not evaluated yet: {rules}"
        time.sleep(0.5)
    assert sorted(r["name"] for r in rules) == sorted(ALERTS)
    for r in rules:
        assert r["health"] == "ok", f"{r['name']}: {r.get('lastError')}"


@pytest.mark.prometheus
def test_alerts_fire_on_the_sample_data(prometheus):
    expected = {
        ("MoEEPLBBalancednessLow", samples.DEMO): "firing",
        ("MoEEPLBBalancednessLow", samples.MULTINODE): "firing",  # from the rank counters
        ("MoEEPLBExporterMissing", samples.NOEXPORTER): "firing",
        ("MoEEPLBTuningFailing", samples.FAILING): "firing",
        ("MoEEPLBTuningStale", samples.STALE): "pending",  # for: 5m
        ("MoEEPLBRollback", samples.DEMO): "firing",
        ("MoEEPLBRearrangementsStalled", samples.STALLED): "firing",  # 20 steps/s, interval 10, flat
        ("MoEEPLBRebalanceFailed", samples.STALLED): "firing",  # its async worker failures grow
        ("MoEEPLBBalancednessLow", samples.STALLED): "firing",
        ("MoEEPLBAutoscalerAtMax", samples.DEMO): "pending",  # for: 15m
        ("MoEEPLBRecoveryStuck", samples.DEMO): "firing",  # a round 100 s past its deadline
        ("MoEEPLBRecoveryDegraded", samples.DEMO): "pending",  # for: 1h
        ("MoEEPLBResizeFailed", samples.DEMO): "firing",  # a rolled-back grow; its resize in progress is in time
    }
    deadline = time.time() + 20
    while True:
        alerts = prometheus.api("alerts")["alerts"]
        got = {(a["labels"]["alertname"], a["labels"].get("moeinference") or a["labels"].get("name")): a["state"]
               for a in alerts}
        if got == expected or time.time() > deadline:
            break
        time.sleep(0.5)
    assert got == expected  # and nothing else: the operator is up, demo's exporter is there
    firing = next(a for a in alerts if a["labels"]["alertname"] == "MoEEPLBBalancednessLow"
                  and a["labels"]["moeinference"] == samples.DEMO)
    assert float(firing["value"]) == pytest.approx(sum(samples.BALANCEDNESS) / 4)
    multinode = next(a for a in alerts if a["labels"]["alertname"] == "MoEEPLBBalancednessLow"
                     and a["labels"]["moeinference"] == samples.MULTINODE)
    assert float(multinode["value"]) == pytest.approx(MULTINODE_MEAN_BALANCEDNESS, rel=0.02)
    stalled = next(a for a in alerts if a["labels"]["alertname"] == "MoEEPLBRearrangementsStalled")
    # step intervals' worth of steps in the window: up to 20 steps/s x 10 s / 10 steps (less while the
    # window still reaches back before the first scrape), above the threshold 3
    assert 3 < float(stalled["value"]) <= 20 * 1.25
    assert stalled["labels"][mn.LABEL_MODEL] == samples.MODEL
    assert firing["labels"]["severity"] == "warning"
    assert "team-a/demo" in firing["annotations"]["summary"]


#: mean over layers of mean/max rank load from the counters: layer 2 (1200, 400, 400, 400) 0.5, the
#: others (800, 400, 400, 400) 0.625
MULTINODE_MEAN_BALANCEDNESS = (3 * 500 / 800 + 600 / 1200) / 4


def doc_queries() -> list[str]:
    """The PromQL examples in docs/metrics.md (one per non-comment line or indented group)."""
    text = (cq.DASHBOARD_DIR.parents[2] / "docs" / "metrics.md").read_text()
    out = []
    for block in re.findall(r"```promql\n(.*?)```", text, flags=re.DOTALL):
        current: list[str] = []
        for line in block.splitlines() + [""]:
            if not line.strip() or line.startswith("#"):
                if current:
                    out.append(" ".join(current))
                current = []
            elif line.startswith((" ", "/")) and current:
                current.append(line.strip())
            else:
                if current:
                    out.append(" ".join(current))
                current = [line.strip()]
    return out


@pytest.mark.prometheus
@needs_parser
def test_doc_examples_run(prometheus):
    queries = doc_queries()
    assert len(queries) >= 5
    for q in queries:
        assert metric_names(q) <= samples.known_series(), q
        assert prometheus.query(q.replace("[5m]", "[10s]").replace("[1h]", "[30s]")), f"no data: {q}"
