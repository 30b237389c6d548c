"""The model catalog: lookups, shapes, bytes per expert, EPLB support data."""

from __future__ import annotations

import pytest

from moe_eplb.api import catalog
from moe_eplb.api.catalog import ARCHITECTURES, MODELS, QUANTIZATIONS, lookup


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("DEEPSEEK-AI/deepseek-r1", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite"),
        ("deepseek-ai/DeepSeek-V2.5", "deepseek-v2"),
        ("Qwen/Qwen3-VL-30B-A3B-Instruct", "qwen3-vl-30b-a3b"),
        ("cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit", "qwen3-vl-30b-a3b"),
        ("/models/Qwen3-VL-235B-A22B-Thinking/", "qwen3-vl-235b-a22b"),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
        ("qwen/qwen3-235b-a22b", "qwen3-235b-a22b"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4-scout"),
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8", "llama4-maverick"),
        ("zai-org/GLM-4.5-Air", "glm-4.5-air"),
        ("zai-org/GLM-4.5-FP8", "glm-4.5"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ],
)
def test_lookup(name: str, key: str) -> None:
    info = lookup(name)
    assert info is not None and info.key == key


@pytest.mark.parametrize("name", ["", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                                  "zai-org/GLM-4.5V"])
def test_lookup_misses(name: str) -> None:
    assert lookup(name) is None


def test_shapes_from_hf_configs() -> None:
    v3 = lookup("deepseek-ai/DeepSeek-V3")
    assert (v3.num_experts, v3.num_moe_layers, v3.top_k, v3.num_expert_groups) == (256, 58, 8, 8)
    vl = lookup("Qwen/Qwen3-VL-30B-A3B-Instruct")
    assert (vl.num_experts, vl.num_moe_layers, vl.top_k) == (128, 48, 8)
    assert vl.architecture == "Qwen3VLMoeForConditionalGeneration"
    assert ARCHITECTURES[vl.architecture].multimodal
    assert lookup("meta-llama/Llama-4-Maverick-17B-128E").num_moe_layers == 24  # every other layer is MoE
    assert lookup("mistralai/Mixtral-8x7B-v0.1").top_k == 2


def test_bytes_per_expert() -> None:
    v3 = lookup("deepseek-ai/DeepSeek-V3")
    assert v3.bytes_per_expert("none") == 3 * 7168 * 2048 * 2
    fp8 = v3.bytes_per_expert()  # the checkpoint is FP8 with 128x128 block scales
    assert 3 * 7168 * 2048 <= fp8 < 3 * 7168 * 2048 * 1.001
    # vLLM's docs: about 2.4 GB per redundant expert (all MoE layers) for DeepSeek-V3
    assert 2.4e9 < fp8 * v3.num_moe_layers < 2.7e9
    vl = lookup("Qwen/Qwen3-VL-30B-A3B-Instruct")
    wna16 = vl.bytes_per_expert("compressed-tensors-wna16")
    assert wna16 == round(3 * 2048 * 768 * (0.5 + 2 / 128))
    assert vl.bytes_per_expert("none") / wna16 == pytest.approx(2 / 0.515625)
    assert vl.bytes_per_expert("gguf") is None


def test_every_model_architecture_is_known_and_ids_unique() -> None:
    ids = [i.lower() for m in MODELS for i in m.hf_ids]
    assert len(ids) == len(set(ids))
    for m in MODELS:
        assert m.architecture in ARCHITECTURES
        assert m.default_quantization in QUANTIZATIONS
        assert m.num_experts % m.num_expert_groups == 0 and m.top_k <= m.num_experts
        for hf_id in m.hf_ids:
            assert lookup(hf_id) is m


def test_eplb_support_versions_from_the_notes() -> None:
    assert ARCHITECTURES["Qwen3VLMoeForConditionalGeneration"].eplb_since == (0, 12, 0)
    assert QUANTIZATIONS["compressed-tensors-wna16"].eplb_since == (0, 12, 0)
    assert QUANTIZATIONS["none"].eplb_since == QUANTIZATIONS["fp8"].eplb_since == (0, 9, 0)
    assert QUANTIZATIONS["awq"].eplb_since is None


def test_quantization_guess() -> None:
    assert catalog.guess_quantization("cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit", None) is None
    assert catalog.guess_quantization("zai-org/GLM-4.5-Air-FP8", lookup("zai-org/GLM-4.5-Air-FP8")) == "fp8"
    assert catalog.guess_quantization("deepseek-ai/DeepSeek-V3", lookup("deepseek-ai/DeepSeek-V3")) == "fp8"
    assert catalog.guess_quantization("Qwen/Qwen3-30B-A3B", lookup("Qwen/Qwen3-30B-A3B")) == "none"


def test_catalog_enum_matches_crd() -> None:
    from moe_eplb.api.crd import openapi_schema

    enum = openapi_schema()["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]["enum"]
    assert sorted(enum) == sorted(QUANTIZATIONS)


def test_docs_embed_the_current_catalog() -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "resource.md").read_text()
    start = docs.index("<!-- BEGIN catalog")
    block = docs[docs.index("\n", start) + 1: docs.index("<!-- END catalog -->")]
    assert block == catalog.markdown_tables(), "regenerate the catalog block in docs/resource.md"
