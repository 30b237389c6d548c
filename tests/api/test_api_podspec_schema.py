"""The generator of the PodSpec schema (``scripts/gen_podspec_schema.py``) on small documents; the
committed block against what the real kube-apiserver serves is checked in
tests/kube/test_podtemplate_real.py."""

from __future__ import annotations

import pytest

from scripts import gen_podspec_schema as gen

REF = "#/components/schemas/"


def doc() -> dict:
    return {"components": {"schemas": {
        gen.POD_SPEC: {"type": "object", "required": ["containers"], "properties": {
            "containers": {"type": "array", "items": {"allOf": [{"$ref": REF + "C"}], "default": {}},
                           "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                           "x-kubernetes-patch-merge-key": "name", "x-kubernetes-patch-strategy": "merge"},
            "overhead": {"type": "object", "additionalProperties": {"$ref": REF + gen.QUANTITY}},
            "hostNetwork": {"type": "boolean", "default": False, "description": "Host networking."},
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
            "tolerations": {"type": "array", "items": {"allOf": [{"$ref": REF + "T"}]}},
            "imagePullSecrets": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string", "default": ""}}}},
        }},
        "T": {"type": "object", "properties": {"key": {"type": "string"},
                                               "operator": {"type": "string", "enum": ["Equal", "Exists"]}}},
        "C": {"type": "object", "required": ["name"], "description": "A container.", "properties": {
            "name": {"type": "string", "default": ""},
            "ports": {"type": "array", "x-kubernetes-list-type": "map",
                      "x-kubernetes-list-map-keys": ["containerPort", "protocol"],
                      "items": {"allOf": [{"$ref": REF + "P"}]}},
            "pullPolicy": {"type": "string", "enum": ["Always", "Never"]},
            "env": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "valueFrom": {"type": "object", "properties": {
                    "secretKeyRef": {"type": "object", "properties": {"key": {"type": "string"}}}}}}}},
            "resources": {"type": "object", "properties": {
                "limits": {"type": "object", "additionalProperties": {"$ref": REF + gen.QUANTITY}},
                "requests": {"type": "object", "additionalProperties": {"$ref": REF + gen.QUANTITY}}}},
        }},
        "P": {"type": "object", "required": ["containerPort"], "properties": {
            "containerPort": {"type": "integer", "format": "int32"},
            "protocol": {"type": "string", "default": "TCP"},
            "port": {"allOf": [{"$ref": REF + gen.INT_OR_STRING}]},
        }},
        gen.QUANTITY: {"oneOf": [{"type": "string"}, {"type": "number"}]},
        gen.INT_OR_STRING: {"oneOf": [{"type": "integer"}, {"type": "string"}], "format": "int-or-string"},
    }}}


def test_refs_inlined_into_a_structural_schema() -> None:
    spec = gen.pod_spec_schema(doc())
    assert "required" not in spec and spec["description"] == gen.POD_SPEC_DESCRIPTION
    containers = spec["properties"]["containers"]
    assert containers["maxItems"] == 32 and containers["x-kubernetes-list-map-keys"] == ["name"]
    assert not any(k.startswith("x-kubernetes-patch") for k in containers)
    item = containers["items"]
    assert item["required"] == ["name"] and "default" not in item and "description" not in item
    assert "default" not in item["properties"]["name"]  # required: no default needed
    port = item["properties"]["ports"]["items"]["properties"]
    assert port["protocol"]["default"] == "TCP"  # a list-map key that is not required keeps it
    assert port["port"] == {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    assert spec["properties"]["overhead"]["additionalProperties"]["pattern"] == gen.QUANTITY_PATTERN
    assert "default" not in spec["properties"]["hostNetwork"]
    assert item["properties"]["pullPolicy"]["enum"] == ["Always", "Never"]


def test_block_has_the_rules_and_no_yaml_aliases() -> None:
    block = gen.block_yaml(doc())
    assert block.startswith(gen.INDENT + "env:\n") and "\n" + gen.INDENT + "podTemplate:\n" in block
    assert "&id" not in block and "*id" not in block
    assert "x-kubernetes-validations" in block and "carries the EPLB arguments" in block


def test_recursive_schema_is_refused() -> None:
    d = doc()
    d["components"]["schemas"]["P"]["properties"]["self"] = {"$ref": REF + "P"}
    with pytest.raises(ValueError, match="recursive schema P"):
        gen.pod_spec_schema(d)


def test_missing_source_is_one_line(tmp_path, capsys) -> None:
    assert gen.main(["--openapi", str(tmp_path / "absent.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "absent.json: not found" in err


def test_the_engines_pod_fields_are_the_podspecs_own() -> None:
    """``spec.engine.env``, ``tolerations``, ``nodeSelector``, ``imagePullSecrets`` and ``resources``
    get Kubernetes' schemas from the same PodSpec (enums and unknown fields checked), bounded, with
    our descriptions; an image pull secret must name its Secret."""
    from moe_eplb.api.podtemplate import engine_pod_fields

    fields = engine_pod_fields(gen.pod_spec_schema(doc()))
    assert sorted(fields) == ["env", "imagePullSecrets", "nodeSelector", "resources", "tolerations"]
    assert fields["tolerations"]["items"]["properties"]["operator"]["enum"] == ["Equal", "Exists"]
    assert fields["tolerations"]["maxItems"] == 64 and fields["env"]["maxItems"] == 128
    env_from = fields["env"]["items"]["properties"]["valueFrom"]["properties"]
    assert env_from["secretKeyRef"]["properties"] == {"key": {"type": "string"}}
    assert fields["imagePullSecrets"]["items"]["required"] == ["name"]
    assert fields["resources"]["properties"]["limits"]["maxProperties"] == 32
    assert fields["resources"]["properties"]["limits"]["additionalProperties"]["pattern"] == gen.QUANTITY_PATTERN
    assert all(f["description"] for f in fields.values())
