"""docs/reference.md is generated from the CRD and up to date; the Dockerfile's default target is
the operator image the chart points at; docs/metrics.md covers every metric."""

from __future__ import annotations

import importlib.util
import re

import pytest
import yaml

import moe_eplb
from moe_eplb.contracts import k8s_names, metric_names
from scripts import vllm_metric_names as v
from tests.chart import chart_queries as cq
from tests.chart.chart_support import CHART_DIR, ROOT


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_doc_is_generated_from_the_crd_and_up_to_date():
    gen = _load_script("gen_reference")
    if not gen.CRD.exists():
        pytest.skip("crds/moeinferences.eplb.ai.yaml not there yet")
    crd = yaml.safe_load(gen.CRD.read_text())
    text = gen.render(crd)
    assert (ROOT / "docs" / "reference.md").read_text() == text, "run python scripts/gen_reference.py"
    # every field of the schema is in it, with its description
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for section in ("spec", "status"):
        for path, _sub, _ in gen.walk(schema["properties"][section], section):
            assert f"| `{path}`" in text, path
    for must in ("spec.eplb.windowSize", "spec.autotune.mode", "spec.parallelism.tensor", "status.conditions"):
        assert f"`{must}`" in text
    for r in schema.get("x-kubernetes-validations", []):
        assert gen._text(r["message"]) in text


def test_reference_types_and_constraints():
    gen = _load_script("gen_reference")
    assert gen.type_of({"x-kubernetes-int-or-string": True}) == "int or string"
    assert gen.type_of({"type": "array", "items": {"type": "string"}}) == "[]string"
    assert gen.type_of({"type": "object", "additionalProperties": {"type": "integer"}}) == "map[string]integer"
    assert gen.constraints({"minimum": 0, "exclusiveMinimum": True, "maximum": 1}) == "> 0; ≤ 1"
    assert gen.constraints({"enum": ["Off", "Apply"]}) == "one of `Off`, `Apply`"


def _stages(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I)


def test_operator_is_the_default_and_last_dockerfile_stage():
    text = (ROOT / "Dockerfile").read_text()
    stages = _stages(text)
    assert stages[-1][1] == "operator", "the operator stage must be the last (default) target"
    op = text[text.rindex("AS operator\n"):]
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
    base = args.get("OPERATOR_PYTHON", stages[-1][0])
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", base), f"pin a slim Python base: {base}"
    assert re.search(r"^USER\s+10001(:10001)?$", op, flags=re.M), "run as the non-root user 10001"
    assert re.search(r'^ENTRYPOINT \["moe-eplb"\]$', op, flags=re.M)
    assert re.search(r'^CMD \["run"\]$', op, flags=re.M)
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    exposed = {int(p) for p in re.findall(r"^EXPOSE\s+(.+)$", op, flags=re.M)[0].split()}
    assert exposed == {k8s_names.OPERATOR_METRICS_PORT, values["operator"]["healthPort"]}
    assert "/healthz" in op and '".[operator]"' in text
    # the chart's default image is this target, tagged with the package version
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["appVersion"] == moe_eplb.__version__
    assert f"-t {values['image']['repository']}:{chart['appVersion']}" in text
    assert values["image"]["tag"] == ""  # -> appVersion


def test_metrics_doc_covers_every_metric_and_every_dashboard_vllm_metric():
    text = (ROOT / "docs" / "metrics.md").read_text()
    pinned = [val for key, val in vars(metric_names).items() if key.isupper() and isinstance(val, str)
              and val.startswith(metric_names.PREFIX) and val != metric_names.PREFIX]
    missing = [m for m in pinned if f"`{m}`" not in text]
    assert not missing, f"docs/metrics.md does not explain {missing}"
    missing = [m for m in v.VLLM_METRICS if f"`{m}" not in text]
    assert not missing, f"docs/metrics.md does not list {missing}"
    alerts = [q.where.split()[-1] for q in cq.alert_queries(
        [{"rules": [{"alert": a, "expr": "x"}]} for a in re.findall(r"- alert: (\w+)", (
            CHART_DIR / "templates" / "prometheusrule.yaml").read_text())])]
    assert alerts and all(a in text for a in alerts)


def test_chart_doc_explains_every_rbac_rule_and_env_var(render):
    from moe_eplb.controller.rbac import RBAC_RULES

    text = (ROOT / "docs" / "chart.md").read_text()
    for rule in RBAC_RULES:
        for res in rule["resources"]:
            assert f"`{res}`" in text, f"docs/chart.md does not explain the RBAC rule on {res}"
    dep = next(o for o in render() if o["kind"] == "Deployment")
    for env in dep["spec"]["template"]["spec"]["containers"][0]["env"]:
        assert f"`{env['name']}`" in text, f"docs/chart.md does not explain {env['name']}"


def test_notes_point_at_an_existing_example(chart):
    notes = chart.render({}, name="moe-eplb", namespace="moe-system")["moe-eplb-operator/templates/NOTES.txt"]
    examples = re.findall(r"examples/[\w.-]+\.yaml", notes)
    assert examples and all((ROOT / e).exists() for e in examples)
    assert "kubectl get crd moeinferences.eplb.ai" in notes


def test_kube_prometheus_stack_values_in_the_docs_label_everything(render, monkeypatch):
    """The values docs/chart.md gives for a stock kube-prometheus-stack put its `release` label on the
    ServiceMonitor, the PrometheusRule and (through the operator's env) every PodMonitor, and the
    Grafana sidecar's label on the dashboards."""
    from tests.chart.chart_support import PROMETHEUS_OPERATOR
    from tests.chart.test_chart_operator_env import operator_settings

    text = (ROOT / "docs" / "chart.md").read_text()
    block = text.split("<!-- kube-prometheus-stack values:", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    values = yaml.safe_load(block)
    objs = render(values, api_versions=PROMETHEUS_OPERATOR)
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (obj,) = by_kind[kind]
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in by_kind["ConfigMap"])
    settings = operator_settings(objs, monkeypatch)
    assert dict(settings.pod_monitor_labels) == {"release": "kube-prometheus-stack"}
    assert settings.prometheus_url == "http://prometheus-operated.monitoring.svc:9090"


def test_exposed_series_names():
    """The series a vLLM metric is exposed as (scripts/vllm_metric_names.py; needs no vLLM)."""
    assert v.exposed_series("vllm:generation_tokens", v.COUNTER)[0] == "vllm:generation_tokens_total"
    assert "vllm:time_to_first_token_seconds_bucket" in v.all_exposed_series()
    with pytest.raises(ValueError, match="unknown metric kind"):
        v.exposed_series("x", "summary")
