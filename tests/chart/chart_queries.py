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
    "model": ".*",
    "layer": "0",
    "engine": ".*",
    "topk": "5",
    "job": samples.OP_JOB,
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
    kind: str  # panel | annotation | variable | alert

    @property
    def promql(self) -> str:
        return substitute(self.expr)


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # collapsed rows
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<sel>.+),\s*)?(?P<label>\w+)\)$")


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
            if var["type"] == "query":
                m = _LABEL_VALUES.match(var["definition"])
                assert m, f"{fname} variable {var['name']}: only label_values(selector, label) is used"
                qs.append(Query(f"{fname} variable {var['name']} -> {m['label']}", m["sel"], "variable"))
    return qs


def alert_queries(groups: list[dict[str, Any]]) -> list[Query]:
    return [Query(f"alert {r['alert']}", r["expr"], "alert") for g in groups for r in g["rules"]]
