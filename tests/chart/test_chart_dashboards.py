"""The shipped Grafana dashboards: built with Grafana's own SDK, valid dashboard JSON that follows
vLLM's dashboard conventions, small enough by default for DeepSeek-V3 (58 MoE layers x 256 experts),
and showing what the issue asks for."""

from __future__ import annotations

import json
import re

import pytest

from moe_eplb.contracts import metric_names
from tests.chart import chart_queries as cq
from tests.chart.chart_support import ROOT

DASHBOARDS = cq.load_dashboards()
PANEL_TYPES = {"row", "stat", "timeseries", "heatmap", "bargauge", "table"}
EXPERT_LOAD = "moe-expert-load.json"
#: DeepSeek-V3 (61 layers, the first 3 dense): 58 MoE layers x 256 routed experts, e.g. EP 64;
#: the tuner reports 6 cost-model parameters (docs/metrics.md).
DEEPSEEK_V3 = {"layer": 58, "expert": 256, "rank": 64, "parameter": 6, "model_name": 1, "engine": 1}
MAX_DEFAULT_PANELS = 20


def expert_load():
    return DASHBOARDS[EXPERT_LOAD]


def test_both_dashboards_ship():
    assert {d["title"] for d in DASHBOARDS.values()} == {"MoE expert load", "MoE EPLB operator"}
    assert len({d["uid"] for d in DASHBOARDS.values()}) == 2


def test_dashboards_are_built_with_grafanas_sdk():
    """The JSON is what scripts/dashboards.py builds with grafana-foundation-sdk, and Grafana's typed
    dashboard model (the SDK's) reads every panel and variable back without loss."""
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed "
                                                         "(pip install '.[test]')")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    from scripts import dashboards

    assert "grafana_foundation_sdk" in {type(b).__module__.split(".")[0]
                                        for b in (dashboards.expert_load(), dashboards.operator_overview())}
    for fname, build in dashboards.DASHBOARDS.items():
        shipped = DASHBOARDS[fname]
        assert json.loads(dashboards.to_json(build())) == shipped, f"{fname} is stale: run scripts/gen_chart.py"
        again = json.loads(json.dumps(Dashboard.from_json(shipped), cls=JSONEncoder))
        for key in ("panels", "templating", "uid", "title", "time", "schemaVersion"):
            assert again[key] == shipped[key], f"{fname}: {key} does not survive Grafana's dashboard model"


@pytest.mark.parametrize("fname", sorted(DASHBOARDS))
def test_grafana_json_is_valid(fname):
    d = DASHBOARDS[fname]
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
    assert "id" not in d or d["id"] is None  # importable by hand: Grafana assigns the id
    panels = cq.all_panels(d)
    ids = [p["id"] for p in panels]
    assert all(ids) and len(ids) == len(set(ids)), "panel ids must be unique and set"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for p in panels:
        assert p["type"] in PANEL_TYPES
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (p["title"], g)
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], f"panel {p['title']} has no query"
        assert [t["refId"] for t in p["targets"]] == [chr(ord("A") + i) for i in range(len(p["targets"]))]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            # rates follow vLLM's convention: over $__rate_interval (fixed windows only where the
            # panel means a fixed span, e.g. "in the last hour")
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window in {"$__rate_interval", "$__range", "1h", "24h"}, (p["title"], t["expr"])
    # no overlapping panels, on the dashboard and inside each collapsed row
    for group in [d["panels"]] + [p["panels"] for p in d["panels"] if p.get("panels")]:
        cells: set[tuple[int, int]] = set()
        for p in group:
            g = p["gridPos"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"panel {p['title']} overlaps another"
                    cells.add((x, y))
    # every variable a query or a title uses is defined (or is one of Grafana's own)
    used = set()
    texts = [q.expr for q in cq.dashboard_queries() if q.where.startswith(fname)]
    texts += [p["title"] for p in panels] + [p.get("repeat") and "$" + p["repeat"] or "" for p in panels]
    for text in texts:
        used |= {a or b for a, b in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", text)}
    assert used - {"__rate_interval", "__interval", "__range"} <= set(variables), used - set(variables)


@pytest.mark.parametrize("fname", sorted(DASHBOARDS))
def test_vllm_dashboard_conventions(fname):
    """vLLM's dashboards: a datasource variable, $__rate_interval, model_name + engine."""
    d = DASHBOARDS[fname]
    for q in cq.dashboard_queries():
        if not q.where.startswith(fname) or q.kind not in {"panel", "annotation"}:
            continue
        if "rate(" in q.expr or "increase(" in q.expr:
            assert "[$__rate_interval]" in q.expr or re.search(r"\[(\$__range|1h|24h|2m)\]", q.expr), q.where
        if "vllm:" in q.expr:
            assert f'{metric_names.LABEL_MODEL}=~"$model_name"' in q.expr and 'engine=~"$engine"' in q.expr, q.where
    assert d["templating"]["list"][0]["type"] == "datasource"


def test_one_model_variable_filters_exporter_and_vllm_series():
    variables = {v["name"]: v for v in expert_load()["templating"]["list"]}
    assert {"datasource", "namespace", "moeinference", "model_name", "layer", "engine", "topk"} <= set(variables)
    assert "model" not in variables
    assert metric_names.MOEINFERENCE_LABEL in cq.variable_query(variables["moeinference"])
    assert cq.variable_query(variables["model_name"]).endswith(f", {metric_names.LABEL_MODEL})")
    exprs = [q.expr for q in cq.dashboard_queries() if q.where.startswith(EXPERT_LOAD) and q.kind == "panel"]
    exporter = [e for e in exprs if "moe_eplb_" in e and "vllm:" not in e and 'name="$moeinference"' not in e]
    assert exporter and all(f'{metric_names.LABEL_MODEL}=~"$model_name"' in e for e in exporter)
    assert not any(re.search(r"\bmodel=", e) for e in exprs)  # the exporter's label is model_name now


def test_default_view_of_deepseek_v3_fits_in_20_panels():
    shown = cq.default_view_panels(expert_load(), DEEPSEEK_V3)
    assert len(shown) <= MAX_DEFAULT_PANELS, shown
    # what the default view is for: the hottest layers, step time, one layer's experts
    assert "Balancedness per layer (layer x time)" in shown
    assert "Top $topk imbalanced layers: max / mean rank load" in shown
    assert "Step duration per EP rank (p50, p99)" in shown
    assert "Layer $layer: tokens/s per expert" in shown
    assert len(set(shown)) == len(shown), "a panel repeats in the default view"
    print(f"default view of DeepSeek-V3: {len(shown)} panels (rows included)")


def test_panel_counter_sees_repeats_and_collapsed_rows():
    """The counter above would catch the old layout (an expert heatmap repeated per layer, "All"
    layers selected): 58 heatmaps for DeepSeek-V3."""
    layer_all = {"name": "layer", "type": "query", "includeAll": True, "multi": True}
    heat = {"type": "heatmap", "title": "Layer $layer", "repeat": "layer", "id": 2}
    old = {"templating": {"list": [layer_all]},
           "panels": [{"type": "row", "title": "Expert load per layer", "collapsed": False, "panels": []}, heat]}
    assert len(cq.default_view_panels(old, DEEPSEEK_V3)) == 1 + 58
    single = dict(old, templating={"list": [dict(layer_all, includeAll=False, multi=False)]})
    assert len(cq.default_view_panels(single, DEEPSEEK_V3)) == 2
    collapsed = dict(old, panels=[{"type": "row", "title": "r", "collapsed": True, "panels": [heat]}])
    assert cq.default_view_panels(collapsed, DEEPSEEK_V3) == ["r"]
    repeated_row = dict(old, panels=[{"type": "row", "title": "r", "collapsed": False, "panels": [],
                                      "repeat": "layer"}, dict(heat, repeat=None)])
    assert len(cq.default_view_panels(repeated_row, DEEPSEEK_V3)) == 2 * 58
    saved = dict(old, templating={"list": [dict(layer_all, current={"value": ["1", "2", "3"]})]})
    assert len(cq.default_view_panels(saved, DEEPSEEK_V3)) == 1 + 3


def test_nothing_repeats_per_layer_or_expert():
    for fname, d in DASHBOARDS.items():
        for p in cq.all_panels(d):
            assert p.get("repeat") not in {"layer", "expert", "rank"}, (fname, p["title"])
    variables = {v["name"]: v for v in expert_load()["templating"]["list"]}
    layer = variables["layer"]
    assert layer["multi"] is False and layer["includeAll"] is False  # one layer, never "All"
    # ordered by imbalance over the range (sort disabled keeps the query's order): the default,
    # Grafana's first option, is the most imbalanced layer
    assert layer["sort"] == 0
    assert cq.variable_query(layer).startswith("query_result(sort_desc(")
    assert metric_names.RANK_TOKENS in cq.variable_query(layer)
    assert re.fullmatch(r'/layer="\(\\d\+\)"/', layer["regex"])


def test_expert_load_dashboard_has_what_the_issue_asks_for():
    d = expert_load()
    panels = {p["title"]: p for p in cq.all_panels(d)}
    exprs = " ".join(t["expr"] for p in panels.values() for t in p.get("targets", []))
    # layer x time heatmap of balancedness; rows are layers as plain series (Grafana's "heatmap"
    # format would de-cumulate them as if they were histogram buckets)
    heat = panels["Balancedness per layer (layer x time)"]
    assert heat["type"] == "heatmap" and heat["options"]["calculate"] is False
    assert heat["targets"][0]["legendFormat"] == "{{layer}}" and heat["targets"][0]["format"] == "time_series"
    assert metric_names.BALANCEDNESS in heat["targets"][0]["expr"]
    # top-k of per-layer imbalance
    top = panels["Top $topk imbalanced layers: max / mean rank load"]["targets"][0]["expr"]
    assert top.startswith("topk($topk, max by (layer)") and metric_names.RANK_TOKENS in top
    # per-expert detail for the one selected layer
    experts = panels["Layer $layer: tokens/s per expert"]
    assert experts["type"] == "heatmap" and 'layer="$layer"' in experts["targets"][0]["expr"]
    assert experts["targets"][0]["legendFormat"] == "{{expert}}"
    # step duration quantiles per rank
    steps = [t["expr"] for t in panels["Step duration per EP rank (p50, p99)"]["targets"]]
    assert {e.split(",")[0] for e in steps} == {"histogram_quantile(0.99", "histogram_quantile(0.5"}
    assert all(f"sum by (rank, le) (rate({metric_names.STEP_SECONDS}_bucket" in e for e in steps)
    # calibration: value by parameter and source, its uncertainty; one panel per parameter on demand
    table = [t["expr"] for t in panels["Calibration of the cost model"]["targets"]]
    assert table[0].startswith(f"max by (parameter, source) ({metric_names.CALIBRATION_VALUE}")
    assert table[1].startswith(f"max by (parameter) ({metric_names.CALIBRATION_UNCERTAINTY}")
    per_param = panels["Calibration: $parameter"]
    assert per_param["repeat"] == "parameter" and metric_names.CALIBRATION_UNCERTAINTY in per_param["targets"][1]["expr"]
    # the tuner's decisions, rollbacks, and everything else the exporter exports
    for name in (metric_names.RANK_TOKENS, metric_names.EXPERT_REPLICAS, metric_names.REARRANGEMENTS,
                 metric_names.REARRANGEMENT_SECONDS + "_bucket", metric_names.CONFIG_INFO,
                 metric_names.TUNER_DECISIONS, metric_names.TUNER_EVALUATIONS, metric_names.ROLLBACKS,
                 metric_names.TUNER_PREDICTED_GAIN, metric_names.STEP_TOKENS + "_bucket"):
        assert name in exprs, f"no panel shows {name}"
    assert "topk($topk, sum by (layer, expert)" in exprs  # hottest experts
    annotations = {a["name"]: a for a in d["annotations"]["list"] if "expr" in a}
    assert 'decision="Recommend"' in annotations["Tuner recommended"]["expr"]
    assert 'decision="Apply"' in annotations["Tuner applied"]["expr"]
    assert metric_names.ROLLBACKS in annotations["Rollbacks"]["expr"]
    assert annotations["Rollbacks"]["titleFormat"] == "Tuner rolled back: {{reason}}"


def test_collapsed_rows_hold_the_detail():
    rows = {p["title"]: p for p in expert_load()["panels"] if p["type"] == "row"}
    assert [t for t, r in rows.items() if r["collapsed"]] == [
        "Hot experts and replicas (all layers)", "Steps, rearrangements and exporters", "Serving (vLLM)",
        "Autotune and calibration"]
    assert all(r["panels"] for r in rows.values() if r["collapsed"])
    arms = [p for p in rows["Autotune and calibration"]["panels"] if p["title"].endswith("per arm")]
    assert [p["title"] for p in arms] == ["Step time per arm", "Tokens per step per arm", "TTFT per arm"]
    assert all('"arm", "control", "arm", ""' in p["targets"][0]["expr"] for p in arms)  # unlabelled pods: control


def test_annotation_decisions_are_the_tuners():
    from moe_eplb.controller import decisions

    values = set()
    for a in expert_load()["annotations"]["list"]:
        values |= set(re.findall(r'decision="(\w+)"', a.get("expr", "")))
    assert values and values <= set(decisions.DECISIONS)


def test_generator_check_detects_a_stale_dashboard(tmp_path):
    """`python scripts/gen_chart.py --check` (the real command, in a copy of the files it compares)
    passes on the committed files and fails, naming the file, on a hand-edited dashboard."""
    import os
    import shutil
    import subprocess
    import sys

    for part in ("scripts", "charts", "crds"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "chart.md", tmp_path / "docs" / "chart.md")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "operator"))  # the package; scripts/ from the copy

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(tmp_path / "scripts" / "gen_chart.py"), "--check"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    res = check()
    assert res.returncode == 0, res.stderr
    shipped = tmp_path / "charts" / "moe-eplb-operator" / "dashboards" / EXPERT_LOAD
    edited = json.loads(shipped.read_text())
    edited["panels"][0]["title"] = "edited by hand"
    shipped.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    res = check()
    assert res.returncode == 1 and f"dashboards/{EXPERT_LOAD}" in res.stderr, res.stderr
