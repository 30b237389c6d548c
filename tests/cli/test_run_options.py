"""``moe-eplb run`` options and their environment variables -> OperatorSettings (pure: click's own
parsing of the command, no operator started)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.cli.operator_cmds import run, settings_from_cli
from moe_eplb.contracts import k8s_names
from moe_eplb.controller import settings as s

ENV_VARS = [env for _opt, env in s.OPTIONS.values()]


def parse(monkeypatch, env: dict[str, str], args: tuple[str, ...] = ()) -> s.OperatorSettings:
    for var in ENV_VARS + ["POD_NAME", "POD_NAMESPACE"]:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import os

    ctx = run.make_context("run", list(args))
    return settings_from_cli(ctx, ctx.params, os.environ)


def test_help_shows_every_env_var():
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    for option, env in s.OPTIONS.values():
        assert option in out and env in out, (option, env)


def test_defaults_without_env(monkeypatch):
    got = parse(monkeypatch, {})
    assert got.prometheus_url is None and got.namespaces == () and got.clusterwide
    assert not got.standalone and got.peering_name == "moe-eplb"
    assert got.liveness_endpoint == "http://0.0.0.0:8081/healthz"
    assert got.metrics_port == k8s_names.OPERATOR_METRICS_PORT and got.resync_seconds == 60.0
    assert (got.log_level, got.log_format) == ("INFO", "text")
    assert s.PRIORITY_RANGE[0] <= got.priority <= s.PRIORITY_RANGE[1]


def test_chart_style_env(monkeypatch):
    got = parse(monkeypatch, {
        "MOE_EPLB_PROMETHEUS_URL": "http://prometheus-operated.monitoring.svc:9090",
        "MOE_EPLB_NAMESPACES": "team-a, team-b,,team-a", "MOE_EPLB_PEERING": "ha",
        "MOE_EPLB_METRICS_PORT": "9100", "MOE_EPLB_HEALTH_PORT": "9101", "MOE_EPLB_LOG_LEVEL": "warning",
        "MOE_EPLB_LOG_FORMAT": "JSON", "MOE_EPLB_PRIORITY": "7", "MOE_EPLB_RESYNC_SECONDS": "15",
        "POD_NAME": "op-0", "POD_NAMESPACE": "moe-system"})
    assert got == s.OperatorSettings(
        prometheus_url="http://prometheus-operated.monitoring.svc:9090", namespaces=("team-a", "team-b"),
        standalone=False, peering_name="ha", peering_required=True, priority=7, liveness_endpoint="http://0.0.0.0:9101/healthz",
        metrics_port=9100, resync_seconds=15.0, log_level="WARNING", log_format="json", pod_name="op-0",
        pod_namespace="moe-system")
    assert not got.clusterwide


def test_empty_env_values(monkeypatch):
    """The chart writes '' for: all namespaces, standalone (peering off), no default Prometheus."""
    got = parse(monkeypatch, {"MOE_EPLB_NAMESPACES": "", "MOE_EPLB_PEERING": "", "MOE_EPLB_PROMETHEUS_URL": ""})
    assert got.namespaces == () and got.standalone and got.prometheus_url is None


def test_command_line_wins_over_env(monkeypatch):
    got = parse(monkeypatch, {"MOE_EPLB_NAMESPACES": "a,b", "MOE_EPLB_PEERING": "", "MOE_EPLB_HEALTH_PORT": "9"},
                ("-n", "c", "-n", "d,e", "--peering", "p", "--liveness", "http://127.0.0.1:1/healthz"))
    assert got.namespaces == ("c", "d", "e") and not got.standalone and got.peering_name == "p"
    assert got.liveness_endpoint == "http://127.0.0.1:1/healthz"
    assert parse(monkeypatch, {"MOE_EPLB_HEALTH_PORT": "0"}).liveness_endpoint is None
    assert parse(monkeypatch, {"MOE_EPLB_STANDALONE": "true"}).standalone


def test_default_priority_differs_per_process(monkeypatch):
    """kopf 1.45 pauses every operator that sees a live peer with its own priority: two replicas
    started with the chart's env must not share one."""
    drawn = {parse(monkeypatch, {"MOE_EPLB_PEERING": "moe-eplb"}).priority for _ in range(20)}
    # 20 parses may fall in one millisecond, where only the 10-bit tie-break tells them apart (two of
    # 20 draws from 1024 collide ~17 % of the time), so not all 20 need differ; they do vary
    assert len(drawn) > 1
    assert all(s.PRIORITY_RANGE[0] <= p <= s.PRIORITY_RANGE[1] for p in drawn)
    assert all(abs(p - s.seniority_priority()) < 1024 * 60_000 for p in drawn)  # started within a minute
    # processes started in the same millisecond: the tie-break from OS entropy spreads them
    assert len({s.seniority_priority(1_800_000_000.0) for _ in range(50)}) > 30
    assert s.build(draw_priority=lambda: 42).priority == 42
    # seniority: a process started a second later has a lower priority, whatever its tie-break
    assert all(s.seniority_priority(1_800_000_001.0) < s.seniority_priority(1_800_000_000.0) for _ in range(50))
    assert s.build(priority=0, draw_priority=lambda: 42).priority == 0


#: prints the default peering priority after sleeping argv[1] seconds (a slow start-up: imports on a
#: busy node)
DRAW_LATE = "import sys, time; time.sleep(float(sys.argv[1])); " \
            "from moe_eplb.controller.settings import seniority_priority; print(seniority_priority())"


@pytest.mark.integration
def test_the_process_started_first_has_the_higher_priority_however_slow_its_start_up():
    """Seniority is the process's start, not the moment it draws its priority: two replicas started
    50 ms apart reach the draw in either order on a loaded node (the older once drew the lower
    priority, and the newer acted: tests/kube/test_operator_real.py's peering test)."""
    import subprocess
    import sys
    import time

    older = subprocess.Popen([sys.executable, "-c", DRAW_LATE, "1.5"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.1)
    newer = subprocess.Popen([sys.executable, "-c", DRAW_LATE, "0"], stdout=subprocess.PIPE, text=True)
    out_newer, _ = newer.communicate(timeout=60)
    out_older, _ = older.communicate(timeout=60)
    assert older.returncode == 0 and newer.returncode == 0
    # the newer drew first (about 1.4 s earlier), yet its priority is the lower one, by about 100 ms
    # of start time (x 1024, less the tie-break's spread)
    gap = int(out_older) - int(out_newer)
    assert 1024 * 50 < gap < 1024 * 1000, gap


@pytest.mark.parametrize("env, value", [
    ("MOE_EPLB_PROMETHEUS_URL", "prometheus:9090"),
    ("MOE_EPLB_NAMESPACES", "team-a,Team_B"),
    ("MOE_EPLB_METRICS_PORT", "eighty"),
    ("MOE_EPLB_METRICS_PORT", "70000"),
    ("MOE_EPLB_HEALTH_PORT", "-1"),
    ("MOE_EPLB_LOG_LEVEL", "LOUD"),
    ("MOE_EPLB_LOG_FORMAT", "yaml"),
    ("MOE_EPLB_PRIORITY", "high"),
    ("MOE_EPLB_RESYNC_SECONDS", "0"),
    ("MOE_EPLB_LIVENESS", "healthz"),
    ("MOE_EPLB_STANDALONE", "maybe"),
    ("MOE_EPLB_POD_MONITOR_LABELS", "release"),
    ("MOE_EPLB_POD_MONITOR_LABELS", "release=kube prometheus"),
    ("MOE_EPLB_POD_MONITOR_LABELS", '{"release": 3'),
    ("MOE_EPLB_EXPORTER_IMAGE", "Not An Image"),
])
def test_bad_env_value_is_a_usage_error_naming_the_variable(monkeypatch, env, value):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(main, ["run"], env={env: value})
    assert result.exit_code == 2, result.output
    assert env in result.output and value.split(",")[-1] in result.output, result.output


def test_settings_error_names_option_and_variable():
    with pytest.raises(s.SettingsError) as err:
        s.build(prometheus_url="ftp://x")
    assert err.value.env == "MOE_EPLB_PROMETHEUS_URL" and err.value.option == "--prometheus-url"
    assert "MOE_EPLB_PROMETHEUS_URL / --prometheus-url: 'ftp://x'" in str(err.value)


def test_controller_carries_the_settings():
    pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
    from moe_eplb.controller.handlers import Controller

    assert Controller().settings == s.OperatorSettings()
    custom = s.build(prometheus_url="http://prom:9090", priority=1)
    assert Controller(settings=custom).settings.prometheus_url == "http://prom:9090"


def test_pod_monitor_labels_and_exporter_image(monkeypatch):
    """The chart's operator.podMonitorLabels (JSON) and image; the CLI's key=value form."""
    got = parse(monkeypatch, {"MOE_EPLB_POD_MONITOR_LABELS": '{"release": "kube-prometheus-stack"}',
                              "MOE_EPLB_EXPORTER_IMAGE": "registry.example.com/moe-eplb/operator:0.3.0"})
    assert dict(got.pod_monitor_labels) == {"release": "kube-prometheus-stack"}
    assert got.defaults.exporter_image == "registry.example.com/moe-eplb/operator:0.3.0"
    assert dict(got.defaults.pod_monitor_labels) == {"release": "kube-prometheus-stack"}
    got = parse(monkeypatch, {}, ("--pod-monitor-labels", "release=kps, team=ml"))
    assert dict(got.pod_monitor_labels) == {"release": "kps", "team": "ml"}
    assert got.exporter_image is None
    assert dict(parse(monkeypatch, {"MOE_EPLB_POD_MONITOR_LABELS": ""}).pod_monitor_labels) == {}


@pytest.mark.parametrize("text, words", [
    ("release", "'release' is not key=value"),
    ('["release"]', "expected a JSON object"),
    ('{"release": 3}', "3 is not a label value"),
    ("bad key=x", "is not a Kubernetes label key"),
    ("release=" + "x" * 64, "is not a label value"),
    ("[" * 100_000, "JSON nested deeper than 2 levels"),  # issue 24: bounded, no RecursionError
    ('{"release": "a", "release": "b"}', "duplicate key 'release'"),
    ('{"release": ', "not valid JSON (line 1, column 13"),
])
def test_bad_pod_monitor_labels_name_the_problem(text, words):
    with pytest.raises(s.SettingsError, match="^MOE_EPLB_POD_MONITOR_LABELS / --pod-monitor-labels: ") as err:
        s.build(pod_monitor_labels=text)
    assert words in str(err.value)
