"""The CRD file: one source of truth, structural, pinned names, subresources, printer columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cel
import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.api.crd import crd, crd_text, openapi_schema
from moe_eplb.api.imageref import IMAGE_PATTERN
from moe_eplb.api.schema import schema_problems
from moe_eplb.cli import main
from moe_eplb.contracts.k8s_names import API_GROUP, API_VERSION, KIND, PLURAL

REPO = Path(__file__).resolve().parents[2]
CRD_COPY = REPO / "crds" / "moeinferences.eplb.ai.yaml"

# /tmp/crd_fields.md, pinned for every engineer (spec and status paths)
PINNED_SPEC = [
    "model.name", "model.servedName", "model.architecture", "model.quantization",
    "model.moe.numExperts", "model.moe.numMoeLayers", "model.moe.topK", "model.moe.numExpertGroups",
    "model.moe.bytesPerExpert", "model.storage.pvc.claimName", "model.storage.pvc.mountPath",
    "model.storage.pvc.subPath", "model.storage.hfTokenSecret.name", "model.storage.hfTokenSecret.key",
    "engine.image", "engine.version", "engine.dtype", "engine.maxModelLen", "engine.gpuMemoryUtilization",
    "engine.limitMmPerPrompt", "engine.mmEncoderTpMode", "engine.chatTemplate.configMapRef.name",
    "engine.chatTemplate.configMapRef.key", "engine.extraArgs", "engine.env", "engine.resources",
    "parallelism.tensor", "parallelism.data", "parallelism.dataLocal", "parallelism.nodes", "replicas",
    "eplb.enabled", "eplb.windowSize", "eplb.stepInterval", "eplb.numRedundantExperts", "eplb.async",
    "eplb.logBalancedness", "autotune.mode", "autotune.bounds.windowSize.min", "autotune.bounds.windowSize.max",
    "autotune.bounds.stepInterval.min", "autotune.bounds.stepInterval.max",
    "autotune.bounds.numRedundantExperts.min", "autotune.bounds.numRedundantExperts.max",
    "autotune.memoryBudgetPerGpu", "autotune.evaluationIntervalSeconds", "autotune.cooldownSeconds",
    "autotune.maxRestartsPerDay", "autotune.minGain", "autotune.rollbackTolerance", "autotune.observeSeconds",
    "autotune.experiments.enabled", "autotune.experiments.minSeconds", "autotune.experiments.maxSeconds",
    "autotune.experiments.confidence", "rollout.maxSurge", "rollout.maxUnavailable", "monitoring.prometheusUrl", "monitoring.podMonitor.enabled",
]
PINNED_STATUS = [
    "observedGeneration", "phase", "message", "endpoint", "replicas", "readyReplicas", "selector", "epSize",
    "balancedness", "eplb.enabled", "eplb.windowSize", "eplb.stepInterval", "eplb.numRedundantExperts",
    "conditions", "autotune", "autotune.override.windowSize", "autotune.override.stepInterval",
    "autotune.override.numRedundantExperts", "autotune.override.specGeneration",
]
PINNED_DEFAULTS = {
    "autotune.evaluationIntervalSeconds": 300, "autotune.cooldownSeconds": 3600, "autotune.maxRestartsPerDay": 4,
    "autotune.minGain": 0.02, "autotune.rollbackTolerance": 0.02, "autotune.observeSeconds": 600,
    "autotune.experiments.enabled": True, "autotune.experiments.minSeconds": 900,
    "autotune.experiments.maxSeconds": 3600, "autotune.experiments.confidence": 0.9,
    "autotune.experiments.baselineSeconds": 1800, "autotune.experiments.warmupSeconds": 300,
    "rollout.maxSurge": 0, "rollout.maxUnavailable": 1, "autotune.mode": "Off",
}


def _node(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    for part in dotted.split("."):
        schema = schema["properties"][part]
    return schema


def test_crd_copy_is_byte_identical_to_the_packaged_source() -> None:
    assert CRD_COPY.read_text(encoding="utf-8") == crd_text(), (
        "crds/moeinferences.eplb.ai.yaml differs from operator/moe_eplb/api/crd.yaml: "
        "run `moe-eplb crd > crds/moeinferences.eplb.ai.yaml`"
    )


def test_crd_command_prints_the_crd() -> None:
    result = CliRunner().invoke(main, ["crd"])
    assert result.exit_code == 0
    assert result.output == crd_text()
    assert yaml.safe_load(result.output)["metadata"]["name"] == f"{PLURAL}.{API_GROUP}"


def test_names_group_and_scope() -> None:
    doc = crd()
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = doc["spec"]
    assert spec["group"] == API_GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == KIND and spec["names"]["plural"] == PLURAL
    assert spec["names"]["shortNames"] == ["moe"]
    assert [v["name"] for v in spec["versions"]] == [API_VERSION]


def test_status_and_scale_subresources() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_printer_columns() -> None:
    cols = {c["name"]: c for c in crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Model"]["jsonPath"] == ".spec.model.name"
    assert cols["EP"]["jsonPath"] == ".status.epSize"
    assert cols["Redundant"]["jsonPath"] == ".status.eplb.numRedundantExperts"
    assert cols["Window"]["jsonPath"] == ".status.eplb.windowSize"
    assert cols["Interval"]["jsonPath"] == ".status.eplb.stepInterval"
    assert cols["Balancedness"]["jsonPath"] == ".status.balancedness" and cols["Balancedness"]["type"] == "number"
    assert cols["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Age"]["type"] == "date"


@pytest.mark.parametrize("path", PINNED_SPEC)
def test_pinned_spec_field_exists(path: str) -> None:
    _node(openapi_schema()["properties"]["spec"], path)


@pytest.mark.parametrize("path", PINNED_STATUS)
def test_pinned_status_field_exists(path: str) -> None:
    _node(openapi_schema()["properties"]["status"], path)


@pytest.mark.parametrize(("path", "value"), sorted(PINNED_DEFAULTS.items()))
def test_pinned_defaults(path: str, value: Any) -> None:
    assert _node(openapi_schema()["properties"]["spec"], path)["default"] == value


def test_phase_and_autotune_mode_enums() -> None:
    schema = openapi_schema()
    assert _node(schema["properties"]["status"], "phase")["enum"] == [
        "Pending", "Progressing", "Running", "Degraded", "Invalid"]
    assert _node(schema["properties"]["spec"], "autotune.mode")["enum"] == ["Off", "Recommend", "Apply"]


def _walk(schema: Any, path: str = ""):
    if isinstance(schema, dict):
        yield path, schema
        for key in ("properties",):
            for name, sub in (schema.get(key) or {}).items():
                yield from _walk(sub, f"{path}.{name}")
        if isinstance(schema.get("items"), dict):
            yield from _walk(schema["items"], path + "[]")
        if isinstance(schema.get("additionalProperties"), dict):
            yield from _walk(schema["additionalProperties"], path + "{}")
        for i, sub in enumerate(schema.get("anyOf") or ()):
            yield from _walk(sub, f"{path}|{i}")


def test_schema_is_structural() -> None:
    """Kubernetes' structural-schema rules that matter here: every node has a type (or is
    int-or-string / preserve-unknown-fields), properties and additionalProperties are not mixed,
    anyOf only under int-or-string, and metadata at the root is a plain object."""
    schema = openapi_schema()
    assert schema["properties"]["metadata"] == {"type": "object"}
    for path, node in _walk(schema):
        if "|" in path.rsplit(".", 1)[-1]:
            continue  # an anyOf branch
        int_or_string = node.get("x-kubernetes-int-or-string")
        assert "type" in node or int_or_string or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and isinstance(node.get("additionalProperties"), dict)), path
        if "anyOf" in node:
            assert int_or_string, path
        if node.get("type") == "object" and "properties" in node and "required" in node:
            assert set(node["required"]) <= set(node["properties"]), path


def test_defaults_are_valid_against_their_own_schema() -> None:
    for path, node in _walk(openapi_schema()):
        if "default" in node:
            problems = schema_problems(node["default"], node)
            assert problems == [], (path, problems)


def test_every_cel_rule_compiles_and_has_a_message() -> None:
    rules = [r for _, node in _walk(openapi_schema()) for r in node.get("x-kubernetes-validations") or ()]
    assert len(rules) >= 15
    for rule in rules:
        cel.compile(rule["rule"])
        if rule.get("messageExpression"):
            cel.compile(rule["messageExpression"])
        assert rule.get("message"), rule["rule"]
        if rule.get("fieldPath"):
            assert rule["fieldPath"].startswith(".")


def test_image_pattern_is_shared_with_imageref() -> None:
    assert _node(openapi_schema()["properties"]["spec"], "engine.image")["pattern"] == IMAGE_PATTERN


def test_every_field_has_a_description_or_is_self_explanatory() -> None:
    spec = openapi_schema()["properties"]["spec"]
    described = [p for p, n in _walk(spec) if n.get("description")]
    assert len(described) >= 60
    for top in spec["properties"].values():
        assert top.get("description")


def test_every_spec_string_is_bounded() -> None:
    """The API server estimates CEL cost from maxLength/maxItems/maxProperties; unbounded strings
    and maps make rules over them too costly to admit. Every spec string has a maxLength, except in
    the PodSpec of ``engine.podTemplate.spec``: it is Kubernetes' own schema, generated as served
    (scripts/gen_podspec_schema.py), the rules over it fit the budget on a real kube-apiserver
    (tests/kube), and the apiserver bounds its strings when the pods' workload is created; the same goes
    for the engine's pod-level fields generated from it (``env``, ``tolerations``, ...)."""
    from moe_eplb.api.podtemplate import ENGINE_POD_FIELDS

    generated = (".engine.podTemplate.spec.",) + tuple(f".engine.{f}" for f in ENGINE_POD_FIELDS)
    missing = [p for p, n in _walk(openapi_schema()["properties"]["spec"])
               if "|" not in p and (n.get("type") == "string" or n.get("x-kubernetes-int-or-string"))
               and "maxLength" not in n and not p.startswith(generated)]
    assert missing == []


def test_crd_is_a_valid_custom_resource_definition() -> None:
    """The CRD object itself, strictly against Kubernetes' apiextensions.k8s.io/v1 schema (catches
    misspelled schema keywords such as ``x-kubernetes-validation``)."""
    import kubernetes_validate

    kubernetes_validate.validate(crd(), kubernetes_validate.latest_version(), strict=True)
    broken = crd()
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validation"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
