"""The apply-time path: the CRD's own schema + CEL rules alone, as the apiserver would run them
(``apiserver_problems``: strict unknown fields, defaults, OpenAPI schema, CEL via ``cel``)."""

from __future__ import annotations

from typing import Any

import pytest

from moe_eplb.api.validation import apiserver_problems
from tests.example_manifests import DELETE, EXAMPLES, load_moeinferences

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def fields(problems: list[Any]) -> list[str]:
    return [p.field for p in problems]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_examples_pass_the_crd(path) -> None:
    docs = load_moeinferences(path)
    assert docs
    for doc in docs:
        assert apiserver_problems(doc) == []


def test_minimal_resource_passes(variant) -> None:
    minimal = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "m"},
               "spec": {"model": {"name": "Qwen/Qwen3-30B-A3B"}}}
    assert apiserver_problems(minimal) == []


def elastic(changes: dict[str, Any]) -> dict[str, Any]:
    """The seed as an elastic group on vLLM 0.34 (4 ranks over 2 pods, up to 8), with ``changes``."""
    base: dict[str, Any] = {"spec.engine.image": "vllm/vllm-openai:v0.34.0", "spec.replicas": 2,
                            "spec.parallelism": {"tensor": 1, "data": 4, "nodes": 2,
                                                 "elastic": {"enabled": True, "maxData": 8}}}
    return {**base, **changes}


# (changes to the seed, field the apiserver names, words the message must contain)
BAD = {
    "eplb-with-ep-1": ({"spec.parallelism.tensor": 1}, "spec.eplb.enabled", "expert-parallel size > 1"),
    "eplb-without-expert-parallel": ({"spec.parallelism.expert": False}, "spec.parallelism.expert", "expert: true"),
    "redundant-over-1023": ({"spec.eplb.numRedundantExperts": 1024}, "spec.eplb.numRedundantExperts", "must be <= 1023"),
    "redundant-negative": ({"spec.eplb.numRedundantExperts": -1}, "spec.eplb.numRedundantExperts", "must be >= 0"),
    "window-0": ({"spec.eplb.windowSize": 0}, "spec.eplb.windowSize", "must be >= 1"),
    "interval-0": ({"spec.eplb.stepInterval": 0}, "spec.eplb.stepInterval", "must be >= 1"),
    "not-divisible-with-moe-override": (
        {"spec.model.moe": {"numExperts": 128}, "spec.eplb.numRedundantExperts": 7},
        "spec.eplb.numRedundantExperts", "divisible by the EP size"),
    "gpu-limit-mismatch": ({"spec.engine.resources": {"limits": {"nvidia.com/gpu": 2}}},
                           "spec.engine.resources.limits", "tensor x dataLocal"),
    "gpu-limit-mismatch-string": ({"spec.engine.resources": {"limits": {"nvidia.com/gpu": "8"}}},
                                  "spec.engine.resources.limits", "tensor x dataLocal"),
    "gpu-request-mismatch": ({"spec.engine.resources": {"requests": {"nvidia.com/gpu": 1}}},
                             "spec.engine.resources.requests", "tensor x dataLocal"),
    "gpu-limit-mismatch-amd": ({"spec.engine.gpuResourceName": "amd.com/gpu",
                                "spec.engine.resources": {"limits": {"amd.com/gpu": 2}}},
                               "spec.engine.resources.limits", "tensor x dataLocal"),
    "gpu-resource-name-without-domain": ({"spec.engine.gpuResourceName": "gpus"},
                                         "spec.engine.gpuResourceName", "does not match"),
    "drain-seconds-negative": ({"spec.engine.drainSeconds": -1}, "spec.engine.drainSeconds", ">= 0"),
    "data-local-inconsistent": ({"spec.parallelism.data": 4, "spec.parallelism.nodes": 2, "spec.parallelism.dataLocal": 1},
                                "spec.parallelism.dataLocal", "data / spec.parallelism.nodes"),
    "data-not-multiple-of-nodes": ({"spec.parallelism.data": 3, "spec.parallelism.nodes": 2},
                                   "spec.parallelism.data", "multiple of spec.parallelism.nodes"),
    "typo-field": ({"spec.eplb.windowsize": 10}, "spec.eplb.windowsize", "did you mean 'windowSize'"),
    "typo-top-level": ({"spec.eplbb": {}}, "spec.eplbb", "did you mean 'eplb'"),
    "bounds-min-over-max": ({"spec.autotune.bounds": {"windowSize": {"min": 5000, "max": 1000}}},
                            "spec.autotune.bounds.windowSize", "min must be <= max"),
    "experiments-min-over-max": ({"spec.autotune.experiments": {"minSeconds": 7200, "maxSeconds": 3600}},
                                 "spec.autotune.experiments", "minSeconds must be <= maxSeconds"),
    "experiments-confidence-over-1": ({"spec.autotune.experiments": {"confidence": 1.5}},
                                      "spec.autotune.experiments.confidence", "must be <= 0.999"),
    "experiments-too-short": ({"spec.autotune.experiments": {"minSeconds": 5}},
                              "spec.autotune.experiments.minSeconds", "must be >= 60"),
    "scale-to-zero-without-activation-query": ({"spec.autoscaling": {"minReplicas": 0, "maxReplicas": 4}},
                                               "spec.autoscaling.keda.activationQuery", "your gateway's queue"),
    "bounds-exclude-window": ({"spec.autotune.bounds": {"windowSize": {"min": 10, "max": 100}}},
                              "spec.autotune.bounds.windowSize", "contain the current spec.eplb.windowSize"),
    "bounds-exclude-interval": ({"spec.autotune.bounds": {"stepInterval": {"min": 2000, "max": 9000}}},
                                "spec.autotune.bounds.stepInterval", "contain the current spec.eplb.stepInterval"),
    "bounds-exclude-redundant": ({"spec.autotune.bounds": {"numRedundantExperts": {"min": 16, "max": 32}}},
                                 "spec.autotune.bounds.numRedundantExperts", "contain the current"),
    "bounds-missing-max": ({"spec.autotune.bounds": {"windowSize": {"min": 10}}},
                           "spec.autotune.bounds.windowSize.max", "required"),
    "malformed-image": ({"spec.engine.image": "ghcr.io/Moe/VLLM:v1"}, "spec.engine.image", "image reference"),
    "image-with-space": ({"spec.engine.image": "vllm openai"}, "spec.engine.image", "image reference"),
    "bad-version": ({"spec.engine.version": "latest"}, "spec.engine.version", "like 0.12.0"),
    "autotune-without-eplb": ({"spec.eplb.enabled": False, "spec.autotune.mode": "Apply"},
                              "spec.autotune.mode", "spec.eplb.enabled: true"),
    "autotune-mode-typo": ({"spec.autotune.mode": "apply"}, "spec.autotune.mode", "'Apply'"),
    "rollout-both-zero": ({"spec.rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "spec.rollout", "cannot both be 0"),
    "topk-over-experts": ({"spec.model.moe": {"numExperts": 8, "topK": 9}}, "spec.model.moe.topK", "must not exceed"),
    "groups-do-not-divide": ({"spec.model.moe": {"numExperts": 10, "numExpertGroups": 4}},
                             "spec.model.moe.numExpertGroups", "must divide"),
    "gpu-memory-utilization-0": ({"spec.engine.gpuMemoryUtilization": 0}, "spec.engine.gpuMemoryUtilization", "must be > 0"),
    "gpu-memory-utilization-over-1": ({"spec.engine.gpuMemoryUtilization": 1.5}, "spec.engine.gpuMemoryUtilization", "must be <= 1"),
    "mm-encoder-mode": ({"spec.engine.mmEncoderTpMode": "tensor"}, "spec.engine.mmEncoderTpMode", "'data', 'weights'"),
    "negative-mm-limit": ({"spec.engine.limitMmPerPrompt": {"image": -1}}, "spec.engine.limitMmPerPrompt.image", "must be >= 0"),
    "quantization-unknown": ({"spec.model.quantization": "int3"}, "spec.model.quantization", "is not one of"),
    "memory-budget-not-a-quantity": ({"spec.autotune.memoryBudgetPerGpu": "lots"}, "spec.autotune.memoryBudgetPerGpu",
                                     "quantity"),
    "missing-model-name": ({"spec.model.name": DELETE}, "spec.model.name", "required"),
    "replicas-negative": ({"spec.replicas": -1}, "spec.replicas", "must be >= 0"),
    "window-wrong-type": ({"spec.eplb.windowSize": "big"}, "spec.eplb.windowSize", "expected a whole number, got 'big'"),
    "prometheus-url": ({"spec.monitoring.prometheusUrl": "prometheus:9090"}, "spec.monitoring.prometheusUrl", "http"),
    "name-too-long": ({"metadata.name": "x" * 46}, "metadata.name", "at most 45 characters"),
    # generated from the catalog (moe_eplb.api.cel_catalog)
    "arch-too-old-for-eplb": ({"spec.engine.version": "0.11.2"}, "spec.eplb.enabled",
                              "Qwen3VLMoeForConditionalGeneration needs vLLM >= 0.12.0"),
    "quantization-without-eplb": ({"spec.model.quantization": "awq"}, "spec.model.quantization", "no EPLB"),
    "unknown-model-without-moe": ({"spec.model.name": "acme/x", "spec.model.architecture": DELETE}, "spec.model.moe",
                                  "not in the catalog"),
    "unknown-architecture-without-moe": ({"spec.model.architecture": "AcmeMoe"}, "spec.model.moe", "not in the catalog"),
    "catalog-divisibility": ({"spec.eplb.numRedundantExperts": 7}, "spec.eplb.numRedundantExperts", "experts (128)"),
    "version-unknown": ({"spec.engine.image": "vllm/vllm-openai:latest"}, "spec.engine.version", "set spec.engine.version"),
    "multimodal-option-on-text-model": ({"spec.model.architecture": "Qwen3MoeForCausalLM"},
                                        "spec.engine.limitMmPerPrompt", "not multimodal"),
    # vLLM 0.34: redundancy, fault tolerance, all2all backend, EPLB communicator
    "omitted-redundancy-before-034": ({"spec.engine.image": "vllm/vllm-openai:v0.33.0", "spec.eplb.numRedundantExperts": DELETE,
                                       "spec.parallelism": {"tensor": 1, "data": 6}},
                                      "spec.eplb.numRedundantExperts", "set numRedundantExperts 4"),
    "ft-below-floor": ({"spec.engine.image": "vllm/vllm-openai:v0.34.0",
                        "spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "deepep_low_latency"},
                        "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}},
                       "spec.eplb.numRedundantExperts", "fault-tolerance floor 44"),
    "ft-without-data-parallel": ({"spec.faultTolerance": {"enabled": True},
                                  "spec.parallelism.all2allBackend": "deepep_low_latency"},
                                 "spec.faultTolerance.enabled", "data parallel > 1"),
    "ft-all2all-backend": ({"spec.faultTolerance": {"enabled": True}, "spec.parallelism": {"tensor": 1, "data": 4}},
                           "spec.parallelism.all2allBackend", "deepep_low_latency or nixl_ep"),
    "ft-scale-down-before-034": ({"spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "nixl_ep"},
                                  "spec.eplb.numRedundantExperts": 44,
                                  "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}},
                                 "spec.faultTolerance.rankFailuresToSurvive", "needs vLLM >= 0.34.0"),
    "moonep-with-eplb": ({"spec.parallelism.all2allBackend": "moonep"}, "spec.parallelism.all2allBackend",
                         "moonep does not support EPLB"),
    "mori-before-034": ({"spec.parallelism.all2allBackend": "mori"}, "spec.parallelism.all2allBackend",
                        "mori needs vLLM >= 0.34.0"),
    "all2all-backend-unknown": ({"spec.parallelism.all2allBackend": "deepep"}, "spec.parallelism.all2allBackend",
                                "is not one of"),
    "symm-mem-across-nodes": ({"spec.engine.image": "vllm/vllm-openai:v0.34.0", "spec.eplb.communicator": "symm_mem",
                               "spec.parallelism": {"tensor": 4, "data": 2, "nodes": 2}},
                              "spec.eplb.communicator", "one NVLink domain"),
    # elastic groups (spec.parallelism.elastic; vLLM >= 0.33 external elastic EP)
    "elastic-without-eplb": (elastic({"spec.eplb.enabled": False, "spec.eplb.numRedundantExperts": 0}),
                             "spec.parallelism.elastic.enabled", "needs EPLB"),
    "elastic-before-033": (elastic({"spec.engine.image": "vllm/vllm-openai:v0.32.0"}),
                           "spec.parallelism.elastic.enabled", "needs vLLM >= 0.33.0"),
    "elastic-without-max": (elastic({"spec.parallelism.elastic": {"enabled": True}}),
                            "spec.parallelism.elastic.maxData", "is required"),
    "elastic-min-below-launch": (elastic({"spec.parallelism.elastic.minData": 2}),
                                 "spec.parallelism.elastic.minData", "at least spec.parallelism.data"),
    "elastic-max-below-min": (elastic({"spec.parallelism.elastic.minData": 6, "spec.parallelism.elastic.maxData": 4}),
                              "spec.parallelism.elastic.maxData", "at least minData"),
    "elastic-max-not-whole-pods": (elastic({"spec.parallelism.elastic.maxData": 7}),
                                   "spec.parallelism.elastic.maxData", "a pod at a time"),
    "elastic-replicas-outside-sizes": (elastic({"spec.replicas": 5}), "spec.replicas",
                                       "set it between 2 and 4"),
    "elastic-autoscaler-max-disagrees": (elastic({"spec.autoscaling": {"minReplicas": 2, "maxReplicas": 8},
                                                  "spec.monitoring.prometheusUrl": "http://prometheus:9090"}),
                                         "spec.autoscaling.maxReplicas", "set maxReplicas to maxData / dataLocal = 4"),
    "elastic-async-without-nixl": (elastic({"spec.eplb.async": True}), "spec.eplb.async", "needs NIXL"),
    "elastic-with-data-1": (elastic({"spec.parallelism": {"tensor": 4, "data": 1,
                                                          "elastic": {"enabled": True, "maxData": 2}},
                                     "spec.replicas": 1}),
                            "spec.parallelism.elastic.enabled", "data parallel > 1"),
    # issue 37: what vLLM's CLI does not offer, the engine's pod-level fields typed as Kubernetes types
    # them, the workload object's metadata, vendor x backend, the GPU's memory
    "all2all-backend-passthrough": ({"spec.parallelism.all2allBackend": "passthrough"}, "spec.parallelism.all2allBackend",
                                    "is not one of"),
    "engine-toleration-typo": ({"spec.engine.tolerations": [{"key": "gpu", "operater": "Exists", "effect": "NoSchedule"}]},
                               "spec.engine.tolerations[0].operater", "did you mean 'operator'"),
    "engine-env-valuefrom-typo": ({"spec.engine.env": [{"name": "T", "valueFrom": {"secretKeyRf": {"name": "s", "key": "k"}}}]},
                                  "spec.engine.env[0].valueFrom.secretKeyRf", "did you mean 'secretKeyRef'"),
    "engine-toleration-operator-enum": ({"spec.engine.tolerations": [{"key": "gpu", "operator": "exists"}]},
                                        "spec.engine.tolerations[0].operator", "is not one of"),
    "workload-operator-label": ({"spec.workload": {"metadata": {"labels": {"eplb.ai/name": "other"}}}},
                                "spec.workload.metadata.labels", "the operator's labels"),
    "workload-lws-annotation": ({"spec.parallelism": {"tensor": 2, "data": 2, "nodes": 2},
                                 "spec.workload": {"metadata": {"annotations": {"leaderworkerset.sigs.k8s.io/size": "2"}}}},
                                "spec.workload.metadata.annotations", "only leaderworkerset.sigs.k8s.io/exclusive-topology"),
    "workload-lws-annotation-on-deployment": (
        {"spec.workload": {"metadata": {"annotations": {"leaderworkerset.sigs.k8s.io/exclusive-topology": "rack"}}}},
        "spec.workload.metadata.annotations", "the workload is a Deployment"),
    "deepep-on-amd": ({"spec.parallelism.all2allBackend": "deepep_low_latency", "spec.engine.gpuResourceName": "amd.com/gpu",
                       "spec.engine.image": "vllm/vllm-openai-rocm:v0.32.0"}, "spec.parallelism.all2allBackend",
                      "on NVIDIA GPUs only"),
    "mori-on-nvidia": ({"spec.parallelism.all2allBackend": "mori", "spec.engine.image": "vllm/vllm-openai:v0.34.0"},
                       "spec.parallelism.all2allBackend", "on AMD GPUs only"),
    "gpu-memory-not-a-quantity": ({"spec.engine.gpuMemory": "80 GB"}, "spec.engine.gpuMemory", "does not match"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_crd_rejects(case: str, variant) -> None:
    changes, field, words = BAD[case]
    problems = apiserver_problems(variant(changes))
    matching = [p for p in problems if p.field == field]
    assert matching, f"{case}: expected a problem at {field}, got {problems}"
    assert any(words in p.message for p in matching), matching


def test_good_variants_pass(variant) -> None:
    good = [
        {"spec.engine.resources": {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}}},
        {"spec.engine.resources": {"limits": {"nvidia.com/gpu": "4"}, "requests": {"nvidia.com/gpu": 4}}},
        {"spec.autotune.bounds": {"windowSize": {"min": 3000, "max": 3000}}},
        {"spec.model.moe": {"numExperts": 128, "numMoeLayers": 48, "topK": 8}},
        {"spec.eplb.enabled": False, "spec.parallelism.tensor": 1},
        {"spec.parallelism": {"tensor": 2, "data": 4, "nodes": 2, "dataLocal": 2},
         "spec.engine.resources": {"limits": {"nvidia.com/gpu": 4}}},
        {"spec.engine.image": "registry.local:5000/team/vllm@sha256:" + "a" * 64, "spec.engine.version": "0.12.0"},
        {"spec.engine.image": "registry.local:5000/team/vllm@sha256:" + "a" * 64, "spec.eplb.enabled": False},
        {"spec.engine.image": "vllm/vllm-openai:v0.12.0-cu130", "spec.autotune.memoryBudgetPerGpu": "8Gi"},
        {"spec.autotune.memoryBudgetPerGpu": 8589934592},
        # the GPU count is checked on the resource name the pods request, not on nvidia.com/gpu
        {"spec.engine.gpuResourceName": "amd.com/gpu", "spec.engine.resources": {"limits": {"amd.com/gpu": 4}}},
        {"spec.engine.drainSeconds": 0},
        # Kueue's gang admission of a group (the queue label on the LeaderWorkerSet), LWS's exclusive topology
        {"spec.parallelism": {"tensor": 2, "data": 2, "nodes": 2},
         "spec.workload": {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "gpu"},
                                        "annotations": {"leaderworkerset.sigs.k8s.io/exclusive-topology": "rack"}}}},
        {"spec.engine.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
         "spec.engine.env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
         "spec.engine.gpuMemory": "80Gi"},
    ]
    for changes in good:
        assert apiserver_problems(variant(changes)) == [], changes


def test_defaults_make_nested_rules_evaluable(variant) -> None:
    """A resource without eplb/parallelism/autotune gets their defaults before CEL runs (no rule errors)."""
    res = variant({"spec": {"model": {"name": "Qwen/Qwen3-30B-A3B"}}})
    assert apiserver_problems(res) == []
