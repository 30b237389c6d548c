"""The PodSpec schema of ``spec.engine.podTemplate`` in crd.yaml is the generator's output
(``scripts/gen_podspec_schema.py``) from the OpenAPI v3 of the Kubernetes release tools/kube builds.
Needs that release's ``k8s.io/kubernetes`` module in Go's module cache (``make kube`` downloads it):
skipped without it, failed in CI (``MOE_EPLB_REQUIRE_KUBE=1``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from moe_eplb.api import crd
from scripts import gen_podspec_schema as gen
from tests.require import missing


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    path = gen.openapi_file()
    if not path.is_file():
        missing(f"no {path} (the k8s.io/kubernetes module of tools/kube; run `make kube`)")
    return gen.load_openapi(path)


def test_committed_block_is_the_generators_output(openapi) -> None:
    text = gen.CRD_YAML.read_text(encoding="utf-8")
    assert gen.crd_block(text) == gen.block_yaml(openapi), "run: python scripts/gen_podspec_schema.py"


def test_regenerate_is_idempotent(openapi, tmp_path) -> None:
    target = tmp_path / "crd.yaml"
    target.write_text(gen.CRD_YAML.read_text(encoding="utf-8"))
    assert gen.regenerate(openapi, target) is False
    broken = target.read_text().replace("hostNetwork:", "hostNetwerk:", 1)
    target.write_text(broken)
    assert gen.regenerate(openapi, target) is True
    assert target.read_text() == gen.CRD_YAML.read_text(encoding="utf-8")


def test_every_podspec_field_of_the_release_is_in_the_crd(openapi) -> None:
    upstream = set(openapi["components"]["schemas"][gen.POD_SPEC]["properties"])
    node = crd.openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["podTemplate"]
    assert set(node["properties"]["spec"]["properties"]) == upstream
    assert {"containers", "volumes", "tolerations", "affinity", "securityContext", "priorityClassName"} <= upstream


def test_recursion_and_unknown_refs_are_refused(openapi) -> None:
    schemas = copy.deepcopy(openapi["components"]["schemas"])
    schemas["X"] = {"type": "object", "properties": {"self": {"$ref": "#/components/schemas/X"}}}
    with pytest.raises(ValueError, match="recursive schema X"):
        gen.structural(schemas["X"], schemas, stack=("X",))


def test_missing_source_is_one_line(tmp_path, capsys) -> None:
    assert gen.main(["--openapi", str(tmp_path / "absent.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "absent.json: not found" in err
