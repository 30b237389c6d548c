"""The real Prometheus Operator (v0.94.0, built from its Go module by ``make kube``) turns what the
chart and the operator render into Prometheus' configuration, and a real Prometheus running that
configuration scrapes the engine pods and fires the stall alert.

Everything is real except the GPU nodes and engines: a control plane of its own (the test installs
the Prometheus Operator's CRDs, which other kube tests add and remove on the shared one), the chart
installed with monitoring on and the values docs/chart.md gives for kube-prometheus-stack, the
chart's operator process (under its ServiceAccount), a ``Prometheus`` resource selecting
``release: kube-prometheus-stack`` as kube-prometheus-stack's does, the Prometheus Operator writing its
configuration Secret and rule ConfigMaps, and a real Prometheus (3.14.0, built by ``make kube`` at
the version the operator requires: Debian's 2.42 has no kubernetes service discovery) running that
configuration (:func:`moe_eplb_harness.real.promoperator.localize` changes only the service discovery's
credentials and the rule files' folder). The node agent runs the engine pods on loopback IPs: each serves the exporter's
series on ``eplb-metrics`` (9400) and vLLM's own on ``http`` (8000), as a real pod does. Three
MoEInferences: ``stalled`` (EPLB on, never rearranging), ``healthy``, and ``grouped`` (one engine over
two pods of a LeaderWorkerSet run by the real LWS controller: the PodMonitor's group relabelings).
"""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.parse
import urllib.request
from typing import Any

import pytest
import yaml

from moe_eplb.contracts import metric_names
from moe_eplb.contracts.vllm_facts import REQUESTS_WAITING
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.engines.engine import EngineFaults
from moe_eplb_harness.floor.prometheus import start_prometheus
from moe_eplb_harness.real.controlplane import find_binaries
from moe_eplb_harness.real.promoperator import (
    PrometheusOperator,
    find_operator,
    generated_config,
    localize,
    prometheus_release,
    prometheus_resource,
    prometheus_server,
    rule_files,
)
from tests.chart.chart_support import CHART_DIR
from tests.kube.chart_install import apply, render, start_chart_operator
from tests.polling import eventually
from tests.require import missing

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")

RELEASE_LABEL = {"release": "kube-prometheus-stack"}
MON_NS, PROM = "monitoring", "k8s"
STALLED, HEALTHY, GROUPED = "stalled", "healthy", "grouped"
NAMES = (STALLED, HEALTHY, GROUPED)
STALL_ALERT = "MoEEPLBRearrangementsStalled"
WAIT = {"timeout": 120.0, "interval": 0.5}
#: the alert's window and threshold, shortened so that a test sees it (the PodMonitor scrapes every 15 s)
RULE_VALUES = {"rearrangementStallWindow": "40s", "rearrangementStallIntervals": 3, "rearrangementStallFor": "0s"}


def docs_values() -> dict[str, Any]:
    """docs/chart.md's values for a stock kube-prometheus-stack (the block a user copies)."""
    text = (CHART_DIR.parents[1] / "docs" / "chart.md").read_text()
    block = text.split("<!-- kube-prometheus-stack values:", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def resource(name: str) -> dict[str, Any]:
    """A small MoEInference (4 MoE layers x 16 experts, EP 4) with its PodMonitor on; ``grouped``:
    one engine over 2 pods (a LeaderWorkerSet, run by the real LWS controller)."""
    res = {
        "apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {"name": f"example/tiny-moe-{name}", "architecture": "Qwen3MoeForCausalLM",
                      "moe": {"numExperts": 16, "numMoeLayers": 4, "topK": 2, "numExpertGroups": 1,
                              "bytesPerExpert": 1048576}},
            "engine": {"image": "vllm/vllm-openai:v0.12.0"},
            "parallelism": {"tensor": 1, "data": 4},
            "replicas": 1,
            "eplb": {"enabled": True, "windowSize": 1000, "stepInterval": 1000, "numRedundantExperts": 0},
            "autotune": {"mode": "Off"},
            "monitoring": {"podMonitor": {"enabled": True}},
        },
    }
    if name == GROUPED:
        res["spec"]["parallelism"]["nodes"] = 2
    return res


@pytest.fixture(scope="module")
def parts() -> None:
    absent = []
    if find_binaries() is None:
        absent.append("no control plane built (run `make kube`)")
    if find_operator() is None:
        absent.append("no Prometheus Operator (tools/prometheus-operator/bin) or its Prometheus (tools/prometheus/bin) built (run `make kube`)")
    if absent:
        missing("; ".join(absent))


def api(url: str, path: str, **params: str) -> Any:
    q = ("?" + urllib.parse.urlencode(params)) if params else ""
    with urllib.request.urlopen(f"{url}{path}{q}", timeout=5) as r:
        return json.load(r)["data"]


async def test_prometheus_operator_scrapes_engine_pods_and_fires_the_stall_alert(parts, tmp_path) -> None:
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=1)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=30.0,
                     api_ports=True, faults_for=lambda s: EngineFaults(rearrangement_stalled=STALLED in s.model))
    async with world.run():
        cp = world.plane
        prom_op = PrometheusOperator(cp, tmp_path / "prometheus-operator")
        await asyncio.to_thread(prom_op.install_crds)
        # the chart, with monitoring on (monitoring.coreos.com/v1 is served now) and the docs' values
        values = docs_values()
        values["operator"]["prometheusUrl"] = ""
        values["prometheusRule"].update(RULE_VALUES)
        for ns in ("moe-system", MON_NS):
            cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        objs = render("moe-eplb", "moe-system", values, monitoring=True)
        assert {"ServiceMonitor", "PrometheusRule"} <= {o["kind"] for o in objs}
        await asyncio.to_thread(apply, cp, objs)
        cp.request("POST", f"/apis/monitoring.coreos.com/v1/namespaces/{MON_NS}/prometheuses",
                   prometheus_resource(PROM, MON_NS, select=RELEASE_LABEL,
                                       version=prometheus_release(prometheus_server())))
        with start_chart_operator(cp, objs, tmp_path / "chart-operator", extra_args=("--standalone",)) as op:
            await asyncio.to_thread(prom_op.start)
            try:
                for name in NAMES:
                    await world.apply(copy.deepcopy(resource(name)))
                await _scrape_and_alert(cp, tmp_path)
            finally:
                prom_op.stop()
            assert op.proc.poll() is None, op.output()[-3000:]


async def _scrape_and_alert(cp: Any, tmp_path: Any) -> None:
    """Prometheus with the generated configuration: every engine pod's two ports scraped and
    labelled, the dashboards' variables filled, the stall alert firing for the stalled engine only."""
    config = await eventually(lambda: _config_with_jobs(cp), what="the generated config with both PodMonitors", **WAIT)
    rules = rule_files(cp, MON_NS, PROM)
    assert any(STALL_ALERT in text for files in rules.values() for text in files.values()), rules
    local = localize(config, cp, rules, tmp_path / "prometheus", name=PROM)
    assert "$(" not in json.dumps(local)
    prom = await asyncio.to_thread(start_prometheus, tmp_path / "prometheus", local, binary=str(prometheus_server()))
    with prom:
        # exporter + vLLM port of each single-pod engine; the group's leader both, its worker the exporter
        targets = await eventually(lambda: _up_targets(prom.url, 7), what="7 engine targets up", **WAIT)
        _check_target_labels(targets)
        await _check_dashboard_variables(prom.url)
        alerts = await eventually(lambda: _firing(prom.url), what=f"{STALL_ALERT} firing", **WAIT)
        assert {a["labels"]["moeinference"] for a in alerts} == {STALLED}, alerts
        assert all(a["labels"]["namespace"] == "default" and a["labels"]["severity"] for a in alerts)
        # every alert of the chart evaluates without error on the real series (joins, label names)
        groups = (await asyncio.to_thread(api, prom.url, "/api/v1/rules"))["groups"]
        rules = [r for g in groups for r in g["rules"] if r["name"].startswith("MoEEPLB")]
        assert len(rules) >= 8 and all(r["health"] == "ok" for r in rules), [
            (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        # MoEEPLBExporterMissing's inputs: up per port, by the operator's `endpoint` label
        for endpoint in ("eplb-metrics", "http"):
            up = await asyncio.to_thread(api, prom.url, "/api/v1/query", query=f'up{{namespace="default", endpoint="{endpoint}"}}')
            want = [(GROUPED, "1")] * (2 if endpoint == "eplb-metrics" else 1) + [(HEALTHY, "1"), (STALLED, "1")]
            assert sorted((r["metric"]["moeinference"], r["value"][1]) for r in up["result"]) == want, up


async def _config_with_jobs(cp: Any) -> dict[str, Any] | None:
    """The generated config once it has both endpoints' jobs of both PodMonitors
    (``podMonitor/<namespace>/<name>/<endpoint index>``)."""
    config = await asyncio.to_thread(generated_config, cp, MON_NS, PROM)
    jobs = {sc["job_name"] for sc in (config or {}).get("scrape_configs") or []}
    want = {f"podMonitor/default/{name}/{i}" for name in NAMES for i in (0, 1)}
    return config if want <= jobs else None


async def _up_targets(url: str, n: int) -> list[dict[str, Any]] | None:
    data = await asyncio.to_thread(api, url, "/api/v1/targets", state="active")
    up = [t for t in data["activeTargets"] if t["health"] == "up" and t["labels"].get("namespace") == "default"]
    return up if len(up) >= n else None


def _check_target_labels(targets: list[dict[str, Any]]) -> None:
    """Per engine pod: its exporter port and vLLM's port, each labelled as the dashboards and the
    tuner's reader expect (``namespace``, ``pod``, ``moeinference``, ``container``, ``endpoint``; a
    group's pods also ``replica_group``, ``group_worker``, ``group_size`` from the LWS labels)."""
    by_pod: dict[str, set[str]] = {}
    group: dict[str, tuple[str, str, str]] = {}
    for t in targets:
        lab = t["labels"]
        name = lab[metric_names.MOEINFERENCE_LABEL]
        assert name in NAMES and lab["pod"].startswith(name), lab
        assert lab["container"] == "vllm", lab
        by_pod.setdefault(lab["pod"], set()).add(lab["endpoint"])
        port = t["scrapeUrl"].split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
        assert {"eplb-metrics": "9400", "http": "8000"}[lab["endpoint"]] == port, t
        if name == GROUPED:
            group[lab["pod"]] = (lab.get(metric_names.GROUP_LABEL), lab.get(metric_names.GROUP_WORKER_LABEL),
                                 lab.get(metric_names.GROUP_SIZE_LABEL))
        else:
            assert metric_names.GROUP_LABEL not in lab, lab
    singles = {p: eps for p, eps in by_pod.items() if p not in group}
    assert len(singles) == 2 and all(eps == {"eplb-metrics", "http"} for eps in singles.values()), by_pod
    assert sorted(group.values()) == [("0", "0", "2"), ("0", "1", "2")], group
    assert sorted(by_pod[p] == {"eplb-metrics", "http"} for p in group) == [False, True], by_pod


async def _check_dashboard_variables(url: str) -> None:
    """The expert-load dashboard's variables list the MoEInference from what was scraped: namespace,
    moeinference and model_name from the exporter, engine from vLLM's own port."""
    async def values(match: str, label: str) -> set[str]:
        data = await asyncio.to_thread(api, url, "/api/v1/series", **{"match[]": match})
        return {s.get(label) for s in data if s.get(label)}

    async def listed() -> bool:
        return "default" in await values("moe_eplb_config_info", "namespace")

    await eventually(listed, what="moe_eplb_config_info scraped", **WAIT)
    sel = f'namespace="default", moeinference="{STALLED}"'
    assert await values('moe_eplb_config_info{namespace="default"}', "moeinference") == set(NAMES)
    assert await values(f"moe_eplb_config_info{{{sel}}}", "model_name") == {f"example/tiny-moe-{STALLED}"}
    # the dashboard's $engine lists vllm:num_requests_running's engine label; the simulated engine
    # serves vLLM's num_requests_waiting (same labels, same port), not that gauge
    vllm = f"{REQUESTS_WAITING}{{{sel}}}"
    engines = await eventually(lambda: values(vllm, "engine"), what="vLLM's series from port http", **WAIT)
    assert engines == {"0"}
    # vLLM's series come from vLLM's port only, the exporter's from the exporter's only
    assert await values(vllm, "endpoint") == {"http"}
    assert await values(f"moe_eplb_config_info{{{sel}}}", "endpoint") == {"eplb-metrics"}


async def _firing(url: str) -> list[dict[str, Any]] | None:
    data = await asyncio.to_thread(api, url, "/api/v1/alerts")
    firing = [a for a in data["alerts"] if a["labels"]["alertname"] == STALL_ALERT and a["state"] == "firing"]
    return firing or None
