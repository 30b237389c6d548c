"""Helpers shared by the chart tests (tests/chart): the chart's location, the value sets it is
rendered with, and offline rendering with helm-python-sdk (Helm's Go engine, no helm binary).

Capabilities: ``helm install`` asks the API server which API versions it serves and hands them to
the templates as ``.Capabilities.APIVersions``; ``helm template`` takes them from
``--api-versions``. helm-python-sdk 0.2.2's ``Chart.render()`` does not expose that option, but its
native ``helm_render`` call (the Go wrapper's render options: ``name``, ``namespace``,
``is_install``, ``kube_version``, ``api_versions``, ...) does, and sets the same
``chartutil.Capabilities`` Helm's own ``--api-versions`` sets. :func:`render_chart` passes them
through that call, so a test renders the chart exactly as Helm would on a cluster that serves the
given API versions (default: a cluster with the Prometheus Operator, :data:`PROMETHEUS_OPERATOR`)
or on one without (:data:`BARE_CLUSTER`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "moe-eplb-operator"
RELEASE, RELEASE_NS = "moe-eplb", "moe-system"

#: API versions a cluster with the Prometheus Operator CRDs serves on top of the built-in ones
#: (what ``.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"`` asks).
PROMETHEUS_OPERATOR: tuple[str, ...] = ("monitoring.coreos.com/v1",)
#: A cluster with only the built-in APIs (Helm's defaults), e.g. no kube-prometheus-stack.
BARE_CLUSTER: tuple[str, ...] = ()

# The value sets the chart is rendered, linted and validated with.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "monitoring-off": {
        "metrics": {"serviceMonitor": {"enabled": False}},
        "prometheusRule": {"enabled": False},
        "dashboards": {"enabled": False},
    },
    # rendered whatever the cluster serves (helm template for GitOps, helm lint)
    "monitoring-forced": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "prometheusRule": {"enabled": True},
    },
}

# Alert "for" durations cut to zero so that the rules fire within the test's seconds.
FAST_ALERTS = {"prometheusRule": {"balancednessFor": "0s", "exporterMissingFor": "0s", "operatorDownFor": "0s",
                                  "rearrangementStallWindow": "10s", "rearrangementStallFor": "0s"}}


def helm():
    return pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")


def render_manifests(chart: Any, values: dict[str, Any] | None = None, *,
                     api_versions: tuple[str, ...] = PROMETHEUS_OPERATOR) -> dict[str, str]:
    """Template path -> rendered text, like ``helm template moe-eplb charts/moe-eplb-operator -n
    moe-system --api-versions <each of api_versions>`` (an install on a cluster serving them)."""
    from helm_python import _native  # the render call Chart.render() wraps, with every option

    opts = {"name": RELEASE, "namespace": RELEASE_NS, "is_install": True, "api_versions": list(api_versions)}
    rendered = _native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts))
    return json.loads(rendered)


def render_chart(chart: Any, values: dict[str, Any] | None = None, *,
                 api_versions: tuple[str, ...] = PROMETHEUS_OPERATOR) -> list[dict[str, Any]]:
    """Rendered objects (NOTES.txt left out) of an install on a cluster serving ``api_versions``."""
    out = render_manifests(chart, values, api_versions=api_versions)
    objs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


def rule_groups(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for o in objs if o["kind"] == "PrometheusRule" for g in o["spec"]["groups"]]
