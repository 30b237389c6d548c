"""Every PromQL expression the chart ships: dashboard panels, variables and annotations, and the
alert rules; with Grafana's variables replaced by values that exist in the sample data
(tests/chart/chart_samples.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chart import chart_samples as samples

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "charts" / "moe-eplb-operator" / "dashboards"

# Grafana variable -> value used in tests (one of the sample series; "All" = ".*")
GRAFANA_VARS = {
    "__rate_interval": "10s",
    "__interval": "5s",
    "__range": "30s",
    "namespace": samples.NS,
    "moeinference": samples.DEMO,
    "model_name": ".*",
    "layer": "0",
    "engine": ".*",
    "topk": "5",
    "job": samples.OP_JOB,
    "parameter": samples.CALIBRATION_PARAMETERS[0],
}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str) -> str:
    """Replace ``$var`` / ``${var}`` like Grafana; an unknown variable is an error."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARS:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARS[name]

    return _VAR.sub(repl, expr)


@dataclass(frozen=True)
class Query:
    where: str  # "<file> panel 12 'Title' A", "<file> annotation 'x'", "alert MoEEPLB..."
    expr: str  # as shipped
    kind: str  # panel | annotation | variable (label_values) | variable-query (query_result) | alert
    label: str = ""  # variable: the label whose values it lists
    regex: str = ""  # variable-query: Grafana's regex that extracts the values from the result

    @property
    def promql(self) -> str:
        """The expression Prometheus runs: Grafana's variables substituted in dashboard queries
        (an alert's ``$1`` is label_replace's, not Grafana's)."""
        return self.expr if self.kind == "alert" else substitute(self.expr)


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # collapsed rows
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<sel>.+),\s*)?(?P<label>\w+)\)$")
_QUERY_RESULT = re.compile(r"^query_result\((?P<expr>.+)\)$")


def variable_query(var: dict[str, Any]) -> str:
    q = var.get("query", "")
    return q["query"] if isinstance(q, dict) else q


def dashboard_queries() -> list[Query]:
    qs: list[Query] = []
    for fname, dash in load_dashboards().items():
        for p in all_panels(dash):
            for t in p.get("targets", []):
                qs.append(Query(f"{fname} panel {p['id']} {p['title']!r} {t['refId']}", t["expr"], "panel"))
        for a in dash["annotations"]["list"]:
            if "expr" in a:
                qs.append(Query(f"{fname} annotation {a['name']!r}", a["expr"], "annotation"))
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            text = variable_query(var)
            if m := _LABEL_VALUES.match(text):
                qs.append(Query(f"{fname} variable {var['name']} -> {m['label']}", m["sel"], "variable",
                                label=m["label"]))
            elif m := _QUERY_RESULT.match(text):
                qs.append(Query(f"{fname} variable {var['name']} (query_result)", m["expr"], "variable-query",
                                regex=var.get("regex", "")))
            else:
                raise AssertionError(f"{fname} variable {var['name']}: only label_values(selector, label) and "
                                     f"query_result(expr) are used, got {text!r}")
    return qs


def default_selection_size(var: dict[str, Any], values: int) -> int:
    """How many values Grafana selects for a variable on first load, when it has ``values`` values.

    A variable with "All" selected (explicitly, or by default: Grafana selects the first option, and
    "All" is the first option of an include-all variable without a saved current value) takes every
    value; a saved multi-value selection takes its length; anything else one value."""
    current = var.get("current") or {}
    value = current.get("value")
    if value in ("$__all", ["$__all"]) or (not value and var.get("includeAll")):
        return values
    if isinstance(value, list):
        return len(value)
    return 1


def default_view_panels(dash: dict[str, Any], values: dict[str, int]) -> list[str]:
    """Titles of the panels Grafana shows when the dashboard opens, repeats expanded.

    ``values``: how many values each variable has on the deployment (e.g. ``{"layer": 58}`` for
    DeepSeek-V3); a variable not named has one. Row headers count (they are panels on screen);
    panels inside a collapsed row do not (Grafana draws them only when the row is opened); a
    repeated panel or row counts once per value its variable takes in the default selection."""
    variables = {v["name"]: v for v in dash["templating"]["list"]}

    def times(p: dict[str, Any]) -> int:
        var = p.get("repeat")
        if not var:
            return 1
        assert var in variables, f"panel {p['title']!r} repeats over an undefined variable ${var}"
        return default_selection_size(variables[var], values.get(var, 1))

    shown: list[str] = []
    row_times = 1  # a repeated (expanded) row repeats the panels that follow it, up to the next row
    for p in dash["panels"]:
        if p["type"] == "row":
            row_times = 1 if p.get("collapsed") else times(p)
            shown += [p["title"]] * (times(p) if p.get("collapsed") else row_times)
            if not p.get("collapsed"):
                assert not p.get("panels"), f"expanded row {p['title']!r} keeps panels inside (Grafana ignores them)"
            continue
        shown += [p["title"]] * (row_times * times(p))
    return shown


def alert_queries(groups: list[dict[str, Any]]) -> list[Query]:
    return [Query(f"alert {r['alert']}", r["expr"], "alert") for g in groups for r in g["rules"]]
