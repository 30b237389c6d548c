"""Fixtures for the chart, dashboard and alert tests (tests/chart).

- ``render(values)``: the chart rendered offline with helm-python-sdk (Helm's Go engine, no helm
  binary), as a list of Kubernetes objects.
- ``prometheus``: a real Prometheus (``/usr/bin/prometheus``) on a free loopback port, scraping a
  sample server that exposes every pinned exporter/operator metric and the checked vLLM metrics,
  with the chart's alert rules loaded. Skipped with a reason when the binary is absent.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "moe-eplb-operator"
RELEASE, RELEASE_NS = "moe-eplb", "moe-system"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chart_samples as samples  # noqa: E402

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


def helm():
    return pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")


@pytest.fixture(scope="session")
def chart():
    return helm().Chart.load(str(CHART_DIR))


def render_chart(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Render like ``helm template moe-eplb charts/moe-eplb-operator -n moe-system``; objects only."""
    out = chart.render(values or {}, name=RELEASE, namespace=RELEASE_NS, is_install=True)
    objs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


@pytest.fixture(scope="session")
def render(chart):
    return lambda values=None: render_chart(chart, values)


def rule_groups(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for o in objs if o["kind"] == "PrometheusRule" for g in o["spec"]["groups"]]


# Alert "for" durations cut to zero so that the rules fire within the test's seconds.
FAST_ALERTS = {"prometheusRule": {"balancednessFor": "0s", "exporterMissingFor": "0s", "operatorDownFor": "0s"}}


@pytest.fixture(scope="session")
def prometheus(chart, tmp_path_factory):
    if not (shutil.which("prometheus") or Path("/usr/bin/prometheus").exists()):
        pytest.skip("no prometheus binary (apt-get install --no-install-recommends prometheus)")
    work = tmp_path_factory.mktemp("prometheus")
    rules = work / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups(render_chart(chart, FAST_ALERTS))}))
    server, port = samples.start_sample_server()
    prom = samples.start_prometheus(work, samples.prometheus_config(port, [str(rules)]))
    try:
        # enough samples of every job for rate()/increase() over a few seconds
        prom.wait_for("min(count_over_time(up[30s]))", lambda r: bool(r) and float(r[0]["value"][1]) >= 4,
                      timeout=40)
        yield prom
    finally:
        prom.process.terminate()
        try:
            prom.process.wait(10)
        except Exception:
            prom.process.kill()
        server.shutdown()
