"""spec.autoscaling: bad combinations are refused with the field and the fix, by the CRD's CEL rules
(so the apiserver refuses them at apply time) or by the checks that need the engine version."""

from __future__ import annotations

import pytest

from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.spec import parse
from moe_eplb.api.validation import validate
from tests.example_manifests import EXAMPLES, load_moeinferences

AUTOSCALED = EXAMPLES / "qwen3-30b-a3b-autoscaled.yaml"


def base() -> dict:
    return load_moeinferences(AUTOSCALED)[0]


def problems(autoscaling: dict, **spec) -> list[tuple[str, str]]:
    res = base()
    res["spec"]["autoscaling"] = autoscaling
    for key, value in spec.items():
        res["spec"][key] = value
    return [(p.field, p.message) for p in validate(res)]


def test_three_lines_are_enough_and_parse_with_defaults():
    res = base()
    assert validate(res) == []
    a = parse(res).autoscaling
    assert (a.min_replicas, a.max_replicas, a.backend, a.metric.type, a.metric.target) == (1, 4, "KEDA",
                                                                                          "RequestsWaiting", 8.0)
    assert (a.scale_down.stabilization_window_seconds, a.scale_up.period_seconds) == (1800, 300)


@pytest.mark.parametrize("autoscaling,spec,field,fix", [
    ({"minReplicas": 5, "maxReplicas": 4}, {}, "spec.autoscaling.minReplicas", "raise maxReplicas"),
    ({"maxReplicas": 4, "backend": "HPA"}, {}, "spec.autoscaling.hpa", "set spec.autoscaling.hpa.metricsApi"),
    ({"minReplicas": 0, "maxReplicas": 4, "backend": "HPA", "hpa": {"metricsApi": "External"}}, {},
     "spec.autoscaling.minReplicas", "backend: KEDA"),
    ({"minReplicas": 0, "maxReplicas": 4}, {}, "spec.autoscaling.keda.activationQuery",
     "your gateway's queue"),
    ({"maxReplicas": 4, "backend": "HPA", "hpa": {"metricsApi": "Pods"}, "metric": {"type": "TTFT"}}, {},
     "spec.autoscaling.hpa.metricsApi", "use metricsApi: External"),
    ({"maxReplicas": 4, "metric": {"type": "KVCacheUsage", "target": 80}}, {}, "spec.autoscaling.metric.target",
     "0.8 for 80 %"),
    ({"maxReplicas": 4, "metric": {"target": 0}}, {}, "spec.autoscaling.metric.target", "must be > 0"),
    ({"maxReplicas": 4, "backend": "HPA", "hpa": {"metricsApi": "Pods"}},
     {"parallelism": {"tensor": 8, "data": 4, "nodes": 4}}, "spec.autoscaling.hpa.metricsApi",
     "use metricsApi: External"),
    ({"maxReplicas": 4, "backend": "HPA", "hpa": {"metricsApi": "External"}},
     {"monitoring": {"prometheusUrl": "http://p:9090"}}, "spec.autoscaling.hpa.metricsApi",
     "spec.monitoring.podMonitor.enabled: true"),
    ({}, {}, "spec.autoscaling.maxReplicas", ""),
])
def test_bad_combinations_name_the_field_and_the_fix(autoscaling, spec, field, fix):
    found = problems(autoscaling, **spec)
    assert any(f == field and fix in m for f, m in found), found


def test_scale_to_zero_with_an_activation_query_is_valid_and_parsed():
    res = base()
    res["spec"]["autoscaling"].update({"minReplicas": 0, "keda": {"activationQuery": "sum(gateway_queue)"}})
    assert validate(res) == []
    a = parse(res).autoscaling
    assert (a.min_replicas, a.keda.activation_query, a.keda.polling_interval_seconds) == (0, "sum(gateway_queue)", 30)


def test_an_engine_version_that_cannot_be_told_is_refused_for_the_metric_names():
    res = base()
    res["spec"]["eplb"]["enabled"] = False
    res["spec"]["autotune"] = {"mode": "Off"}
    res["spec"]["engine"]["image"] = "registry.example/vllm:latest"
    found = [(p.field, p.message) for p in validate(res)]
    assert any(f == "spec.autoscaling.metric.type" and "set spec.engine.version" in m for f, m in found), found


def test_autoscaling_cel_rules_stay_cheap():
    """No regex or list macro in the autoscaling rules: each is a few comparisons."""
    spec = openapi_schema()["properties"]["spec"]
    auto = spec["properties"]["autoscaling"]
    rules = [r["rule"] for r in auto.get("x-kubernetes-validations", [])]
    rules += [r["rule"] for r in auto["properties"]["metric"].get("x-kubernetes-validations", [])]
    rules += [r["rule"] for r in spec["x-kubernetes-validations"] if "autoscaling" in r["rule"]]
    assert len(rules) == 10  # 8 of the autoscaler's own, 2 of an elastic group's bounds in pods
    for rule in rules:
        assert not any(word in rule for word in ("matches(", ".all(", ".exists(", ".map(", ".filter(")), rule


def test_every_rule_reason_is_one_the_apiserver_accepts():
    """x-kubernetes-validations' reason must be one of the four the API server knows (else the CRD
    is refused at install time)."""
    allowed = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}

    def reasons(node):
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations") or ():
                if "reason" in rule:
                    yield rule["reason"]
            for value in node.values():
                yield from reasons(value)
        elif isinstance(node, list):
            for value in node:
                yield from reasons(value)

    found = list(reasons(openapi_schema()))
    assert "FieldValueRequired" in found and set(found) <= allowed, set(found) - allowed
