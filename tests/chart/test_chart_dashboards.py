"""The shipped Grafana dashboards are valid, importable dashboard JSON that follows vLLM's
dashboard conventions, and show what the issue asks for."""

from __future__ import annotations

import re

import pytest
from moe_eplb import metric_names

from tests.chart import chart_queries as cq

DASHBOARDS = cq.load_dashboards()
PANEL_TYPES = {"row", "stat", "timeseries", "heatmap", "bargauge", "table"}


def test_both_dashboards_ship():
    assert {d["title"] for d in DASHBOARDS.values()} == {"MoE expert load", "MoE EPLB operator"}
    assert len({d["uid"] for d in DASHBOARDS.values()}) == 2


@pytest.mark.parametrize("fname", sorted(DASHBOARDS))
def test_grafana_json_is_valid(fname):
    d = DASHBOARDS[fname]
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
    assert "id" not in d or d["id"] is None  # importable by hand: Grafana assigns the id
    panels = cq.all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for p in panels:
        assert p["type"] in PANEL_TYPES
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], f"panel {p['title']} has no query"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            # rates follow vLLM's convention: over $__rate_interval (fixed windows only where the
            # panel means a fixed span, e.g. "in the last hour")
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window in {"$__rate_interval", "$__range", "1h", "24h"}, (p["title"], t["expr"])
    # no overlapping panels
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']} overlaps another"
                cells.add((x, y))
    # every variable a query uses is defined (or is one of Grafana's own)
    used = set()
    for q in cq.dashboard_queries():
        if q.where.startswith(fname):
            used |= {a or b for a, b in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", q.expr)}
    assert used - {"__rate_interval", "__interval", "__range"} <= set(variables)


def test_expert_load_dashboard_has_what_the_issue_asks_for():
    d = next(d for d in DASHBOARDS.values() if d["title"] == "MoE expert load")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "namespace", "moeinference", "model", "layer", "engine"} <= set(variables)
    assert metric_names.MOEINFERENCE_LABEL in variables["moeinference"]["definition"]
    panels = cq.all_panels(d)
    by_type = {}
    for p in panels:
        by_type.setdefault(p["type"], []).append(p)
    heat = by_type["heatmap"][0]
    assert heat["repeat"] == "layer" and metric_names.EXPERT_TOKENS in heat["targets"][0]["expr"]
    # rows = experts as plain series; Grafana's "heatmap" format would de-cumulate them as if
    # they were histogram buckets
    assert heat["targets"][0]["format"] == "time_series" and heat["options"]["calculate"] is False
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    assert "topk($topk" in exprs
    for name in (metric_names.RANK_TOKENS, metric_names.BALANCEDNESS, metric_names.EXPERT_REPLICAS, metric_names.REARRANGEMENTS,
                 metric_names.REARRANGEMENT_SECONDS + "_bucket", metric_names.CONFIG_INFO, metric_names.TUNER_DECISIONS):
        assert name in exprs, f"no panel shows {name}"
    assert 'model_name=~"$model"' in exprs and 'engine=~"$engine"' in exprs  # vLLM's labels
    annotations = {a["name"]: a for a in d["annotations"]["list"] if "expr" in a}
    assert 'decision="Recommend"' in annotations["Tuner recommended"]["expr"]
    assert 'decision="Apply"' in annotations["Tuner applied"]["expr"]
    assert metric_names.ROLLBACKS in annotations["Rollbacks"]["expr"]


def test_annotation_decisions_are_the_tuners():
    from moe_eplb.controller import decisions

    d = next(d for d in DASHBOARDS.values() if d["title"] == "MoE expert load")
    values = set()
    for a in d["annotations"]["list"]:
        values |= set(re.findall(r'decision="(\w+)"', a.get("expr", "")))
    assert values and values <= set(decisions.DECISIONS)
