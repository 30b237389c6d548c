"""Unit tests of every alert with the real ``promtool test rules`` (Prometheus' own rule engine), on
the PrometheusRule the chart renders with its default values; every alert has a runbook section."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_eplb_harness.floor.prometheus import promtool_binary
from tests.chart.chart_support import CHART_DIR, ROOT, render_chart, rule_groups

ALERT_TESTS = Path(__file__).with_name("alert_tests.yaml")
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMTOOL = promtool_binary()
#: marker ``prometheus``: Prometheus' own tool runs (tests/conftest.py skips, or fails, without it)
needs_promtool = pytest.mark.prometheus


@pytest.fixture(scope="module")
def groups(chart) -> list[dict[str, Any]]:
    return rule_groups(render_chart(chart))  # default values, a cluster with the Prometheus Operator


def alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


def promtool_test(tmp_path: Path, groups: list[dict[str, Any]], tests: dict[str, Any]) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(dict(tests, rule_files=["rules.yml"]), sort_keys=False))
    return subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


@needs_promtool
def test_promtool_unit_tests_pass(tmp_path, groups):
    res = promtool_test(tmp_path, groups, yaml.safe_load(ALERT_TESTS.read_text()))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_fires_and_stays_quiet_in_some_case(groups):
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fires, quiet = set(), set()
    for t in tests:
        for case in t["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    shipped = set(alerts(groups))
    assert fires == shipped, f"alerts without a case where they fire: {shipped - fires}"
    assert quiet == shipped, f"alerts without a case where they stay quiet: {shipped - quiet}"


@needs_promtool
def test_promtool_catches_a_wrong_expectation(tmp_path, groups):
    """The harness can fail: one expected label changed, promtool reports the difference."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    wrong = copy.deepcopy(tests)
    case = next(c for t in wrong["tests"] for c in t["alert_rule_test"]
                if c["alertname"] == "MoEEPLBRearrangementsStalled" and c["exp_alerts"])
    case["exp_alerts"][0]["exp_labels"]["moeinference"] = "observe"  # the observe-only engine must NOT fire
    res = promtool_test(tmp_path, groups, wrong)
    assert res.returncode != 0 and "MoEEPLBRearrangementsStalled" in res.stdout + res.stderr


@needs_promtool
def test_stall_alert_respects_its_values(tmp_path, chart):
    """With 30 intervals required instead of 3, the stuck engine (24 intervals an hour) stays quiet."""
    groups = rule_groups(render_chart(chart, {"prometheusRule": {"rearrangementStallIntervals": 30}}))
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    stall = [t for t in tests["tests"] if any(c["alertname"] == "MoEEPLBRearrangementsStalled"
                                              for c in t["alert_rule_test"])]
    for t in stall:
        for case in t["alert_rule_test"]:
            case["exp_alerts"] = []
    res = promtool_test(tmp_path, groups, {"evaluation_interval": "1m", "tests": stall})
    assert res.returncode == 0, res.stdout + res.stderr


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (lower case, punctuation dropped, spaces -> '-')."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_runbook_section(groups):
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    base = values["prometheusRule"]["runbookUrl"]
    assert base.endswith("/docs/runbook.md")
    text = RUNBOOK.read_text()
    anchors = {github_anchor(h): h for h in re.findall(r"^## (.+)$", text, flags=re.M)}
    for name, rule in alerts(groups).items():
        url = rule["annotations"]["runbook_url"]
        assert url == f"{base}#{name.lower()}", url
        assert name.lower() in anchors, f"docs/runbook.md has no section '## {name}'"
        section = text.split(f"## {anchors[name.lower()]}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("Symptom", "Likely causes", "What to check", "How to fix"):
            assert f"**{part}.**" in section, f"runbook section {name} lacks {part}"
    assert set(anchors) - {"how-to-use-this-runbook"} == {a.lower() for a in alerts(groups)}


def test_runbook_url_is_a_value(chart):
    groups = rule_groups(render_chart(chart, {"prometheusRule": {"runbookUrl": "https://wiki.example.com/moe"}}))
    assert {r["annotations"]["runbook_url"] for g in groups for r in g["rules"]} == {
        f"https://wiki.example.com/moe#{a.lower()}" for a in alerts(groups)}


def test_absent_alert_carries_namespace_and_job(groups):
    down = alerts(groups)["MoEEPLBOperatorDown"]
    assert down["expr"].startswith("absent(")
    assert down["labels"]["namespace"] == "moe-system" and down["labels"]["job"] == "moe-eplb-metrics"
    assert f'job="{down["labels"]["job"]}", namespace="{down["labels"]["namespace"]}"' in down["expr"]
