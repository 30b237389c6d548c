#!/usr/bin/env python3
"""Generate the chart's derived files from their single sources:

- ``charts/moe-eplb-operator/dashboards/*.json``: the Grafana dashboards, built below, with every
  metric name from ``moe_eplb.metric_names`` / ``moe_eplb.exporter.vllm_metric_names``;
- ``charts/moe-eplb-operator/crds/<file>``: byte copies of the top-level ``crds/`` (the CRD's
  source of truth, written by ``moe-eplb crd``);
- ``charts/moe-eplb-operator/files/rbac-rules.yaml``: the operator's RBAC rules from
  ``moe_eplb.controller.rbac.RBAC_RULES``, as-is for cluster-wide mode and split into a
  ClusterRole part (plus ``NAMESPACED_MODE_CLUSTER_RULES``) and a per-namespace Role part for
  namespaced mode;
- the values table of ``docs/chart.md`` from ``values.yaml``.

The outputs are committed (Helm and Grafana read them as they are); ``tests/chart`` fails when
they differ from what this script writes.

    python scripts/gen_chart.py           # write the files
    python scripts/gen_chart.py --check   # exit 1 if a committed file is stale

Conventions follow vLLM's own dashboards (examples/observability): a ``datasource`` variable, rates
over ``$__rate_interval``, the served model in ``model_name`` and the DP engine in ``engine``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from moe_eplb import metric_names
from moe_eplb.controller import decisions

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "moe-eplb-operator"
DASHBOARD_DIR = CHART / "dashboards"

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}

# Values of the ``decision`` label of moe_eplb_tuner_decisions_total shown as annotations
# (the autotune loop counts one decision per evaluation; the values live in controller.decisions).
DECISION_RECOMMEND = decisions.RECOMMEND
DECISION_APPLY = decisions.APPLY

# Label selectors shared by the queries. The exporter's series carry ``model``/``layer``/... from
# the exporter plus ``namespace``, ``pod`` and ``moeinference`` added at scrape time by the
# PodMonitor; vLLM's series carry ``model_name`` and ``engine``; the operator's tuner series carry
# ``namespace`` and ``name`` (the MoEInference) and need ``honorLabels: true`` on the ServiceMonitor.
SEL = 'namespace="$namespace", moeinference="$moeinference", model=~"$model"'
SEL_LAYER = SEL + ', layer=~"$layer"'
SEL_VLLM = 'namespace="$namespace", moeinference="$moeinference", model_name=~"$model", engine=~"$engine"'
SEL_TUNER = 'namespace="$namespace", name="$moeinference"'
RATE = "[$__rate_interval]"


class Layout:
    """Hands out unique panel ids and grid positions (24 columns wide, rows of panels)."""

    def __init__(self) -> None:
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def place(self, w: int, h: int) -> tuple[int, dict[str, int]]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        pid = self.next_id
        self.next_id += 1
        return pid, pos

    def new_row(self) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
           fmt: str = "time_series") -> dict[str, Any]:
    t: dict[str, Any] = {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "refId": ref,
        "range": not instant,
        "instant": instant,
        "format": fmt,
    }
    return t


def panel(lay: Layout, kind: str, title: str, description: str, targets: list[dict[str, Any]],
          *, w: int = 12, h: int = 8, unit: str = "short", extra: dict[str, Any] | None = None,
          options: dict[str, Any] | None = None, decimals: int | None = None,
          minmax: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:
    pid, pos = lay.place(w, h)
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    defaults: dict[str, Any] = {"unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    if minmax[0] is not None:
        defaults["min"] = minmax[0]
    if minmax[1] is not None:
        defaults["max"] = minmax[1]
    p: dict[str, Any] = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": pos,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or {},
    }
    if extra:
        p.update(extra)
    return p


def row(lay: Layout, title: str, *, collapsed: bool = False) -> dict[str, Any]:
    lay.new_row()
    pid, pos = lay.place(24, 1)
    lay.new_row()
    return {"id": pid, "type": "row", "title": title, "collapsed": collapsed, "gridPos": pos,
            "panels": []}


def datasource_var() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
            "options": []}


def query_var(name: str, label: str, query: str, *, multi: bool = False, include_all: bool = False,
              sort: int = 1) -> dict[str, Any]:
    v: dict[str, Any] = {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2, "sort": sort, "multi": multi, "includeAll": include_all,
        "current": {}, "hide": 0, "options": [], "regex": "",
    }
    if include_all:
        v["allValue"] = ".*"
    return v


def custom_var(name: str, label: str, values: list[str]) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "custom", "query": ",".join(values),
            "current": {"text": values[0], "value": values[0]}, "hide": 0, "multi": False,
            "includeAll": False,
            "options": [{"text": v, "value": v, "selected": i == 0} for i, v in enumerate(values)]}


def annotation(name: str, expr: str, title: str, color: str, *, enable: bool = True,
               tags: str = "") -> dict[str, Any]:
    return {"name": name, "datasource": DS, "enable": enable, "hide": False, "iconColor": color,
            "expr": expr, "step": "60s", "titleFormat": title, "tagKeys": tags,
            "useValueForTime": False, "textFormat": ""}


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]],
              variables: list[dict[str, Any]], annotations: list[dict[str, Any]],
              tags: list[str]) -> dict[str, Any]:
    builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
               "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
               "name": "Annotations & Alerts", "type": "dashboard"}
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": [builtin, *annotations]},
        "templating": {"list": variables},
        "panels": panels,
    }


def _ts(lay: Layout, title: str, desc: str, targets: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return panel(lay, "timeseries", title, desc, targets,
                 options={"legend": {"displayMode": "table", "placement": "right",
                                     "calcs": ["mean", "max", "lastNotNull"]},
                          "tooltip": {"mode": "multi", "sort": "desc"}}, **kw)


def _stat(lay: Layout, title: str, desc: str, expr: str, **kw: Any) -> dict[str, Any]:
    return panel(lay, "stat", title, desc, [target(expr)], w=kw.pop("w", 4), h=kw.pop("h", 4),
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto"}, **kw)


def expert_load() -> dict[str, Any]:
    """The "MoE expert load" dashboard: one MoEInference, its experts, ranks, EPLB and serving."""
    lay = Layout()
    tok = f"rate({metric_names.EXPERT_TOKENS}{{{SEL_LAYER}}}{RATE})"
    rank = f"rate({metric_names.RANK_TOKENS}{{{SEL_LAYER}}}{RATE})"
    replicas = f"max by (layer, expert) ({metric_names.EXPERT_REPLICAS}{{{SEL_LAYER}}})"
    # replica count with the exporter's "reduced" mode in mind: an absent gauge means 1 replica
    replicas_or_one = f"({replicas} or on (layer, expert) (sum by (layer, expert) ({tok}) * 0 + 1))"
    # per-layer balancedness: the exporter's gauge where it has every rank of the engine, else
    # computed from the per-rank counters (engines spanning pods)
    rank_by = f"sum by (layer, rank) ({rank})"
    bal = (f"(min by (layer) ({metric_names.BALANCEDNESS}{{{SEL_LAYER}}}) or "
           f"avg by (layer) ({rank_by}) / max by (layer) ({rank_by}))")
    panels: list[dict[str, Any]] = []

    panels.append(row(lay, "Overview"))
    panels += [
        _stat(lay, "Balancedness (mean of layers)",
              "Mean over the selected MoE layers of the exporter's per-layer balancedness "
              "(mean / max of the tokens each EP rank processes; 1 = perfectly balanced).",
              f"avg({bal})", unit="percentunit",
              decimals=1, minmax=(0, 1)),
        _stat(lay, "Worst layer balancedness", "Lowest per-layer balancedness among the selected layers.",
              f"min({bal})", unit="percentunit", decimals=1, minmax=(0, 1)),
        _stat(lay, "Routed tokens/s", "Expert activations per second: each token counts once per "
              "top-k expert it is routed to (tokens × top-k), summed over the selected layers.",
              f"sum({tok})", unit="short"),
        _stat(lay, "Rearrangements in range", "EPLB rearrangements (expert weight moves) in the "
              "dashboard's time range, over all pods.",
              f"sum(increase({metric_names.REARRANGEMENTS}{{{SEL}}}[$__range]))", unit="none", decimals=0),
        _stat(lay, "Tuner predicted gain", "Relative throughput gain the autotune loop predicts "
              "for its last recommendation over the running settings.",
              f"max({metric_names.TUNER_PREDICTED_GAIN}{{{SEL_TUNER}}})", unit="percentunit", decimals=1),
        _stat(lay, "Generation tokens/s", "Output tokens per second from vLLM (all pods).",
              f"sum(rate(vllm:generation_tokens_total{{{SEL_VLLM}}}{RATE}))", unit="short"),
    ]
    panels.append(panel(
        lay, "table", "EPLB settings running", "The EPLB settings each pod runs with, from the "
        "exporter's info metric (window size and step interval in engine steps).",
        [target(f"max by (pod, model, window_size, step_interval, num_redundant_experts, ep_size) "
                f"({metric_names.CONFIG_INFO}{{{SEL}}})", instant=True, fmt="table")],
        w=24, h=5, extra={"transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True}}}]}))

    panels.append(row(lay, "Expert load per layer"))
    panels.append(panel(
        lay, "heatmap", "Layer $layer: tokens/s per expert",
        "Tokens per second routed to each logical expert of this layer over time (one row per "
        "expert). Hot rows are the experts EPLB replicates.",
        [target(f'sum by (expert) (rate({metric_names.EXPERT_TOKENS}{{{SEL}, layer="$layer"}}{RATE}))',
                "{{expert}}")],  # one series per expert = one heatmap row (not "heatmap"
                                 # format, which would de-cumulate them like histogram buckets)
        w=12, h=9, unit="short",
        extra={"repeat": "layer", "repeatDirection": "h", "maxPerRow": 2},
        options={"calculate": False, "yAxis": {"axisPlacement": "left", "unit": "none"},
                 "rowsFrame": {"layout": "auto"}, "cellGap": 0,
                 "color": {"mode": "scheme", "scheme": "Oranges", "exponent": 0.5, "fill": "dark-orange",
                           "reverse": False, "scale": "exponential", "steps": 64},
                 "legend": {"show": True}, "tooltip": {"show": True, "yHistogram": False},
                 "filterValues": {"le": 1e-9}}))

    panels.append(row(lay, "Hot experts and replicas"))
    panels.append(panel(
        lay, "bargauge", "Top $topk hot experts", "The experts with the most tokens/s among the "
        "selected layers right now.",
        [target(f"topk($topk, sum by (layer, expert) ({tok}))", "layer {{layer}} expert {{expert}}",
                instant=True)],
        w=8, h=10, unit="short",
        options={"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                 "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}))
    panels.append(panel(
        lay, "bargauge", "Top $topk load per replica", "Tokens/s per physical replica for the "
        "hottest experts (expert load / replica count): what EPLB evens out across ranks.",
        [target(f"topk($topk, sum by (layer, expert) ({tok}) / on (layer, expert) {replicas_or_one})",
                "layer {{layer}} expert {{expert}}", instant=True)],
        w=8, h=10, unit="short",
        options={"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                 "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}))
    panels.append(panel(
        lay, "table", "Replicated experts", "Experts that EPLB currently holds more than one "
        "physical copy of, with their replica count.",
        [target(f"{replicas} > 1", instant=True, fmt="table")],
        w=8, h=10, unit="none",
        extra={"transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True}, "renameByName": {"Value": "replicas"}}}]}))
    panels.append(_ts(
        lay, "Redundant replicas per layer", "Physical expert slots beyond one per logical expert, "
        "per layer (the running num_redundant_experts, as placed by EPLB).",
        [target(f"sum by (layer) ({replicas}) - count by (layer) ({replicas})", "layer {{layer}}")],
        w=24, h=7, unit="none", decimals=0))

    panels.append(row(lay, "Ranks and balance"))
    panels.append(_ts(
        lay, "Per-rank load", "Tokens/s each EP rank processes, summed over the selected layers. "
        "The gap between the top and the mean line is the imbalance.",
        [target(f"sum by (pod, rank) ({rank})", "{{pod}} rank {{rank}}")], unit="short"))
    panels.append(_ts(
        lay, "Balancedness per layer (exporter)", "Per-layer balancedness reported by the exporter "
        "(mean over ranks / max over ranks of tokens processed; 1 = balanced). Exported only by pods "
        "that hold every EP rank of their engine; see the panel computed from rank rates otherwise.",
        [target(f"min by (layer) ({metric_names.BALANCEDNESS}{{{SEL_LAYER}}})", "layer {{layer}}")],
        unit="percentunit", minmax=(0, 1)))
    panels.append(_ts(
        lay, "Balancedness per layer (from rank rates)", "The same ratio computed in Prometheus "
        "from per-rank token rates over $__rate_interval, summed over pods per rank.",
        [target(f"avg by (layer) (sum by (layer, rank) ({rank})) / "
                f"max by (layer) (sum by (layer, rank) ({rank}))", "layer {{layer}}")],
        unit="percentunit", minmax=(0, 1)))
    panels.append(_ts(
        lay, "Max / mean rank load", "Imbalance factor per layer: the busiest rank's load over the "
        "mean (1 = balanced; the step time of an MoE layer follows the busiest rank).",
        [target(f"max by (layer) (sum by (layer, rank) ({rank})) / "
                f"avg by (layer) (sum by (layer, rank) ({rank}))", "layer {{layer}}")],
        unit="none", decimals=2))

    panels.append(row(lay, "Rearrangements"))
    rs = f"{metric_names.REARRANGEMENT_SECONDS}_bucket{{{SEL}}}"
    panels.append(panel(
        lay, "timeseries", "Rearrangements", "EPLB rearrangements per interval, per pod.",
        [target(f"sum by (pod) (increase({metric_names.REARRANGEMENTS}{{{SEL}}}{RATE}))", "{{pod}}")],
        w=8, unit="none", options={"legend": {"displayMode": "list", "placement": "bottom"}},
        extra={"fieldConfig": {"defaults": {"unit": "none", "custom": {"drawStyle": "bars",
                                                                          "fillOpacity": 80}},
                               "overrides": []}}))
    panels.append(_ts(
        lay, "Rearrangement duration", "How long a rearrangement takes (weight moves; a sync "
        "rearrangement stalls the engine for this long).",
        [target(f"histogram_quantile(0.5, sum by (le) (rate({rs}{RATE})))", "p50"),
         target(f"histogram_quantile(0.99, sum by (le) (rate({rs}{RATE})))", "p99"),
         target(f"sum(rate({metric_names.REARRANGEMENT_SECONDS}_sum{{{SEL}}}{RATE})) / "
                f"sum(rate({metric_names.REARRANGEMENT_SECONDS}_count{{{SEL}}}{RATE}))", "mean")],
        w=8, unit="s"))
    panels.append(_ts(
        lay, "Engine steps/s", "Engine steps per second per pod: window size and step interval "
        "are counted in steps, so this converts them to seconds.",
        [target(f"sum by (pod) (rate({metric_names.ENGINE_STEPS}{{{SEL}}}{RATE}))", "{{pod}}")], w=8,
        unit="short"))
    panels.append(_stat(
        lay, "EP ranks reporting", "EP ranks whose load the exporters serve, over all pods; it "
        "should equal the EP size (tensor x data) times the replicas.",
        f"sum(max by (pod) ({metric_names.EXPORTER_RANKS}{{{SEL}}}))", unit="none", decimals=0, w=12))
    panels.append(_stat(
        lay, "Exporter restarts in range", "Times an exporter restarted (its counters start again "
        "at 0) in the dashboard's time range: an engine restart, e.g. after an applied change.",
        f"sum(changes({metric_names.EXPORTER_START_TIME}{{{SEL}}}[$__range]))", unit="none", decimals=0, w=12))

    panels.append(row(lay, "Serving (vLLM)"))
    for metric, title in (("vllm:time_to_first_token_seconds", "Time to first token"),
                          ("vllm:inter_token_latency_seconds", "Inter-token latency")):
        b = f"{metric}_bucket{{{SEL_VLLM}}}"
        panels.append(_ts(
            lay, title, f"{title} quantiles from vLLM's histogram over $__rate_interval, all pods.",
            [target(f"histogram_quantile({q}, sum by (le) (rate({b}{RATE})))", f"p{int(q * 100)}")
             for q in (0.5, 0.9, 0.99)] +
            [target(f"sum(rate({metric}_sum{{{SEL_VLLM}}}{RATE})) / "
                    f"sum(rate({metric}_count{{{SEL_VLLM}}}{RATE}))", "mean")],
            w=12, unit="s"))
    panels.append(_ts(
        lay, "Token throughput", "Prompt (prefill) and generation tokens per second.",
        [target(f"sum(rate(vllm:prompt_tokens_total{{{SEL_VLLM}}}{RATE}))", "prompt"),
         target(f"sum(rate(vllm:generation_tokens_total{{{SEL_VLLM}}}{RATE}))", "generation")],
        w=8, unit="short"))
    panels.append(_ts(
        lay, "Requests running / waiting", "Requests in the running batch and in the queue.",
        [target(f"sum(vllm:num_requests_running{{{SEL_VLLM}}})", "running"),
         target(f"sum(vllm:num_requests_waiting{{{SEL_VLLM}}})", "waiting")],
        w=8, unit="none"))
    panels.append(_ts(
        lay, "KV-cache usage", "KV-cache usage per pod and DP engine (1 = full).",
        [target(f"max by (pod, engine) (vllm:kv_cache_usage_perc{{{SEL_VLLM}}})",
                "{{pod}} engine {{engine}}")],
        w=8, unit="percentunit", minmax=(0, 1)))

    panels.append(row(lay, "Autotune"))
    panels.append(_ts(
        lay, "Tuner evaluations", "Evaluations of the autotune loop for this MoEInference, by result.",
        [target(f"sum by (result) (increase({metric_names.TUNER_EVALUATIONS}{{{SEL_TUNER}}}{RATE}))", "{{result}}")],
        w=8, unit="none"))
    panels.append(_ts(
        lay, "Tuner decisions", "What each evaluation decided: " + ", ".join(decisions.DECISIONS) + ".",
        [target(f"sum by (decision) (increase({metric_names.TUNER_DECISIONS}{{{SEL_TUNER}}}{RATE}))", "{{decision}}")],
        w=8, unit="none"))
    panels.append(_ts(
        lay, "Predicted gain and rollbacks", "Predicted relative throughput gain of the last "
        "recommendation, and rollbacks of applied settings by reason.",
        [target(f"max({metric_names.TUNER_PREDICTED_GAIN}{{{SEL_TUNER}}})", "predicted gain"),
         target(f"sum by (reason) (increase({metric_names.ROLLBACKS}{{{SEL_TUNER}}}{RATE}))",
                "rollback: {{reason}}")],
        w=8, unit="none"))

    variables = [
        datasource_var(),
        query_var("namespace", "Namespace", f"label_values({metric_names.CONFIG_INFO}, namespace)"),
        query_var("moeinference", "MoEInference",
                  f'label_values({metric_names.CONFIG_INFO}{{namespace="$namespace"}}, {metric_names.MOEINFERENCE_LABEL})'),
        query_var("model", "Model",
                  f'label_values({metric_names.CONFIG_INFO}{{namespace="$namespace", moeinference="$moeinference"}}, model)',
                  include_all=True),
        query_var("layer", "MoE layer",
                  f'label_values({metric_names.RANK_TOKENS}{{{SEL}}}, layer)', multi=True, include_all=True,
                  sort=3),
        query_var("engine", "DP engine",
                  'label_values(vllm:num_requests_running{namespace="$namespace", '
                  'moeinference="$moeinference"}, engine)', multi=True, include_all=True, sort=3),
        custom_var("topk", "Top experts", ["10", "5", "20", "50"]),
    ]
    annotations = [
        annotation("Tuner recommended",
                   f'sum by (decision) (increase({metric_names.TUNER_DECISIONS}{{{SEL_TUNER}, '
                   f'decision="{DECISION_RECOMMEND}"}}[2m])) > 0',
                   "Tuner recommended new EPLB settings", "yellow", tags="decision"),
        annotation("Tuner applied",
                   f'sum by (decision) (increase({metric_names.TUNER_DECISIONS}{{{SEL_TUNER}, '
                   f'decision="{DECISION_APPLY}"}}[2m])) > 0',
                   "Tuner applied new EPLB settings (pods roll)", "green", tags="decision"),
        annotation("Rollbacks",
                   f"sum by (reason) (increase({metric_names.ROLLBACKS}{{{SEL_TUNER}}}[2m])) > 0",
                   "Tuner rolled back: {{reason}}", "red", tags="reason"),
        annotation("Rearrangements",
                   f"sum(increase({metric_names.REARRANGEMENTS}{{{SEL}}}[2m])) > 0",
                   "EPLB rearrangement", "blue", enable=False),
    ]
    return dashboard(
        "moe-eplb-expert-load", "MoE expert load",
        "Per-expert and per-rank load of a MoEInference running vLLM with EPLB, its rearrangements, "
        "the autotune loop's decisions and vLLM's serving metrics side by side.",
        panels, variables, annotations, ["moe-eplb", "vllm", "eplb"])


def operator_overview() -> dict[str, Any]:
    """The "MoE EPLB operator" dashboard: the operator's reconciles and the tuner across resources."""
    lay = Layout()
    sel = 'namespace=~"$namespace"'
    panels: list[dict[str, Any]] = [row(lay, "Operator")]
    panels += [
        _stat(lay, "Operator replicas up", "Operator pods Prometheus scrapes successfully "
              "(one leads via kopf peering, the others stand by).",
              'sum(up{job=~"$job"})', unit="none", decimals=0, w=6),
        _stat(lay, "Reconcile errors (1h)", "Reconciles that failed in the last hour (result=error; "
              "result=invalid counts specs the validation rejected).",
              f'sum(increase({metric_names.RECONCILES}{{job=~"$job", result="error"}}[1h]))', unit="none",
              decimals=0, w=6),
        _stat(lay, "Tuner evaluations (1h)", "Autotune evaluations in the last hour.",
              f"sum(increase({metric_names.TUNER_EVALUATIONS}{{{sel}}}[1h]))", unit="none", decimals=0, w=6),
        _stat(lay, "Rollbacks (24h)", "Rollbacks of applied EPLB settings in the last day.",
              f"sum(increase({metric_names.ROLLBACKS}{{{sel}}}[24h]))", unit="none", decimals=0, w=6),
    ]
    panels.append(_ts(lay, "Reconciles", "Reconciles per second by result.",
                      [target(f'sum by (result) (rate({metric_names.RECONCILES}{{job=~"$job"}}{RATE}))', "{{result}}")],
                      unit="ops"))
    panels.append(_ts(lay, "Tuner evaluation duration", "Time one tuner evaluation takes "
                      "(reading load, simulating candidate settings).",
                      [target(f'histogram_quantile({q}, sum by (le) (rate({metric_names.TUNER_DURATION_SECONDS}_bucket'
                              f'{{job=~"$job"}}{RATE})))', f"p{int(q * 100)}") for q in (0.5, 0.99)],
                      unit="s"))
    panels.append(row(lay, "Autotune per MoEInference"))
    panels.append(_ts(lay, "Evaluations by result", "Tuner evaluations per MoEInference and result.",
                      [target(f"sum by (namespace, name, result) "
                              f"(increase({metric_names.TUNER_EVALUATIONS}{{{sel}}}{RATE}))",
                              "{{namespace}}/{{name}} {{result}}")], unit="none"))
    panels.append(_ts(lay, "Decisions", "Tuner decisions per MoEInference.",
                      [target(f"sum by (namespace, name, decision) "
                              f"(increase({metric_names.TUNER_DECISIONS}{{{sel}}}{RATE}))",
                              "{{namespace}}/{{name}} {{decision}}")], unit="none"))
    panels.append(_ts(lay, "Predicted gain", "Predicted relative throughput gain of each MoEInference's "
                      "last recommendation.",
                      [target(f"max by (namespace, name) ({metric_names.TUNER_PREDICTED_GAIN}{{{sel}}})",
                              "{{namespace}}/{{name}}")], unit="percentunit"))
    panels.append(_ts(lay, "Time since last successful evaluation", "Age of the last successful "
                      "tuner evaluation per MoEInference; it should stay near the evaluation interval.",
                      [target(f"time() - max by (namespace, name) ({metric_names.TUNER_LAST_SUCCESS}{{{sel}}})",
                              "{{namespace}}/{{name}}")], unit="s"))
    variables = [
        datasource_var(),
        query_var("job", "Operator job", f"label_values({metric_names.RECONCILES}, job)", multi=True,
                  include_all=True),
        query_var("namespace", "Namespace", f"label_values({metric_names.TUNER_EVALUATIONS}, namespace)",
                  multi=True, include_all=True),
    ]
    annotations = [annotation("Rollbacks",
                              f"sum by (namespace, name, reason) (increase({metric_names.ROLLBACKS}{{{sel}}}[2m])) > 0",
                              "Rollback {{namespace}}/{{name}}: {{reason}}", "red", tags="reason")]
    return dashboard("moe-eplb-operator", "MoE EPLB operator",
                     "The moe-eplb operator: reconciles and the autotune loop across MoEInferences.",
                     panels, variables, annotations, ["moe-eplb"])


DASHBOARDS = {
    "moe-expert-load.json": expert_load,
    "moe-eplb-operator.json": operator_overview,
}


def render_dashboards() -> dict[Path, str]:
    """Dashboard path -> JSON text (sorted keys, 2-space indent, trailing newline)."""
    return {DASHBOARD_DIR / name: json.dumps(build(), indent=2, sort_keys=True) + "\n"
            for name, build in DASHBOARDS.items()}


def render_crds() -> dict[Path, str]:
    """The chart's copies of the top-level CRDs (the chart also ships kopf's peering CRDs)."""
    return {CHART / "crds" / p.name: p.read_text() for p in sorted((ROOT / "crds").glob("*.yaml"))}


# Cluster-scoped resources among RBAC_RULES: they stay in a ClusterRole in namespaced mode.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("kopf.dev", "clusterkopfpeerings")}
# In namespaced mode kopf meets its peers in a KopfPeering per namespace instead.
NAMESPACED_PEERING = {("kopf.dev", "clusterkopfpeerings"): ("kopf.dev", "kopfpeerings")}


def split_rules(rules: list[dict[str, list[str]]], namespaced_cluster_extra: list[dict[str, list[str]]] = ()
                ) -> dict[str, list[dict[str, list[str]]]]:
    """RBAC_RULES -> ``{"clusterWide": rules, "namespacedCluster": [...], "namespaced": [...]}``.

    ``namespacedCluster`` holds the rules on cluster-scoped resources that namespaced mode still
    needs (kopf's CRD discovery) followed by ``namespaced_cluster_extra`` (kopf's namespace
    observer: NAMESPACED_MODE_CLUSTER_RULES); ``namespaced`` is the Role for each watched namespace,
    with the ClusterKopfPeering rule turned into the same verbs on KopfPeering. Nothing else is added.
    """
    cluster, namespaced = [], []
    for rule in rules:
        for group in rule["apiGroups"]:
            parts: dict[str, list[str]] = {"cluster": [], "namespaced": [], "peering": []}
            for res in rule["resources"]:
                key = (group, res.split("/")[0])
                kind = "peering" if key in NAMESPACED_PEERING else "cluster" if key in CLUSTER_SCOPED else "namespaced"
                parts[kind].append(NAMESPACED_PEERING[key][1] if kind == "peering" else res)
            verbs = list(rule["verbs"])
            if parts["cluster"]:
                cluster.append({"apiGroups": [group], "resources": parts["cluster"], "verbs": verbs})
            if parts["namespaced"]:
                namespaced.append({"apiGroups": [group], "resources": parts["namespaced"], "verbs": verbs})
            if parts["peering"]:
                namespaced.append({"apiGroups": [group], "resources": parts["peering"], "verbs": verbs})
    cluster += [dict(r) for r in namespaced_cluster_extra]
    return {"clusterWide": [dict(r) for r in rules], "namespacedCluster": cluster, "namespaced": namespaced}


def render_rbac() -> dict[Path, str]:
    from moe_eplb.controller.rbac import NAMESPACED_MODE_CLUSTER_RULES, RBAC_RULES

    header = ("# GENERATED by scripts/gen_chart.py from moe_eplb.controller.rbac.RBAC_RULES and\n"
              "# NAMESPACED_MODE_CLUSTER_RULES; do not edit.\n"
              "# clusterWide: the ClusterRole of cluster-wide mode (operator.watchNamespaces empty).\n"
              "# namespacedCluster + namespaced: namespaced mode's ClusterRole and per-namespace Role.\n")
    body = yaml.safe_dump(split_rules(RBAC_RULES, NAMESPACED_MODE_CLUSTER_RULES), sort_keys=False, default_flow_style=None, width=100)
    return {CHART / "files" / "rbac-rules.yaml": header + body}


def values_rows(values_yaml: str) -> list[tuple[str, str, str]]:
    """``(dotted key, default, comment)`` for every leaf of values.yaml, in file order.

    The comment is the ``#`` block right above the key (``-- `` prefix dropped); a leaf without
    one (inside a Kubernetes-typed block such as ``resources``) is reported under its parent.
    """
    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    covered: set[str] = set()
    for line in values_yaml.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip().removeprefix("-- ").strip())
            continue
        if not stripped or stripped.startswith("- ") or ":" not in stripped:
            comment = []
            continue
        indent = len(line) - len(line.lstrip())
        key, _, rest = stripped.partition(":")
        stack = [(i, k) for i, k in stack if i < indent]
        path = ".".join([k for _, k in stack] + [key])
        text = " ".join(c for c in comment if c)
        if rest.strip() and not any(path.startswith(c + ".") for c in covered):
            rows.append((path, rest.strip(), text))
        if not rest.strip():
            stack.append((indent, key))
            if text and path in {"resources", "podSecurityContext", "securityContext"}:
                rows.append((path, "(see values.yaml)", text))
                covered.add(path)
        comment = []
    return rows


VALUES_START, VALUES_END = "<!-- values:start -->", "<!-- values:end -->"


def render_chart_doc() -> dict[Path, str]:
    """docs/chart.md with its values table regenerated from values.yaml (between the markers)."""
    doc = ROOT / "docs" / "chart.md"
    if not doc.exists():
        return {}
    text = doc.read_text()
    head, _, rest = text.partition(VALUES_START)
    _, _, tail = rest.partition(VALUES_END)
    rows = ["| Value | Default | Meaning |", "| --- | --- | --- |"]
    for key, default, comment in values_rows((CHART / "values.yaml").read_text()):
        rows.append(f"| `{key}` | `{default}` | {comment.replace('|', '/')} |")
    return {doc: head + VALUES_START + "\n" + "\n".join(rows) + "\n" + VALUES_END + tail}


def render_all() -> dict[Path, str]:
    return {**render_dashboards(), **render_crds(), **render_rbac(), **render_chart_doc()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = ap.parse_args(argv)
    stale = []
    for path, text in render_all().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale: " + ", ".join(stale) + " (run: python scripts/gen_chart.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
