"""The catalog's CEL rules in the CRD: generated, in sync, and agreeing with validate()'s checks."""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import pytest

from moe_eplb.api import catalog, cel_catalog
from moe_eplb.api.crd import crd_text
from moe_eplb.api.spec import parse
from moe_eplb.api.validation import apiserver_problems, semantic_problems
from moe_eplb.api.versions import parse_version
from tests.example_manifests import DELETE

CRD_SOURCE = Path(cel_catalog.__file__).with_name("crd.yaml")


def test_crd_block_is_generated_from_the_catalog() -> None:
    assert cel_catalog.crd_block(crd_text()) == cel_catalog.rules_yaml(), (
        "the catalog changed: run `python -m moe_eplb.api.cel_catalog` and "
        "`moe-eplb crd > crds/moeinferences.eplb.ai.yaml`")


def test_regenerate_is_idempotent(tmp_path) -> None:
    copy = tmp_path / "crd.yaml"
    copy.write_text(CRD_SOURCE.read_text())
    assert cel_catalog.regenerate(copy) is False
    broken = CRD_SOURCE.read_text().replace("this model has 256 experts", "this model has 255 experts")
    copy.write_text(broken)
    assert cel_catalog.regenerate(copy) is True
    assert copy.read_text() == CRD_SOURCE.read_text()


VERSIONS = ["0.0.1", "0.8.5", "0.9.0", "0.9.9", "0.10.0", "0.10.1", "0.10.2", "0.10.10", "0.11.0", "0.11.1",
            "0.11.2", "0.12.0", "0.12.1", "0.19.0", "0.25.9", "0.26.0", "0.32.0", "1.0.0", "10.0.0", "0.100.3"]


@pytest.mark.parametrize("threshold", [(0, 9, 0), (0, 10, 2), (0, 12, 0), (0, 26, 0), (1, 2, 3)])
def test_version_below_regex_orders_like_tuples(threshold) -> None:
    rx = re.compile("^v?" + cel_catalog.version_below_regex(threshold) + "([^0-9].*)?$")
    for text in VERSIONS + [v + "rc1" for v in VERSIONS] + ["v" + v for v in VERSIONS]:
        assert bool(rx.match(text)) == (parse_version(text) < threshold), (text, threshold)


# what the generated rules cover (the same fields semantic_problems uses)
COVERED = {"spec.model.moe", "spec.engine.version", "spec.eplb.enabled", "spec.eplb.numRedundantExperts",
           "spec.engine.limitMmPerPrompt", "spec.engine.mmEncoderTpMode", "spec.model.quantization"}

NAMES = ["Qwen/Qwen3-VL-30B-A3B-Instruct", "cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit", "deepseek-ai/DeepSeek-R1",
         "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "/models/glm-4.5-air", "zai-org/GLM-4.5V", "acme/private-moe",
         "mistralai/Mixtral-8x7B-Instruct-v0.1", "meta-llama/Llama-4-Scout-17B-16E-Instruct", "Qwen/Qwen3-30B-A3B"]
ARCHS = [DELETE, "Qwen3MoeForCausalLM", "MixtralForCausalLM", "AcmeForCausalLM"]
ENGINES = [{"spec.engine.version": "0.10.1"}, {"spec.engine.version": "0.11.1"}, {"spec.engine.version": "0.12.0"},
           {"spec.engine.image": "vllm/vllm-openai:v0.10.2"}, {"spec.engine.image": "vllm/vllm-openai:latest"},
           {"spec.engine.image": "registry.local:5000/vllm:0.32.0-cu130"}, {"spec.engine.version": "0.8.0"}]
QUANTS = ["none", "compressed-tensors-wna16", "awq", "modelopt-nvfp4"]
SHAPES = [({"spec.eplb.numRedundantExperts": 8}, {}), ({"spec.eplb.numRedundantExperts": 6}, {}),
          ({"spec.eplb.numRedundantExperts": 4}, {"spec.model.moe": {"numExperts": 60}})]
MM = [{}, {"spec.engine.limitMmPerPrompt": DELETE, "spec.engine.mmEncoderTpMode": DELETE}]


def _cases():
    grid = list(itertools.product(NAMES, ARCHS, ENGINES, QUANTS, SHAPES, MM))  # 6720 combinations
    for name, arch, engine, quant, (r, moe), mm in random.Random(2).sample(grid, 1500):
        yield {"spec.model.name": name, "spec.model.architecture": arch, "spec.model.quantization": quant,
               **engine, **r, **moe, **mm}


def test_crd_rules_agree_with_validate_on_a_grid(variant) -> None:
    """For 1500 variations of the seed (a fixed sample of a 6720-point grid), the fields the CRD alone refuses equal the fields the
    catalog-aware checks refuse (within what the generated rules cover)."""
    checked = disagreements = 0
    for changes in _cases():
        res = variant(changes)
        crd = {p.field for p in apiserver_problems(res)} & COVERED
        ours = {p.field for p in semantic_problems(parse(res))} & COVERED
        checked += 1
        if crd != ours:
            disagreements += 1
            assert crd == ours, (changes, crd, ours)
    assert checked == 1500 and disagreements == 0


def test_a_few_apply_time_rejections_by_name(variant) -> None:
    def crd_fields(changes):
        return {p.field: p.message for p in apiserver_problems(variant(changes))}

    old = crd_fields({"spec.engine.image": "vllm/vllm-openai:v0.11.0"})
    assert "Qwen3VLMoeForConditionalGeneration needs vLLM >= 0.12.0" in old["spec.eplb.enabled"]
    assert "compressed-tensors-wna16" in old["spec.model.quantization"]
    assert "spec.model.moe" in crd_fields({"spec.model.name": "acme/x", "spec.model.architecture": DELETE})
    assert "experts (256)" in crd_fields({"spec.model.name": "deepseek-ai/DeepSeek-V3", "spec.model.architecture": DELETE,
                                        "spec.model.quantization": "fp8", "spec.engine.limitMmPerPrompt": DELETE,
                                        "spec.engine.mmEncoderTpMode": DELETE, "spec.parallelism.tensor": 5}
                                       )["spec.eplb.numRedundantExperts"]
    assert "spec.engine.version" in crd_fields({"spec.engine.image": "vllm/vllm-openai:nightly"})


def test_every_catalog_id_matches_its_family_regex() -> None:
    for m in catalog.MODELS:
        rx = re.compile(cel_catalog._name_regex([m]))
        for hf_id in m.hf_ids:
            assert rx.search(hf_id) and catalog.lookup(hf_id) is m


def test_divisibility_messages_name_the_nearest_values_at_apply_time(variant) -> None:
    """The CRD's messageExpression computes the same nearest values as validate()."""
    from moe_eplb.api.crd import openapi_schema

    hand = [r for r in openapi_schema()["properties"]["spec"]["x-kubernetes-validations"]
            if "[self.model.moe.numExperts, " in r.get("messageExpression", "")]
    assert [r["messageExpression"] for r in hand] == [cel_catalog.divisibility_message("self.model.moe.numExperts")]
    crd = {p.field: p.message for p in apiserver_problems(variant({"spec.eplb.numRedundantExperts": 7}))}
    assert crd["spec.eplb.numRedundantExperts"].endswith("use numRedundantExperts 4 or 8")
    over = apiserver_problems(variant({"spec.model.moe": {"numExperts": 60}, "spec.eplb.numRedundantExperts": 1}))
    assert [p.message for p in over if p.field == "spec.eplb.numRedundantExperts"] == [
        "experts (60) + numRedundantExperts (1) is not divisible by the EP size 4 "
        "(tensor x data); use numRedundantExperts 0 or 4"]  # the field once, not again in the message


def test_cel_format_like_the_kubernetes_strings_library() -> None:
    """The apiserver's ``'...'.format([...])`` for the verbs the CRD's messages use."""
    import pytest

    from moe_eplb.api.cel_rules import cel_format

    assert cel_format("experts (%d) + %s: 100%%", [128, "x"]) == "experts (128) + x: 100%"
    for template, args in [("%d", ["1"]), ("%d", [True]), ("%d %d", [1]), ("%d", [1, 2]), ("%f", [1.0])]:
        with pytest.raises(ValueError):
            cel_format(template, args)
