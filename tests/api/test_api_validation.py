"""``validate()``: the one implementation behind ``moe-eplb validate`` and the operator.

It must reject everything the CRD rejects (same messages) and, in addition, what needs the catalog
and the engine version.
"""

from __future__ import annotations

import copy

import pytest

from moe_eplb.api.spec import parse
from moe_eplb.api.validation import (
    Problem,
    apiserver_problems,
    nearest_redundant_values,
    validate,
)
from tests.example_manifests import DELETE, EXAMPLES, frozen, load_moeinferences

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_examples_are_valid(path) -> None:
    for doc in load_moeinferences(path):
        assert validate(doc) == []


def only(problems: list[Problem], field: str) -> list[Problem]:
    return [p for p in problems if p.field == field]


def test_not_a_mapping() -> None:
    assert validate(["x"])[0].field == "<root>"


def test_wrong_kind_and_api_version(variant) -> None:
    problems = validate(variant({"apiVersion": "eplb.ai/v1", "kind": "MoeInference"}))
    assert only(problems, "apiVersion") and "eplb.ai/v1alpha1" in only(problems, "apiVersion")[0].message
    assert only(problems, "kind") and "MoEInference" in only(problems, "kind")[0].message


def test_name_required_and_dns_label(variant) -> None:
    assert only(validate(variant({"metadata.name": DELETE})), "metadata.name")
    assert "DNS label" in only(validate(variant({"metadata.name": "Qwen_VL"})), "metadata.name")[0].message


def test_everything_the_crd_rejects_is_rejected(variant) -> None:
    """Same cases as the apply-time test: validate() reports at least the apiserver's fields."""
    from tests.api.test_api_apply_time import BAD

    for case, (changes, field, _words) in BAD.items():
        res = variant(changes)
        crd_fields = {p.field for p in apiserver_problems(res)}
        ours = {p.field for p in validate(res)}
        assert field in ours, (case, validate(res))
        assert crd_fields <= ours | {"<root>"}, case


def test_divisibility_names_nearest_values_from_the_catalog(variant) -> None:
    problems = only(validate(variant({"spec.eplb.numRedundantExperts": 7})), "spec.eplb.numRedundantExperts")
    assert len(problems) == 1
    msg = problems[0].message
    assert "128" in msg and "135" in msg and "EP size 4" in msg and "use numRedundantExperts 4 or 8" in msg


def test_divisibility_with_override_reports_once_with_nearest_values(variant) -> None:
    res = variant({"spec.model.moe": {"numExperts": 60}, "spec.model.architecture": "Qwen3MoeForCausalLM",
                   "spec.model.name": "acme/custom-moe", "spec.eplb.numRedundantExperts": 1})
    problems = only(validate(res), "spec.eplb.numRedundantExperts")
    assert len(problems) == 1 and "use numRedundantExperts 0 or 4" in problems[0].message


def test_nearest_redundant_values() -> None:
    assert nearest_redundant_values(128, 7, 4) == [4, 8]
    assert nearest_redundant_values(256, 1, 16) == [0, 16]
    assert nearest_redundant_values(60, 0, 7) == [3]  # (60 + 3) = 63; nothing below 0
    assert nearest_redundant_values(1, 1022, 1000) == [999]  # above would exceed 1023
    for e, r, ep in [(128, 7, 4), (256, 5, 12), (160, 3, 6)]:
        for v in nearest_redundant_values(e, r, ep):
            assert (e + v) % ep == 0


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        # architecture needs a newer engine: Qwen3-VL-MoE has EPLB from vLLM 0.12.0
        ({"spec.engine.version": "0.11.2"}, "spec.eplb.enabled", "needs vLLM >= 0.12.0, the image has 0.11.2"),
        # the seed's quantization (compressed-tensors WNA16) also needs 0.12.0
        ({"spec.engine.image": "vllm/vllm-openai:v0.11.0"}, "spec.model.quantization", ">= 0.12.0"),
        # AutoAWQ format has no EPLB at all: hint at compressed-tensors
        ({"spec.model.quantization": "awq"}, "spec.model.quantization", "compressed-tensors-wna16"),
        ({"spec.model.quantization": "gguf"}, "spec.model.quantization", "does not support EPLB"),
        # unknown model and architecture, EPLB on, no moe override
        ({"spec.model.name": "acme/secret-moe", "spec.model.architecture": DELETE}, "spec.model.moe", "not in the catalog"),
        ({"spec.model.name": "acme/secret-moe", "spec.model.architecture": "AcmeMoeForCausalLM"},
         "spec.model.moe", "architecture 'AcmeMoeForCausalLM' is not in the catalog"),
        # version cannot be told from the tag
        ({"spec.engine.image": "vllm/vllm-openai:latest"}, "spec.engine.version", "set spec.engine.version"),
        ({"spec.engine.image": "vllm/vllm-openai"}, "spec.engine.version", "set spec.engine.version"),
        # EPLB itself is older than 0.9.0
        ({"spec.engine.version": "0.8.5", "spec.model.quantization": "none", "spec.model.name": "deepseek-ai/DeepSeek-V3",
          "spec.model.architecture": DELETE, "spec.engine.limitMmPerPrompt": DELETE, "spec.engine.mmEncoderTpMode": DELETE},
         "spec.eplb.enabled", "EPLB needs vLLM >= 0.9.0"),
        # async needs --eplb-config
        ({"spec.engine.version": "0.10.1", "spec.eplb.async": True, "spec.model.quantization": "none",
          "spec.model.name": "deepseek-ai/DeepSeek-V2-Lite", "spec.model.architecture": DELETE,
          "spec.engine.limitMmPerPrompt": DELETE, "spec.engine.mmEncoderTpMode": DELETE},
         "spec.eplb.async", "needs --eplb-config"),
        # 4-bit name without quantization
        ({"spec.model.quantization": DELETE}, "spec.model.quantization", "suggests a 4-bit checkpoint"),
        # multimodal options on a text model
        ({"spec.model.name": "Qwen/Qwen3-30B-A3B", "spec.model.architecture": DELETE, "spec.model.quantization": DELETE},
         "spec.engine.limitMmPerPrompt", "not multimodal"),
        # extra args that the operator generates
        ({"spec.engine.extraArgs": ["--trust-remote-code", "--num-redundant-experts=16"]}, "spec.engine.extraArgs[1]",
         "spec.eplb.numRedundantExperts"),
        ({"spec.engine.extraArgs": ["--eplb-config.window_size", "5"]}, "spec.engine.extraArgs[0]", "spec.eplb"),
        ({"spec.engine.extraArgs": ["--tensor-parallel-size", "8"]}, "spec.engine.extraArgs[0]", "spec.parallelism.tensor"),
        # WNA16 + EPLB needs the Triton MoE backend in current vLLM
        ({"spec.engine.extraArgs": ["--moe-backend", "marlin"]}, "spec.engine.extraArgs", "only on the triton backend"),
        # memory budget for redundant experts (Recommend mode): 8 x 48 x ~5 MB / 4 > 64Mi
        ({"spec.autotune.mode": "Recommend", "spec.autotune.memoryBudgetPerGpu": "64Mi"},
         "spec.eplb.numRedundantExperts", "more than spec.autotune.memoryBudgetPerGpu"),
        # quantities that pass the CRD's loose pattern but do not parse
        ({"spec.engine.shmSize": "1.2.3"}, "spec.engine.shmSize", "not a Kubernetes quantity"),
        ({"spec.autotune.memoryBudgetPerGpu": "8..5Gi"}, "spec.autotune.memoryBudgetPerGpu", "not a Kubernetes quantity"),
        # tuner bounds with no divisible value
        ({"spec.autotune.bounds": {"numRedundantExperts": {"min": 5, "max": 7}}, "spec.eplb.numRedundantExperts": 8},
         "spec.autotune.bounds.numRedundantExperts", "no value in [5, 7]"),
    ],
)
def test_catalog_and_version_checks(variant, changes, field, words) -> None:
    problems = validate(variant(changes))
    matching = only(problems, field)
    assert matching, f"expected a problem at {field}, got {problems}"
    assert any(words in p.message for p in matching), matching


def test_mixtral_eplb_depends_on_engine_version(variant) -> None:
    base = {"spec.model.name": "mistralai/Mixtral-8x7B-Instruct-v0.1", "spec.model.architecture": DELETE,
            "spec.model.quantization": DELETE, "spec.engine.limitMmPerPrompt": DELETE,
            "spec.engine.mmEncoderTpMode": DELETE, "spec.eplb.numRedundantExperts": 0}
    old = only(validate(variant({**base, "spec.engine.version": "0.10.2"})), "spec.eplb.enabled")
    assert old and "MixtralForCausalLM" in old[0].message
    assert validate(variant({**base, "spec.engine.version": "0.12.0"})) == []


def test_unknown_model_with_moe_override_is_accepted(variant) -> None:
    res = variant({"spec.model.name": "/models/my-moe", "spec.model.architecture": "MyMoeForCausalLM",
                   "spec.model.quantization": "none", "spec.engine.limitMmPerPrompt": DELETE,
                   "spec.engine.mmEncoderTpMode": DELETE,
                   "spec.model.moe": {"numExperts": 64, "numMoeLayers": 24, "topK": 4}})
    assert validate(res) == []


def test_eplb_off_needs_no_version_or_catalog(variant) -> None:
    res = variant({"spec.eplb.enabled": False, "spec.engine.image": "vllm/vllm-openai:latest",
                   "spec.model.name": "acme/unknown", "spec.model.architecture": DELETE, "spec.model.quantization": DELETE})
    assert validate(res) == []


def test_problems_always_name_a_field_and_a_fix(variant) -> None:
    res = variant({"spec.eplb.numRedundantExperts": 7, "spec.engine.version": "0.11.0", "spec.eplb.windowSiz": 5})
    problems = validate(res)
    assert len(problems) >= 3
    for p in problems:
        assert p.field and p.field[0].isalpha()
        assert len(p.message) > 20


def test_invalid_tuner_override_falls_back_to_the_spec(seed) -> None:
    import copy

    from moe_eplb.api.validation import override_problems

    res = copy.deepcopy(seed)
    res["metadata"]["generation"] = 2
    # (experts + 6) is not divisible by the EP size: the override never runs, the spec stays valid
    res["status"] = {"autotune": {"override": {"numRedundantExperts": 6, "specGeneration": 2}}}
    assert validate(res) == []
    assert _effective(res).num_redundant_experts == 8 and _effective(res).source == "spec"
    notes = override_problems(parse(res))
    assert [p.field for p in notes] == ["status.autotune.override"]
    assert "not divisible by the EP size" in notes[0].message
    res["status"]["autotune"]["override"] = {"numRedundantExperts": 12, "windowSize": 500, "specGeneration": 2}
    assert validate(res) == [] and override_problems(parse(res)) == []
    assert _effective(res).num_redundant_experts == 12


def test_status_written_by_the_operator_never_invalidates_the_spec(seed) -> None:
    import copy

    res = copy.deepcopy(seed)
    res["metadata"].update({"uid": "u", "generation": 4, "resourceVersion": "77", "managedFields": [{"x": 1}]})
    res["status"] = {"phase": "Running", "somethingNew": {"a": 1}, "conditions": [{"type": "Ready", "status": "True"}],
                     "autotune": {"history": [{"t": 1}], "override": {"numRedundantExperts": 8, "specGeneration": 3}}}
    assert validate(res) == []


def test_distinct_problems_on_one_field_are_all_kept(variant) -> None:
    """EP size 1 and a too-old engine both concern spec.eplb.enabled: both are reported."""
    problems = only(validate(variant({"spec.parallelism.tensor": 1, "spec.engine.version": "0.11.0"})),
                    "spec.eplb.enabled")
    messages = " | ".join(p.message for p in problems)
    assert "expert-parallel size > 1" in messages and "needs vLLM >= 0.12.0" in messages
    assert len(problems) == 2  # the CRD's generated copy of the version rule is folded into the richer one


def test_mapping_views_are_validated_like_dicts(seed) -> None:
    """kopf hands handlers mapping views, not dicts: nested checks must still run."""
    bad = copy.deepcopy(seed)
    bad["spec"]["eplb"]["windowSiz"] = 3
    assert [p.field for p in validate(frozen(bad))] == ["spec.eplb.windowSiz"]
    assert validate(frozen(seed)) == []


def _effective(resource):
    """The EPLB settings that run for ``resource`` (parsed once)."""
    return parse(resource).effective


@pytest.mark.parametrize("changes,field,words", [
    ({"spec.engine.image": "vllm/vllm-openai:v0.11.2"}, "spec.engine.exporter.inject", ["0.12.0 - 0.34.x", "0.11.2",
                                                                                         "inject: false"]),
    ({"spec.engine.image": "vllm/vllm-openai:v0.32.0", "spec.engine.exporter": {"inject": False}},
     "spec.engine.exporter.inject", ["not the plugin image", "ghcr.io/moe-eplb/vllm"]),
    ({"spec.engine.image": "vllm/vllm-openai:v0.35.0"}, "spec.engine.exporter.inject", ["0.12.0 - 0.34.x", "0.35.0"]),
    ({"spec.engine.image": "vllm/vllm-openai:v0.11.2", "spec.engine.exporter": {"inject": False},
      "spec.autotune": {"mode": "Recommend"}}, "spec.autotune.mode", ["needs the per-expert load exporter"]),
    ({"spec.monitoring.podMonitor": {"enabled": True, "labels": {"bad key!": "x"}}},
     "spec.monitoring.podMonitor.labels['bad key!']", ["label key"]),
])
def test_exporter_and_label_problems(variant, changes, field, words) -> None:
    problems = [p for p in validate(variant(changes)) if p.field == field]
    assert problems, validate(variant(changes))
    assert all(w in problems[0].message for w in words), problems[0].message


@pytest.mark.parametrize("changes", [
    {"spec.engine.image": "ghcr.io/moe-eplb/vllm:v0.32.0", "spec.engine.exporter": {"inject": False}},
    {"spec.engine.image": "vllm/vllm-openai:v0.11.2", "spec.engine.exporter": {"inject": False}},  # EPLB, no metrics
    {"spec.engine.image": "vllm/vllm-openai:v0.32.0"},  # stock image, injected
    {"spec.engine.image": "vllm/vllm-openai:v0.33.0"},  # the newest supported release
    {"spec.engine.image": "ghcr.io/moe-eplb/vllm:v0.33.0", "spec.engine.exporter": {"inject": False}},
])
def test_exporter_setups_that_work(variant, changes) -> None:
    assert [p for p in validate(variant(changes)) if p.field.startswith(("spec.engine.exporter", "spec.autotune"))] == []
