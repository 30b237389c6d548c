"""Helpers shared by the chart tests (tests/chart): the chart's location, the value sets it is
rendered with, and offline rendering with helm-python-sdk (Helm's Go engine, no helm binary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "moe-eplb-operator"
RELEASE, RELEASE_NS = "moe-eplb", "moe-system"

# The value sets the chart is rendered, linted and validated with.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "monitoring-off": {
        "metrics": {"serviceMonitor": {"enabled": False}},
        "prometheusRule": {"enabled": False},
        "dashboards": {"enabled": False},
    },
}

# Alert "for" durations cut to zero so that the rules fire within the test's seconds.
FAST_ALERTS = {"prometheusRule": {"balancednessFor": "0s", "exporterMissingFor": "0s", "operatorDownFor": "0s"}}


def helm():
    return pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")


def render_chart(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Render like ``helm template moe-eplb charts/moe-eplb-operator -n moe-system``; objects only."""
    out = chart.render(values or {}, name=RELEASE, namespace=RELEASE_NS, is_install=True)
    objs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


def rule_groups(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for o in objs if o["kind"] == "PrometheusRule" for g in o["spec"]["groups"]]
