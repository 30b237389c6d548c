"""Parsing, defaults, image references and the effective EPLB settings (override precedence)."""

from __future__ import annotations

import pytest

from moe_eplb.api.crd import default_engine_image
from moe_eplb.api.imageref import parse_image
from moe_eplb.api.spec import apply_defaults, parse, status_eplb
from moe_eplb.api.versions import parse_version, uses_eplb_config_json
from tests.example_manifests import DELETE


def test_apply_defaults_fills_nested_defaults_like_the_apiserver() -> None:
    res = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "m"},
           "spec": {"model": {"name": "Qwen/Qwen3-30B-A3B"}}}
    out = apply_defaults(res)
    assert "engine" not in res["spec"]  # input untouched
    spec = out["spec"]
    assert spec["engine"]["image"] == default_engine_image()
    assert spec["engine"]["startupTimeoutSeconds"] == 3600
    assert spec["parallelism"] == {"tensor": 1, "data": 1, "nodes": 1, "expert": True}
    # numRedundantExperts has no default: absent means "the minimum valid value for the version"
    assert spec["eplb"] == {"enabled": False, "windowSize": 1000, "stepInterval": 3000, "logBalancedness": False}
    assert spec["autotune"]["mode"] == "Off" and spec["autotune"]["cooldownSeconds"] == 3600
    assert spec["rollout"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["monitoring"] == {"podMonitor": {"enabled": False}}
    assert spec["replicas"] == 1


def test_apply_defaults_keeps_given_values(seed) -> None:
    out = apply_defaults(seed)
    assert out["spec"]["eplb"]["windowSize"] == 3000 and out["spec"]["parallelism"]["tensor"] == 4


def test_parse_seed(seed) -> None:
    inf = parse(seed)
    assert inf.name == "qwen3-vl-30b" and inf.namespace == "default"
    assert inf.parallelism.ep_size == 4 and inf.parallelism.gpus_per_pod == 4 and inf.parallelism.data_local == 1
    assert inf.engine.version == (0, 32, 0)
    assert inf.architecture == "Qwen3VLMoeForConditionalGeneration"
    assert inf.quantization == "compressed-tensors-wna16"
    shape = inf.moe_shape
    assert (shape.num_experts, shape.num_moe_layers, shape.top_k) == (128, 48, 8)
    assert shape.bytes_per_expert == round(3 * 2048 * 768 * (0.5 + 2 / 128))
    assert inf.eplb.enabled and (inf.eplb.window_size, inf.eplb.step_interval, inf.eplb.num_redundant_experts) == (
        3000, 1000, 8)
    assert inf.engine.limit_mm_per_prompt == {"image": 4, "video": 0}
    assert inf.autotune.mode == "Off" and inf.autotune.evaluation_interval_s == 300
    exp = inf.autotune.experiments
    assert exp.enabled and (exp.min_s, exp.max_s, exp.confidence) == (900.0, 3600.0, 0.9)


def test_parse_experiments(variant) -> None:
    inf = parse(variant({"spec.autotune.experiments": {"enabled": False, "minSeconds": 120, "maxSeconds": 600,
                                                       "confidence": 0.95}}))
    exp = inf.autotune.experiments
    assert not exp.enabled and (exp.min_s, exp.max_s, exp.confidence) == (120.0, 600.0, 0.95)


def test_parse_moe_override_wins_over_catalog(variant) -> None:
    inf = parse(variant({"spec.model.moe": {"numExperts": 64, "bytesPerExpert": 1000}}))
    assert inf.moe_shape.num_experts == 64 and inf.moe_shape.bytes_per_expert == 1000
    assert inf.moe_shape.num_moe_layers == 48  # rest from the catalog


def test_parse_multinode_and_quantities(variant) -> None:
    inf = parse(variant({"spec.parallelism": {"tensor": 2, "data": 8, "nodes": 4},
                         "spec.autotune.memoryBudgetPerGpu": "8Gi", "spec.engine.version": "v0.12.1"}))
    assert inf.parallelism.data_local == 2 and inf.parallelism.gpus_per_pod == 4 and inf.parallelism.ep_size == 16
    assert inf.autotune.memory_budget_bytes == 8 * 2**30
    assert inf.engine.version == (0, 12, 1)


def _with_override(seed, generation, override):
    res = dict(seed)
    res["metadata"] = {**seed["metadata"], "generation": generation}
    res["status"] = {"autotune": {"override": override}}
    return res


def test_effective_eplb_uses_override_for_current_generation(seed) -> None:
    res = _with_override(seed, 3, {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12, "specGeneration": 3})
    eff = _effective(res)
    assert (eff.window_size, eff.step_interval, eff.num_redundant_experts, eff.source) == (500, 200, 12, "autotune")
    assert status_eplb(eff) == {"enabled": True, "windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12}


def test_effective_eplb_spec_edit_wins_over_stale_override(seed) -> None:
    res = _with_override(seed, 4, {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12, "specGeneration": 3})
    eff = _effective(res)
    assert (eff.window_size, eff.step_interval, eff.num_redundant_experts, eff.source) == (3000, 1000, 8, "spec")


def test_effective_eplb_partial_override_and_no_generation(seed) -> None:
    eff = _effective(_with_override(seed, 2, {"numRedundantExperts": 4, "specGeneration": 2}))
    assert (eff.window_size, eff.step_interval, eff.num_redundant_experts) == (3000, 1000, 4)
    no_gen = _with_override(seed, 2, {"numRedundantExperts": 4, "specGeneration": 2})
    del no_gen["metadata"]["generation"]
    assert _effective(no_gen).num_redundant_experts == 8


SPEC_EPLB = {"windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8}  # the seed's spec.eplb


def test_override_with_spec_record_survives_non_eplb_edits(seed) -> None:
    """An override records spec.eplb; it runs across generations while spec.eplb is unchanged."""
    import copy

    res = _with_override(seed, 7, {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12,
                                   "specEplb": dict(SPEC_EPLB), "specGeneration": 3})
    res = copy.deepcopy(res)
    res["spec"]["replicas"] = 5  # a /scale by an HPA: generation moved on, spec.eplb did not
    eff = _effective(res)
    assert (eff.window_size, eff.step_interval, eff.num_redundant_experts, eff.source) == (500, 200, 12, "autotune")
    res["spec"].setdefault("autotune", {})["mode"] = "Recommend"  # an edit of autotune keeps it too
    assert _effective(res).source == "autotune"


@pytest.mark.parametrize("edit", [{"windowSize": 3001}, {"stepInterval": 999}, {"numRedundantExperts": 4},
                                  {"enabled": False}])
def test_spec_eplb_edit_drops_recorded_override(seed, edit) -> None:
    import copy

    res = copy.deepcopy(_with_override(seed, 3, {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12,
                                                  "specEplb": dict(SPEC_EPLB), "specGeneration": 3}))
    res["spec"]["eplb"] = {**res["spec"].get("eplb", {}), **edit}
    eff = _effective(res)
    assert eff.source == "spec"
    assert eff.window_size == edit.get("windowSize", 3000) and eff.num_redundant_experts == edit.get("numRedundantExperts", 8)


def test_recorded_override_invalid_for_current_spec_falls_back(seed) -> None:
    import copy

    res = copy.deepcopy(_with_override(seed, 3, {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12,
                                                  "specEplb": dict(SPEC_EPLB), "specGeneration": 3}))
    assert _effective(res).num_redundant_experts == 12
    res["status"]["autotune"]["override"]["numRedundantExperts"] = 6  # experts + 6 not divisible by EP
    assert _effective(res).source == "spec"
    res["status"]["autotune"]["override"]["numRedundantExperts"] = 2000  # above vLLM's limit
    assert _effective(res).source == "spec"
    res["status"]["autotune"]["override"].update(numRedundantExperts=12, windowSize=0)
    assert _effective(res).source == "spec"


def test_old_override_without_record_keeps_generation_rule(seed) -> None:
    old = {"windowSize": 500, "stepInterval": 200, "numRedundantExperts": 12, "specGeneration": 3}
    assert _effective(_with_override(seed, 3, dict(old))).source == "autotune"
    assert _effective(_with_override(seed, 4, dict(old))).source == "spec"


def test_config_hash_tracks_only_restart_settings(seed, variant) -> None:
    a = _effective(seed)
    assert a.config_hash() == _effective(variant({"spec.replicas": 5})).config_hash()
    assert a.config_hash() != _effective(variant({"spec.eplb.windowSize": 3001})).config_hash()
    assert len(a.config_hash()) == 16
    over = _with_override(seed, 1, {"windowSize": 3000, "stepInterval": 1000, "numRedundantExperts": 8,
                                    "specGeneration": 1})
    assert _effective(over).config_hash() == a.config_hash()  # same values, same pods


@pytest.mark.parametrize(
    ("ref", "registry", "repo", "tag", "version"),
    [
        ("vllm/vllm-openai:v0.12.0", None, "vllm/vllm-openai", "v0.12.0", (0, 12, 0)),
        ("ghcr.io/moe-eplb/vllm:v0.32.0", "ghcr.io", "moe-eplb/vllm", "v0.32.0", (0, 32, 0)),
        ("localhost:5000/vllm:0.11.1rc2-cu129", "localhost:5000", "vllm", "0.11.1rc2-cu129", (0, 11, 1)),
        ("nvcr.io/nim/vllm", "nvcr.io", "nim/vllm", None, None),
        ("vllm/vllm-openai:nightly", None, "vllm/vllm-openai", "nightly", None),
    ],
)
def test_parse_image(ref, registry, repo, tag, version) -> None:
    img = parse_image(ref)
    assert img is not None
    assert (img.registry, img.repository, img.tag, img.version) == (registry, repo, tag, version)


@pytest.mark.parametrize("ref", ["", "Vllm/Foo", "vllm openai", "vllm/vllm-openai:", "vllm/:tag", "a" * 600,
                                 "vllm@sha256:123"])
def test_parse_image_rejects(ref) -> None:
    assert parse_image(ref) is None


def test_image_with_digest() -> None:
    img = parse_image("vllm/vllm-openai:v0.12.0@sha256:" + "b" * 64)
    assert img.tag == "v0.12.0" and img.digest == "sha256:" + "b" * 64


def test_versions() -> None:
    assert parse_version("v0.10.2") == (0, 10, 2) and parse_version("x") is None and parse_version(None) is None
    assert not uses_eplb_config_json((0, 10, 1)) and uses_eplb_config_json((0, 10, 2))


def test_parse_storage(variant) -> None:
    inf = parse(variant({"spec.model.storage": {"pvc": {"claimName": "w"}, "hfTokenSecret": {"name": "hf"}}}))
    assert inf.model.pvc.mount_path == "/models" and inf.model.hf_token_secret.key == "token"
    assert parse(variant({"spec.model.storage": DELETE})).model.pvc is None


def _effective(resource):
    """The EPLB settings that run for ``resource`` (parsed once)."""
    return parse(resource).effective


def test_the_layout_follows_parallelism_fault_tolerance_and_the_api_server_count(seed) -> None:
    """``MoEInference.layout`` (moe_eplb.api.layout): who runs which ranks and serves which API."""
    import copy

    from moe_eplb.api.spec import parse

    res = copy.deepcopy(seed)
    res["spec"]["parallelism"] = {"tensor": 1, "data": 16, "nodes": 2}
    res["spec"]["eplb"]["numRedundantExperts"] = 0
    res["spec"]["engine"]["extraArgs"] = ["--api-server-count", "4"]
    lay = parse(res).layout
    leader, worker = lay.pods
    assert lay.lb == "internal" and not leader.headless and worker.headless
    assert [(a.port, a.ranks, a.processes) for a in leader.api_servers] == [(8000, tuple(range(16)), 4)]
    assert worker.ranks == tuple(range(8, 16)) and lay.served_ranks == tuple(range(16))
    res["spec"]["engine"]["extraArgs"] = []
    res["spec"]["faultTolerance"] = {"enabled": True}
    lay = parse(res).layout
    assert lay.lb == "external" and lay.supervised and lay.workers_serve_api
    assert [(a.name, a.port, a.ranks) for a in lay.pods[1].api_servers][:2] == [("http", 8000, (8,)), ("http-1", 8001, (9,))]
    assert lay.api_servers_per_pod == 8 and lay.hosted_ranks == tuple(range(16))
