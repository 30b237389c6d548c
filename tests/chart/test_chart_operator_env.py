"""The environment the chart's Deployment gives the operator container parses, through the real
``moe-eplb run`` option parsing, into the settings the values ask for (the chart -> operator
contract, end to end without a cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from moe_eplb.cli.operator_cmds import run, settings_from_cli
from moe_eplb.controller import settings as s
from tests.chart.chart_support import VALUE_SETS


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def operator_settings(objs: list[dict[str, Any]], monkeypatch) -> s.OperatorSettings:
    """Run the container's command-line parsing with its env (downward-API values filled in)."""
    c = container(objs)
    assert c["command"] == ["moe-eplb"] and c["args"][0] == "run"
    for _opt, var in s.OPTIONS.values():
        monkeypatch.delenv(var, raising=False)
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = {"metadata.name": "moe-eplb-abc", "metadata.namespace": "moe-system"}[
                e["valueFrom"]["fieldRef"]["fieldPath"]]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = run.make_context("run", list(c["args"][1:]))
    return settings_from_cli(ctx, ctx.params, env)


def test_default_values(render, monkeypatch):
    objs = render()
    got = operator_settings(objs, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in container(objs)["ports"]}
    assert got.clusterwide and not got.standalone and got.peering_name == "moe-eplb"
    assert got.prometheus_url is None
    assert got.metrics_port == ports["metrics"]
    assert got.liveness_endpoint == f"http://0.0.0.0:{ports['health']}/healthz"
    assert container(objs)["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert (got.log_level, got.log_format) == ("INFO", "json")
    assert (got.pod_name, got.pod_namespace) == ("moe-eplb-abc", "moe-system")
    assert s.PRIORITY_RANGE[0] <= got.priority <= s.PRIORITY_RANGE[1]  # drawn per replica
    assert dict(got.pod_monitor_labels) == {}
    assert {"name": "MOE_EPLB_POD_MONITOR_LABELS", "value": ""} in container(objs)["env"]
    # the exporter-injection init containers run the operator's own image
    assert got.exporter_image == container(objs)["image"]


def test_values_reach_the_operator(render, monkeypatch):
    got = operator_settings(render({
        "operator": {"watchNamespaces": ["team-a", "team-b"], "prometheusUrl": "http://prom.monitoring:9090",
                     "metricsPort": 9100, "healthPort": 9101, "logLevel": "DEBUG", "logFormat": "text",
                     "extraEnv": [{"name": "MOE_EPLB_PRIORITY", "value": "500"}]},
        "peering": {"name": "team-peering"}}), monkeypatch)
    assert got.namespaces == ("team-a", "team-b") and not got.clusterwide
    assert got.prometheus_url == "http://prom.monitoring:9090"
    assert got.metrics_port == 9100 and got.liveness_endpoint == "http://0.0.0.0:9101/healthz"
    assert (got.log_level, got.log_format) == ("DEBUG", "text")
    assert got.peering_name == "team-peering" and not got.standalone and got.priority == 500


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_value_set_parses(render, monkeypatch, value_set):
    operator_settings(render(VALUE_SETS[value_set]), monkeypatch)


def test_peering_off_is_standalone(render, monkeypatch):
    got = operator_settings(render({"peering": {"enabled": False}, "replicaCount": 1}), monkeypatch)
    assert got.standalone


def test_pod_monitor_labels_reach_the_operator_sorted(render, monkeypatch):
    objs = render({"operator": {"podMonitorLabels": {"release": "kube-prometheus-stack", "team": "ml",
                                                     "example.com/tier": "gpu", "empty": ""}}})
    env = {e["name"]: e.get("value") for e in container(objs)["env"]}
    assert env["MOE_EPLB_POD_MONITOR_LABELS"] == "empty=,example.com/tier=gpu,release=kube-prometheus-stack,team=ml"
    got = operator_settings(objs, monkeypatch)
    assert dict(got.pod_monitor_labels) == {"empty": "", "example.com/tier": "gpu",
                                            "release": "kube-prometheus-stack", "team": "ml"}


def test_exporter_image_follows_the_image_values(render, monkeypatch):
    """MOE_EPLB_EXPORTER_IMAGE is exactly the image the Deployment runs, by tag or by digest, and
    the operator accepts it as an image reference."""
    for values, image in (({"image": {"tag": "0.2.0-rc1"}}, "ghcr.io/moe-eplb/operator:0.2.0-rc1"),
                          ({"image": {"repository": "registry.local:5000/mirror/moe-eplb",
                                      "digest": "sha256:" + "b" * 64}},
                           "registry.local:5000/mirror/moe-eplb@sha256:" + "b" * 64)):
        objs = render(values)
        env = {e["name"]: e.get("value") for e in container(objs)["env"]}
        assert env["MOE_EPLB_EXPORTER_IMAGE"] == container(objs)["image"] == image
        assert operator_settings(objs, monkeypatch).exporter_image == image


def test_every_env_the_chart_sets_is_a_run_option(render):
    """Each MOE_EPLB_* variable the Deployment sets is read by an option of `moe-eplb run`: nothing
    the chart says is silently ignored by the operator (POD_NAME/POD_NAMESPACE are read directly)."""
    objs = render({"operator": {"podMonitorLabels": {"release": "kube-prometheus-stack"}}})
    names = {e["name"] for e in container(objs)["env"]}
    ours = {n for n in names if n.startswith("MOE_EPLB_")}
    assert {"MOE_EPLB_POD_MONITOR_LABELS", "MOE_EPLB_EXPORTER_IMAGE"} <= ours
    read = {p.envvar for p in run.params if isinstance(p.envvar, str)}
    assert ours <= read, f"env the operator does not read: {sorted(ours - read)}"
    assert names - ours == {"POD_NAME", "POD_NAMESPACE"}


def test_schema_refuses_malformed_pod_monitor_labels(chart):
    from tests.chart.chart_support import helm, render_chart

    for bad, where in (({"Bad Key": "x"}, "invalid propertyName 'Bad Key'"),
                       ({"release": "has space"}, "podMonitorLabels/release"),
                       ({"release": "x" * 64}, "podMonitorLabels/release"),
                       ({"release": 1}, "podMonitorLabels/release")):
        with pytest.raises(helm().HelmValuesError, match=where):
            render_chart(chart, {"operator": {"podMonitorLabels": bad}})


def test_operator_refuses_its_own_labels_naming_the_variable(render, monkeypatch):
    """Well-formed labels the operator owns pass the schema but stop the operator at start, with an
    error naming the variable (what `moe-eplb run` prints as a usage error)."""
    objs = render({"operator": {"podMonitorLabels": {"eplb.ai/name": "other"}}})
    with pytest.raises(s.SettingsError, match="MOE_EPLB_POD_MONITOR_LABELS / --pod-monitor-labels: "
                                              "'eplb.ai/name' is set by the operator itself"):
        operator_settings(objs, monkeypatch)


@pytest.mark.parametrize("value, message", [
    ("release", "'release' is not key=value"),
    ("release=a,release=b", "label 'release' is given twice"),
    ("bad key=x", "is not a Kubernetes label key"),
    ("release=-x", "'-x' is not a label value"),
    ("app.kubernetes.io/managed-by=me", "is set by the operator itself"),
])
def test_bad_pod_monitor_labels_name_the_variable(monkeypatch, value, message):
    from click.testing import CliRunner

    from moe_eplb.cli import main

    for _opt, var in s.OPTIONS.values():
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(main, ["run"], env={"MOE_EPLB_POD_MONITOR_LABELS": value})
    assert result.exit_code == 2, result.output
    assert "MOE_EPLB_POD_MONITOR_LABELS / --pod-monitor-labels" in result.output and message in result.output


def test_pod_monitor_labels_option_and_env(monkeypatch):
    """The command line wins over the env."""
    import os

    for _opt, var in s.OPTIONS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOE_EPLB_POD_MONITOR_LABELS", "release=from-env")
    ctx = run.make_context("run", ["--pod-monitor-labels", "b=2,a=1"])
    assert dict(settings_from_cli(ctx, ctx.params, os.environ).pod_monitor_labels) == {"a": "1", "b": "2"}
    ctx = run.make_context("run", [])
    assert dict(settings_from_cli(ctx, ctx.params, os.environ).pod_monitor_labels) == {"release": "from-env"}
