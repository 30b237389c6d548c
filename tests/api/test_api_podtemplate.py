"""``spec.engine.podTemplate``: the generated PodSpec schema, the rules for what the operator owns,
and the cases of the admission-parity table (tests/kube/test_admission.py runs them on a real
kube-apiserver; here the offline model of the apiserver and ``validate`` answer them)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.spec import parse
from moe_eplb.api.validation import apiserver_problems, validate

P = "spec.engine.podTemplate"
PS = f"{P}.spec"


def overlay(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """Changes to the seed that set ``spec.engine.podTemplate``."""
    out: dict[str, Any] = {}
    if spec is not None:
        out["spec"] = spec
    if meta:
        out["metadata"] = meta
    return {P: out}


def vllm(**fields: Any) -> dict[str, Any]:
    return overlay({"containers": [{"name": "vllm", **fields}]})


#: bad overlays both the apiserver and ``validate`` refuse: (changes to the seed, the field both
#: name, words of the message; for a CEL rule the project's message, else the offline model's)
OVERLAY_BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    # what the operator owns (CEL rules of the CRD, moe_eplb.api.podtemplate)
    "overlay-engine-command": (vllm(command=["sh", "-c", "sleep 1"]), f"{PS}.containers[0].command",
                               "carries the EPLB arguments"),
    "overlay-engine-args": (vllm(args=["--enable-eplb"]), f"{PS}.containers[0].args", "spec.engine.extraArgs"),
    "overlay-engine-image": (vllm(image="vllm/vllm-openai:v0.33.0"), f"{PS}.containers[0].image",
                             "set spec.engine.image"),
    "overlay-sidecar-without-image": (overlay({"containers": [{"name": "log-shipper"}]}), f"{PS}.containers[0].image",
                                      "needs an image"),
    "overlay-gpu-limit": (vllm(resources={"limits": {"nvidia.com/gpu": 8}}), f"{PS}.containers",
                          "resources.limits: the GPU count"),
    "overlay-gpu-request": (vllm(resources={"requests": {"nvidia.com/gpu": 8}}), f"{PS}.containers",
                            "resources.requests: the GPU count"),
    "overlay-amd-gpu-limit": ({**vllm(resources={"limits": {"amd.com/gpu": 8}}),
                               "spec.engine.gpuResourceName": "amd.com/gpu",
                               "spec.engine.image": "vllm/vllm-openai-rocm:v0.32.0"}, f"{PS}.containers",
                              "spec.engine.gpuResourceName"),
    "overlay-engine-prestop": (vllm(lifecycle={"preStop": {"exec": {"command": ["sleep", "5"]}}}),
                               f"{PS}.containers[0].lifecycle", "spec.engine.drainSeconds"),
    "overlay-engine-liveness": (vllm(livenessProbe={"exec": {"command": ["true"]}}),
                                f"{PS}.containers[0].livenessProbe", "stuck or dead engine"),
    "overlay-engine-readiness": (vllm(readinessProbe={"tcpSocket": {"port": 8000}}),
                                 f"{PS}.containers[0].readinessProbe", "spec.engine.drainSeconds"),
    "overlay-grace-period": (overlay({"terminationGracePeriodSeconds": 5}), f"{PS}.terminationGracePeriodSeconds",
                             "derives it from spec.engine.drainSeconds"),
    "overlay-operator-port": (overlay({"containers": [{"name": "proxy", "image": "envoyproxy/envoy:v1.31.0",
                                                       "ports": [{"containerPort": 8000}]}]}),
                              f"{PS}.containers[0].ports", "are the operator's"),
    "overlay-plugin-env": (vllm(env=[{"name": "VLLM_PLUGINS", "value": "mine"}]), f"{PS}.containers[0].env",
                           "set by the operator"),
    "overlay-leader-address-env": (vllm(env=[{"name": "LWS_LEADER_ADDRESS", "value": "10.0.0.9"}]),
                                   f"{PS}.containers[0].env", "command expands"),
    "overlay-shm-mount": (vllm(volumeMounts=[{"name": "scratch", "mountPath": "/dev/shm"}]),
                          f"{PS}.containers[0].volumeMounts", "mount elsewhere"),
    "overlay-operator-volume": (overlay({"volumes": [{"name": "dshm", "hostPath": {"path": "/dev/shm"}}]}),
                                f"{PS}.volumes", "operator's volumes"),
    "overlay-exporter-init-name": (overlay({"initContainers": [{"name": "moe-eplb-exporter", "image": "busybox:1.36"}]}),
                                   f"{PS}.initContainers", "exporter init container"),
    "overlay-ephemeral-containers": (overlay({"ephemeralContainers": [{"name": "debug", "image": "busybox:1.36"}]}),
                                     f"{PS}.ephemeralContainers", "kubectl debug"),
    "overlay-restart-never": (overlay({"restartPolicy": "Never"}), f"{PS}.restartPolicy", "only Always"),
    "overlay-selector-label": (overlay(labels={"eplb.ai/name": "other"}), f"{P}.metadata.labels",
                               "selects its pods on"),
    "overlay-lws-label": (overlay(labels={"leaderworkerset.sigs.k8s.io/name": "x"}), f"{P}.metadata.labels",
                          "LeaderWorkerSet's"),
    "overlay-config-hash-annotation": (overlay(annotations={"eplb.ai/eplb-config-hash": "0"}),
                                       f"{P}.metadata.annotations", "rolls the pods"),
    # unknown fields (strict field validation)
    "overlay-unknown-container-field": (vllm(evn=[{"name": "A", "value": "1"}]), f"{PS}.containers[0].evn",
                                        "did you mean 'env'"),
    "overlay-unknown-pod-field": (overlay({"hostNetwrok": True}), f"{PS}.hostNetwrok", "did you mean 'hostNetwork'"),
    "overlay-unknown-metadata-field": ({P: {"metdata": {"labels": {"a": "b"}}}}, f"{P}.metdata",
                                       "did you mean 'metadata'"),
    # wrong types and values (the generated PodSpec schema)
    "overlay-host-network-string": (overlay({"hostNetwork": "yes"}), f"{PS}.hostNetwork", "true or false"),
    "overlay-grace-period-string": (overlay({"terminationGracePeriodSeconds": "600s"}),
                                    f"{PS}.terminationGracePeriodSeconds", "whole number"),
    "overlay-memory-not-a-quantity": (vllm(resources={"limits": {"memory": "16GB"}}),
                                      f"{PS}.containers[0].resources.limits.memory", "does not match"),
    "overlay-tolerations-not-a-list": (overlay({"tolerations": "nvidia.com/gpu"}), f"{PS}.tolerations",
                                       "expected a list"),
    "overlay-env-without-name": (vllm(env=[{"value": "1"}]), f"{PS}.containers[0].env[0].name", "required"),
    "overlay-capabilities-not-a-list": (vllm(securityContext={"capabilities": {"add": "IPC_LOCK"}}),
                                        f"{PS}.containers[0].securityContext.capabilities.add", "expected a list"),
    "overlay-label-value-too-long": (overlay(labels={"team": "x" * 64}), f"{P}.metadata.labels.team",
                                     "at most 63 characters"),
}

#: what only ``validate`` (and the operator) refuses; the apiserver admits it
OVERLAY_OPERATOR_ONLY: dict[str, tuple[dict[str, Any], str]] = {
    "overlay-pythonpath-while-injected": (vllm(env=[{"name": "PYTHONPATH", "value": "/opt/x"}]),
                                          f"{PS}.containers[0].env"),
    "overlay-bad-label-key": (overlay(labels={"team name": "a"}), f"{P}.metadata.labels['team name']"),
}


@pytest.mark.parametrize("case", sorted(OVERLAY_BAD))
def test_overlay_refused_at_apply_time_and_by_validate(case: str, variant) -> None:
    changes, field, words = OVERLAY_BAD[case]
    res = variant(changes)
    offline = [p for p in apiserver_problems(res) if p.field == field]
    assert offline, (case, apiserver_problems(res))
    assert any(words in p.message for p in offline), offline
    ours = validate(res)
    assert field in {p.field for p in ours}, (case, ours)
    for p in ours:  # one line each, naming the field
        assert "\n" not in p.message and p.field.startswith(P), p


@pytest.mark.parametrize("case", sorted(OVERLAY_OPERATOR_ONLY))
def test_overlay_operator_only(case: str, variant) -> None:
    changes, field = OVERLAY_OPERATOR_ONLY[case]
    res = variant(changes)
    assert apiserver_problems(res) == []
    assert field in {p.field for p in validate(res)}, validate(res)


def test_pythonpath_is_allowed_without_injection(variant) -> None:
    changes = {**vllm(env=[{"name": "PYTHONPATH", "value": "/opt/x"}]), "spec.engine.exporter.inject": False,
               "spec.engine.image": "ghcr.io/moe-eplb/vllm:v0.32.0"}
    res = variant(changes)
    assert [p for p in validate(res) if p.field.startswith(P)] == []


def test_duplicate_container_names_refused(variant) -> None:
    res = variant(overlay({"containers": [{"name": "a", "image": "busybox:1.36"},
                                          {"name": "a", "image": "busybox:1.36"}]}))
    assert f"{PS}.containers[1]" in {p.field for p in validate(res)}


def test_a_full_overlay_passes(variant) -> None:
    res = variant(overlay(
        {"containers": [{"name": "vllm", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
                         "envFrom": [{"secretRef": {"name": "s3"}}],
                         "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                         "resources": {"limits": {"rdma/ib": 1, "memory": "512Gi"}},
                         "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                         "ports": [{"containerPort": 9000, "name": "extra"}]},
                        {"name": "sidecar", "image": "busybox:1.36"}],
         "volumes": [{"name": "cache", "emptyDir": {}}],
         "tolerations": [{"key": "rdma", "operator": "Exists", "effect": "NoSchedule"}],
         "priorityClassName": "high", "runtimeClassName": "nvidia",
         "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
             {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}]}}},
        labels={"kueue.x-k8s.io/queue-name": "gpu"}, annotations={"k8s.v1.cni.cncf.io/networks": "rdma"}))
    assert validate(res) == []
    ov = parse(res).engine.pod_template
    assert ov.labels == {"kueue.x-k8s.io/queue-name": "gpu"}
    assert ov.engine_container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    # the apiserver's defaulting of the list-map key (protocol) is applied to the parsed overlay
    assert ov.engine_container["ports"] == [{"containerPort": 9000, "name": "extra", "protocol": "TCP"}]


def test_generated_schema_is_structural_where_it_matters() -> None:
    node = openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["podTemplate"]
    spec = node["properties"]["spec"]
    assert "required" not in spec  # a fragment: no containers needed
    container = spec["properties"]["containers"]["items"]
    assert container["required"] == ["name"]
    assert spec["properties"]["containers"]["x-kubernetes-list-map-keys"] == ["name"]
    limits = container["properties"]["resources"]["properties"]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] is True and "pattern" in limits
    port = container["properties"]["ports"]["items"]["properties"]
    assert port["protocol"]["default"] == "TCP"
    assert "$ref" not in str(node) and "x-kubernetes-patch" not in str(node)


def test_validate_stays_fast_with_an_overlay(variant) -> None:
    res = variant(vllm(env=[{"name": f"V{i}", "value": "x"} for i in range(100)]))
    validate(res)
    t0 = time.perf_counter()
    for _ in range(5):
        assert validate(res) == []
    assert (time.perf_counter() - t0) / 5 < 0.5
