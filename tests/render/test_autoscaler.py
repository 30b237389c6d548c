"""The autoscaler child (spec.autoscaling): a KEDA ScaledObject valid against KEDA's published CRD
(vendored by scripts/vendor_keda_crd.py: schema, unknown fields and its CEL rule), an autoscaling/v2
HorizontalPodAutoscaler valid for kubernetes-validate (strict), vLLM's metric names per engine
version with the model_name label, the HPA behavior defaults for engines that load for minutes,
and the minReplicas floor while a tuner rollout restarts pods."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from moe_eplb.api.cel_rules import cel_problems
from moe_eplb.api.schema import fill_schema_defaults, schema_problems, unknown_field_problems
from moe_eplb.api.spec import OperatorDefaults, parse
from moe_eplb.api.validation import check, check_for_operator, operator_default_problems
from moe_eplb.contracts import vllm_facts
from moe_eplb.render import autoscaler as au
from moe_eplb.render.objects import render_children
from moe_eplb_harness.emulated.kubeapi import keda_crd
from tests.example_manifests import EXAMPLES, load_moeinferences

K8S = kubernetes_validate.latest_version()
KEDA_SCHEMA = keda_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
AUTOSCALED = EXAMPLES / "qwen3-30b-a3b-autoscaled.yaml"


def keda_problems(obj: dict) -> list:
    """What the apiserver would refuse in a ScaledObject, with KEDA's CRD installed."""
    obj = fill_schema_defaults(obj, KEDA_SCHEMA)
    return unknown_field_problems(obj, KEDA_SCHEMA) + schema_problems(obj, KEDA_SCHEMA) + cel_problems(obj, KEDA_SCHEMA)


def resource(autoscaling: dict, **spec) -> dict:
    res = load_moeinferences(AUTOSCALED)[0]
    res["spec"]["autoscaling"] = autoscaling
    res["spec"].update(spec)
    return res


def child(res: dict) -> dict | None:
    checked = check(res)
    assert checked.problems == [], checked.problems
    return au.autoscaler(checked.inference)


def test_vendored_keda_crd_names_its_source_commit():
    from moe_eplb_harness.emulated.kubeapi import KEDA_CRD_FILE

    first = KEDA_CRD_FILE.read_text().splitlines()[0]
    assert first.startswith("# KEDA ScaledObject CRD from kedacore/keda@") and len(first.split("@")[1]) == 40
    assert keda_crd()["metadata"]["name"] == "scaledobjects.keda.sh"


@pytest.mark.parametrize("metric", [{}, {"type": "KVCacheUsage", "target": 0.75},
                                    {"type": "TTFT", "target": 1.5, "quantile": 0.95}])
def test_scaled_object_is_valid_for_kedas_crd(metric):
    so = child(resource({"maxReplicas": 4, "metric": metric}))
    assert so["kind"] == "ScaledObject" and so["apiVersion"] == "keda.sh/v1alpha1"
    assert keda_problems(so) == []
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference",
                                            "name": "qwen3-30b-autoscaled"}
    trigger = so["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    assert 'model_name="Qwen/Qwen3-30B-A3B-Instruct-2507"' in trigger["metadata"]["query"]


def test_kedas_crd_refuses_what_it_should():
    """The vendored CRD is the real check: min > max (its CEL rule) and a stray field are refused."""
    so = child(resource({"maxReplicas": 4}))
    bad = yaml.safe_load(yaml.safe_dump(so))
    bad["spec"]["minReplicaCount"] = 9
    assert any("minReplicaCount must be less than or equal to maxReplicaCount" in p.message for p in keda_problems(bad))
    bad = yaml.safe_load(yaml.safe_dump(so))
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # trigger metadata values are strings
    assert keda_problems(bad)


def test_defaults_fit_engines_that_load_for_minutes():
    res = load_moeinferences(AUTOSCALED)[0]
    assert res["spec"]["autoscaling"] == {"minReplicas": 1, "maxReplicas": 4}  # the three lines
    so = child(res)
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)  # no scale to zero
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 1800
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 600}]
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    trigger = spec["triggers"][0]
    assert trigger["metricType"] == "AverageValue"  # waiting requests per replica group
    assert trigger["metadata"]["threshold"] == "8"
    assert trigger["metadata"]["query"] == \
        'sum(vllm:num_requests_waiting{namespace="default", model_name="Qwen/Qwen3-30B-A3B-Instruct-2507"})'
    assert "activationThreshold" not in trigger["metadata"]
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["name"] == "keda-hpa-qwen3-30b-autoscaled"


@pytest.mark.parametrize("version,name", [("0.9.2", "vllm:gpu_cache_usage_perc"),
                                          ("0.10.0", "vllm:kv_cache_usage_perc"),
                                          ("0.12.0", "vllm:kv_cache_usage_perc")])
def test_kv_cache_metric_name_follows_the_engine_version(version, name):
    assert vllm_facts.autoscaling_metric("KVCacheUsage", tuple(int(x) for x in version.split("."))) == name
    res = resource({"maxReplicas": 4, "metric": {"type": "KVCacheUsage"}})
    res["spec"]["engine"]["version"] = version
    res["spec"]["eplb"]["enabled"] = False
    res["spec"]["autotune"] = {"mode": "Off"}
    query = child(res)["spec"]["triggers"][0]["metadata"]["query"]
    assert query.startswith(f"avg({name}{{")


def test_ttft_quantile_query():
    so = child(resource({"maxReplicas": 4, "metric": {"type": "TTFT", "target": 1.5, "quantile": 0.95,
                                                         "windowSeconds": 300}}))
    meta = so["spec"]["triggers"][0]["metadata"]
    assert meta["query"] == ('histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
                             '{namespace="default", model_name="Qwen/Qwen3-30B-A3B-Instruct-2507"}[300s])))')
    assert meta["threshold"] == "1.5" and so["spec"]["triggers"][0]["metricType"] == "Value"


def test_scale_to_zero_is_keda_only_and_sets_an_activation_threshold():
    so = child(resource({"minReplicas": 0, "maxReplicas": 2, "keda": {"activationQuery": "sum(gateway_queue)"}}))
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["triggers"][0]["metadata"]["activationThreshold"] == "0"
    # the activation query wakes it from zero (at zero no engine reports vLLM's metric) and asks for one
    # replica group at most: an AverageValue far above any queue
    wake = so["spec"]["triggers"][1]
    assert (wake["type"], wake["name"], wake["metricType"]) == ("prometheus", "activation", "AverageValue")
    assert wake["metadata"]["query"] == "sum(gateway_queue)" and wake["metadata"]["activationThreshold"] == "0"
    assert float(wake["metadata"]["threshold"]) >= 1e9
    assert wake["metadata"]["serverAddress"] == so["spec"]["triggers"][0]["metadata"]["serverAddress"]
    assert keda_problems(so) == []
    assert len(child(resource({"minReplicas": 1, "maxReplicas": 2}))["spec"]["triggers"]) == 1
    # the cooldown before scaling to zero holds for a ScaledObject just created too: KEDA ignores
    # cooldownPeriod until a trigger was first active and uses initialCooldownPeriod (default 0, which
    # took a new resource to zero at KEDA's first poll, while its engines loaded: tests/kube/test_keda_real.py)
    assert so["spec"]["cooldownPeriod"] == so["spec"]["initialCooldownPeriod"] == 1800


@pytest.mark.parametrize("api,metric", [("External", {}), ("External", {"type": "TTFT"}),
                                        ("Pods", {"type": "KVCacheUsage", "target": 0.8})])
def test_hpa_is_valid_autoscaling_v2(api, metric):
    hpa = child(resource({"maxReplicas": 6, "backend": "HPA", "hpa": {"metricsApi": api}, "metric": metric}))
    kubernetes_validate.validate(hpa, K8S, strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"]["kind"] == "MoEInference"
    m = hpa["spec"]["metrics"][0]
    assert m["type"] == api
    if api == "External":
        assert m["external"]["metric"]["selector"] == {"matchLabels": {"moeinference": "qwen3-30b-autoscaled"}}
    if api == "Pods":
        assert m["pods"]["metric"]["name"] == "vllm_kv_cache_usage_perc"
        assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    broken = yaml.safe_load(yaml.safe_dump(hpa))
    broken["spec"]["maxReplicas"] = "six"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S, strict=True)


def test_hpa_metric_names():
    hpa = child(resource({"maxReplicas": 6, "backend": "HPA", "hpa": {"metricsApi": "External"},
                          "metric": {"type": "TTFT", "quantile": 0.99}}))
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "vllm_time_to_first_token_seconds_p99"
    hpa = child(resource({"maxReplicas": 6, "backend": "HPA",
                          "hpa": {"metricsApi": "External", "metricName": "moe_waiting"}}))
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "moe_waiting"
    assert hpa["spec"]["metrics"][0]["external"]["target"] == {"type": "AverageValue", "averageValue": "8"}



@pytest.mark.parametrize("series", [vllm_facts.REQUESTS_WAITING, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"])
def test_the_hpa_names_the_metric_as_the_adapters_rule_serves_it(series):
    """One name for both sides: the rendered HPA's metric (render.autoscaler) and the name
    prometheus-adapter's rule (sim.real.metricsadapter.adapter_config) gives the series."""
    import re

    from moe_eplb.contracts.metric_names import adapter_metric_name
    from moe_eplb_harness.real.metricsadapter import adapter_config

    rule = adapter_config((series,))["rules"][0]["name"]
    served = re.sub(rule["matches"], rule["as"].replace("${1}", r"\1"), series)
    assert served == adapter_metric_name(series) == series.replace("vllm:", "vllm_")
    assert adapter_metric_name(series, 0.995) == served + "_p99_5"

def test_no_autoscaler_without_the_field_or_when_disabled():
    res = load_moeinferences(AUTOSCALED)[0]
    kinds = [c["kind"] for c in render_children(check(res).inference)]
    assert kinds[-1] == "ScaledObject"
    res["spec"]["autoscaling"]["enabled"] = False
    assert "ScaledObject" not in [c["kind"] for c in render_children(check(res).inference)]
    del res["spec"]["autoscaling"]
    assert "ScaledObject" not in [c["kind"] for c in render_children(check(res).inference)]


def test_autoscaler_is_owned_like_the_other_children():
    res = load_moeinferences(AUTOSCALED)[0]
    res["metadata"]["uid"] = "u-1"
    so = render_children(check(res).inference)[-1]
    assert so["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert so["metadata"]["namespace"] == "default" and so["metadata"]["labels"]["eplb.ai/name"] == res["metadata"]["name"]


@pytest.mark.parametrize("phase,started_with,floor", [("Rolling", 3, 3), ("RollingBack", 9, 4),
                                                      ("Observing", 3, 1), (None, None, 1)])
def test_min_replicas_floor_while_a_rollout_restarts_pods(phase, started_with, floor):
    res = load_moeinferences(AUTOSCALED)[0]
    if phase:
        res["status"] = {"autotune": {"rollout": {"kind": "apply", "phase": phase, "replicas": started_with}}}
    inf = parse(res)
    assert au.rollout_min_replicas(inf) == floor
    assert au.autoscaler(inf)["spec"]["minReplicaCount"] == floor


def test_keda_without_a_prometheus_address_is_refused_by_the_operator():
    res = load_moeinferences(AUTOSCALED)[0]
    del res["spec"]["monitoring"]["prometheusUrl"]
    checked = check(res)
    assert checked.problems == []  # the operator may have a default (--prometheus-url)
    (problem,) = operator_default_problems(checked.inference)
    assert problem.field == "spec.monitoring.prometheusUrl" and "backend: HPA" in problem.message
    # what the reconciler and `moe-eplb validate|render` run: refused without the operator's address,
    # rendered with it (the resource's own address would win)
    assert check_for_operator(res).problems == [problem]
    given = check_for_operator(res, OperatorDefaults(prometheus_url="http://prom.monitoring:9090"))
    assert given.problems == [] and given.inference.prometheus_url == "http://prom.monitoring:9090"
    assert au.autoscaler(given.inference)["spec"]["triggers"][0]["metadata"]["serverAddress"] == \
        "http://prom.monitoring:9090"
    assert check(res).inference.prometheus_url is None  # the resource itself is not changed


def test_printer_columns_show_desired_and_ready_replicas():
    from moe_eplb.api.crd import crd

    cols = {c["name"]: c for c in crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Desired"]["jsonPath"] == ".spec.replicas"
    assert cols["Ready-Replicas"]["jsonPath"] == ".status.readyReplicas"
    assert cols["Max"]["jsonPath"] == ".spec.autoscaling.maxReplicas"


def test_condition_line_names_the_autoscaler_and_the_metric():
    inf = check(load_moeinferences(AUTOSCALED)[0]).inference
    assert au.describe(inf) == ("KEDA ScaledObject qwen3-30b-autoscaled (HPA keda-hpa-qwen3-30b-autoscaled) scales "
                                "spec.replicas between 1 and 4 on vllm:num_requests_waiting (target 8 per replica group)")
    hpa = check(resource({"maxReplicas": 6, "backend": "HPA", "hpa": {"metricsApi": "External"},
                          "metric": {"type": "TTFT"}})).inference
    assert au.describe(hpa) == ("HorizontalPodAutoscaler qwen3-30b-autoscaled (External metric "
                                "vllm_time_to_first_token_seconds_p90) scales spec.replicas between 1 and 6 on p90 of "
                                "vllm:time_to_first_token_seconds (target 2)")
