"""Fixtures for the chart, dashboard and alert tests (tests/chart).

- ``chart`` / ``render(values)``: the chart loaded and rendered offline with helm-python-sdk, as a
  list of Kubernetes objects (helpers in chart_support.py).
- ``prometheus``: a real Prometheus (``/usr/bin/prometheus``) on a free loopback port, scraping a
  sample server that exposes every pinned exporter/operator metric and the checked vLLM metrics,
  with the chart's alert rules loaded. Skipped with a reason when the binary is absent.
"""

from __future__ import annotations

import pytest
import yaml

from tests.chart import chart_samples as samples
from tests.chart.chart_support import (
    CHART_DIR,
    FAST_ALERTS,
    helm,
    render_chart,
    rule_groups,
)
from tests.require import prometheus_tools


@pytest.fixture(scope="session")
def chart():
    return helm().Chart.load(str(CHART_DIR))


@pytest.fixture(scope="session")
def render(chart):
    """``render(values, api_versions=...)``: objects of an install on a cluster with the Prometheus
    Operator CRDs unless ``api_versions`` says otherwise (chart_support.BARE_CLUSTER)."""
    return lambda values=None, **kw: render_chart(chart, values, **kw)


@pytest.fixture(scope="session")
def prometheus(chart, tmp_path_factory):
    prometheus_tools()
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
        prom.stop()
        server.shutdown()
