"""vLLM 0.34 on the API side: the supported range, redundancy that is always explicit, fault
tolerance's redundancy floor (validate, the CRD's CEL and the tuner agree), the all2all backend
and the EPLB communicator per version, and DeepEP low latency's buffer limit."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from moe_eplb.api import wide_ep
from moe_eplb.api.knobs import Bounds
from moe_eplb.api.spec import parse, status_eplb
from moe_eplb.api.validation import apiserver_problems, validate
from moe_eplb.render.engine_args import engine_args, multinode_leader_args, multinode_worker_script
from moe_eplb.render.objects import render_children
from tests.example_manifests import set_path


def fields(problems) -> set[str]:
    return {p.field for p in problems}


def messages(problems, field: str) -> str:
    return " | ".join(p.message for p in problems if p.field == field)


def eplb_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--eplb-config") + 1])


def qwen3(version: str, **changes) -> dict:
    """Qwen3-30B-A3B (128 experts) at EP 6 (tensor 1 x data 6), EPLB on, no redundancy given."""
    res = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "q3"},
           "spec": {"model": {"name": "Qwen/Qwen3-30B-A3B"},
                    "engine": {"image": f"vllm/vllm-openai:v{version}"},
                    "parallelism": {"tensor": 1, "data": 6}, "eplb": {"enabled": True}}}
    for dotted, value in changes.items():
        set_path(res, dotted, value)
    return res


def deepseek(redundant: int | None, **changes) -> dict:
    """DeepSeek-V3 at EP 16 (16 pods of one GPU: one data-parallel rank each), DeepEP low latency,
    fault tolerance for one lost rank, on vLLM 0.34."""
    res = qwen3("0.34.0", **{"spec.model.name": "deepseek-ai/DeepSeek-V3",
                             "spec.parallelism": {"tensor": 1, "data": 16, "nodes": 16,
                                                  "all2allBackend": "deepep_low_latency"},
                             "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}})
    if redundant is not None:
        res["spec"]["eplb"]["numRedundantExperts"] = redundant
    for dotted, value in changes.items():
        set_path(res, dotted, value)
    return res


# --- the supported range ---------------------------------------------------------------------------

def test_seed_on_034_validates_and_renders(variant) -> None:
    res = variant({"spec.engine.image": "vllm/vllm-openai:v0.34.0"})
    assert validate(res) == []
    inf = parse(res)
    args = engine_args(inf, inf.effective)
    assert eplb_config(args)["num_redundant_experts"] == 8
    assert "Deployment" in [c["kind"] for c in render_children(inf)]


def test_035_is_refused_with_the_supported_range(variant) -> None:
    problems = validate(variant({"spec.engine.image": "vllm/vllm-openai:v0.35.0"}))
    assert "0.12.0 - 0.34.x" in messages(problems, "spec.engine.exporter.inject")
    assert "0.35.0" in messages(problems, "spec.engine.exporter.inject")


# --- redundancy is always explicit -----------------------------------------------------------------

def test_omitted_redundancy_renders_the_minimum_valid_value_on_034() -> None:
    res = qwen3("0.34.0")
    assert validate(res) == [] and apiserver_problems(res) == []
    inf = parse(res)
    assert inf.redundancy_omitted and inf.redundancy_in_force == 4  # (6 - 128 % 6) % 6
    assert eplb_config(engine_args(inf, inf.effective))["num_redundant_experts"] == 4
    assert status_eplb(inf.effective)["numRedundantExperts"] == 4  # what status and kubectl get moe show


def test_omitted_redundancy_is_refused_on_033_with_the_fix() -> None:
    res = qwen3("0.33.0")
    ours = validate(res)
    assert fields(ours) == {"spec.eplb.numRedundantExperts"}, ours
    assert "set numRedundantExperts 4" in messages(ours, "spec.eplb.numRedundantExperts")
    crd = apiserver_problems(res)  # the apiserver refuses it too (CEL, by the image tag)
    assert "set numRedundantExperts 4" in messages(crd, "spec.eplb.numRedundantExperts")


def test_omitted_redundancy_where_the_experts_divide_runs_0_on_every_version() -> None:
    for version in ("0.32.0", "0.33.0", "0.34.0"):
        res = qwen3(version, **{"spec.parallelism": {"tensor": 1, "data": 8}})
        assert validate(res) == [], version
        inf = parse(res)
        assert eplb_config(engine_args(inf, inf.effective))["num_redundant_experts"] == 0


def test_an_explicit_value_is_rendered_as_written_and_the_override_compares_with_it() -> None:
    res = qwen3("0.34.0", **{"spec.eplb.numRedundantExperts": 10})
    assert eplb_config(engine_args(parse(res), parse(res).effective))["num_redundant_experts"] == 10
    assert parse(res).spec_knobs.num_redundant_experts == 10


def test_omitted_redundancy_must_lie_within_the_autotune_bounds() -> None:
    res = qwen3("0.34.0", **{"spec.autotune": {"bounds": {"numRedundantExperts": {"min": 10, "max": 20}}}})
    assert "redundancy in force, 4" in messages(validate(res), "spec.autotune.bounds.numRedundantExperts")


# --- fault tolerance: the redundancy floor ---------------------------------------------------------

def _scale_down_succeeds(placement: list[int], num_logical: int, slots_per_rank: int, dead: set[int]) -> bool:
    """vLLM 0.34's ``redistribute_expert_placement`` on one layer, as a count: the dead ranks' slots
    are gone; each missing expert takes a slot of an expert that still has more than one replica."""
    alive = [e for i, e in enumerate(placement) if i // slots_per_rank not in dead]
    counts = {e: alive.count(e) for e in set(alive)}
    missing = num_logical - len(counts)
    spare = sum(c - 1 for c in counts.values())
    return spare >= missing


@pytest.mark.parametrize(("logical", "data", "lost"), [(8, 4, 1), (6, 3, 1), (8, 4, 2), (12, 6, 1), (10, 5, 2)])
def test_floor_is_exactly_what_scale_down_survives_for_every_placement(logical, data, lost) -> None:
    """The derived bound ``R >= k (L + R) / DP`` against vLLM's algorithm: every R at or above the
    floor survives every placement and every choice of lost ranks; the next valid R below does
    not for some placement."""
    rng = random.Random(0)
    floor = wide_ep.fault_tolerance_floor(logical, 1, data, lost)
    assert floor is not None
    for r in range(wide_ep.smallest_valid_redundancy(logical, data), floor + 2 * data + 1, data):
        slots = (logical + r) // data
        worst_ok = True
        for _ in range(300):
            extra = [rng.randrange(logical) for _ in range(r)]
            placement = list(range(logical)) + extra
            rng.shuffle(placement)
            for dead in itertools.combinations(range(data), lost):
                worst_ok &= _scale_down_succeeds(placement, logical, slots, set(dead))
        # a placement that loses every replica of one expert: all of expert 0's copies on dead ranks
        adversarial = ([0] * min(r + 1, slots * lost) + list(range(1, logical)) + [1] * r)[: logical + r]
        worst_ok &= _scale_down_succeeds(adversarial, logical, slots, set(range(lost)))
        assert worst_ok == (r >= floor) == wide_ep.survives(logical, r, data, lost), (r, floor)


def test_deepseek_ep16_one_lost_rank_needs_32() -> None:
    assert wide_ep.fault_tolerance_floor(256, 1, 16, 1) == 32  # R >= 256/15 -> 18, divisible by 16 -> 32
    assert wide_ep.fault_tolerance_floor(256, 1, 32, 1) == 32  # R >= 9 -> 32 (the minimum valid value is 0)
    assert wide_ep.fault_tolerance_floor(256, 1, 8, 1) == 40  # R >= 37 -> 40
    assert wide_ep.fault_tolerance_floor(256, 1, 4, 4) is None  # no survivor


def test_deepseek_redundancy_32_is_accepted_and_renders_fault_tolerance() -> None:
    res = deepseek(32)
    assert validate(res) == [] and apiserver_problems(res) == []
    inf = parse(res)
    args = engine_args(inf, inf.effective)
    assert "--enable-fault-tolerance" in args
    assert args[args.index("--all2all-backend") + 1] == "deepep_low_latency"
    assert eplb_config(args)["num_redundant_experts"] == 32
    # one rank per pod: each pod is its own external-LB rank (vLLM refuses FT with internal LB)
    assert multinode_leader_args(inf)[-2:] == ["--data-parallel-rank", "0"]
    assert "--data-parallel-rank" in multinode_worker_script(inf) and "--headless" not in multinode_worker_script(inf)


def test_deepseek_redundancy_16_is_refused_naming_the_floor() -> None:
    res = deepseek(16)
    ours = messages(validate(res), "spec.eplb.numRedundantExperts")
    assert "below the fault-tolerance floor 32" in ours and "at least 32" in ours, ours
    crd = messages(apiserver_problems(res), "spec.eplb.numRedundantExperts")
    assert "floor 32" in crd and "at least 32" in crd, crd


def test_omitted_redundancy_with_fault_tolerance_renders_the_floor() -> None:
    inf = parse(deepseek(None))
    assert validate(deepseek(None)) == []
    assert inf.redundancy_in_force == 32
    assert eplb_config(engine_args(inf, inf.effective))["num_redundant_experts"] == 32


def test_the_tuner_never_proposes_below_the_floor() -> None:
    from moe_eplb.controller.autotune import run_tuner
    from moe_eplb.eplb.tuning.options import TuneOptions

    res = deepseek(32, **{"spec.autotune": {"mode": "Recommend",
                                            "bounds": {"numRedundantExperts": {"min": 0, "max": 64}}}})
    inf = parse(res)
    assert validate(res) == []
    assert inf.tuner_bounds.redundant == (32, 64)
    rng = np.random.default_rng(3)
    weights = rng.zipf(1.6, size=(2, 256)).astype(float)  # a skewed load: redundancy pays
    load = np.stack([weights * rng.uniform(0.5, 1.5, size=weights.shape) * 50 for _ in range(24)])
    trace = load.astype(float)
    from moe_eplb.eplb.workload.trace import LoadTrace

    result = run_tuner(LoadTrace(load=trace, bucket_steps=np.full(24, 500)), inf, inf.effective.knobs,
                       TuneOptions(windows=(1000,), intervals=(3000,), max_redundancy_levels=3))
    assert result.candidates and all(c.knobs.num_redundant_experts >= 32 for c in result.candidates)
    assert result.recommendation.num_redundant_experts >= 32


def test_an_override_below_the_floor_does_not_run() -> None:
    res = deepseek(32)
    res["status"] = {"autotune": {"override": {"numRedundantExperts": 16, "specEplb": {
        "windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 32}}}}
    inf = parse(res)
    assert inf.effective.num_redundant_experts == 32 and "fault-tolerance floor" in (inf.override_problem or "")


def test_bounds_with_a_floor() -> None:
    assert Bounds().with_redundancy_floor(32).redundant == (32, None)
    assert Bounds(redundant=(40, 64)).with_redundancy_floor(32).redundant == (40, 64)
    assert Bounds(redundant=(0, 16)).with_redundancy_floor(32).redundant == (32, 32)


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"spec.parallelism.all2allBackend": "allgather_reducescatter"}, "spec.parallelism.all2allBackend",
     "deepep_low_latency or nixl_ep"),
    ({"spec.faultTolerance.rankFailuresToSurvive": 16}, "spec.faultTolerance.rankFailuresToSurvive",
     "below spec.parallelism.data"),
    ({"spec.engine.image": "vllm/vllm-openai:v0.33.0", "spec.eplb.numRedundantExperts": 32},
     "spec.faultTolerance.rankFailuresToSurvive", "needs vLLM >= 0.34.0"),
    ({"spec.engine.image": "vllm/vllm-openai:v0.31.0", "spec.faultTolerance.rankFailuresToSurvive": 0,
      "spec.eplb.numRedundantExperts": 0, "spec.engine.exporter": {"inject": False}},
     "spec.faultTolerance.enabled", "needs vLLM >= 0.32.0"),
])
def test_fault_tolerance_refusals_are_made_by_validate_and_the_crd(changes, field, words) -> None:
    res = deepseek(32, **changes)
    assert words in messages(validate(res), field), validate(res)
    assert words in messages(apiserver_problems(res), field), apiserver_problems(res)


def test_fault_tolerance_refusals_only_validate_makes() -> None:
    draft = deepseek(32, **{"spec.engine.extraArgs": ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']})
    assert "MoE draft" in messages(validate(draft), "spec.engine.extraArgs[0]")
    servers = deepseek(32, **{"spec.engine.extraArgs": ["--api-server-count", "4"]})
    assert "one API server" in messages(validate(servers), "spec.engine.extraArgs[0]")
    per_pod = deepseek(32, **{"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2,
                                                   "all2allBackend": "deepep_low_latency"}})
    # the layouts that survive one lost rank, with the floor each needs: one rank a pod needs only 32
    said = messages(validate(per_pod), "spec.faultTolerance.rankFailuresToSurvive")
    assert "8: R 256" in said and "1: R 32" in said and "use dataLocal 1 (nodes 16)" in said, said
    one_pod = qwen3("0.34.0", **{"spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "nixl_ep"},
                                 "spec.eplb.numRedundantExperts": 44,
                                 "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}})
    # every rank in one pod: spread them over pods, one a pod (retry is all the one pod could do)
    said = messages(validate(one_pod), "spec.faultTolerance.rankFailuresToSurvive")
    assert "1: R 44" in said and "use dataLocal 1 (nodes 4)" in said, said
    for res in (draft, servers, per_pod, one_pod):
        assert apiserver_problems(res) == []


def test_fault_tolerance_with_ranks_per_pod_runs_the_multi_port_supervisor() -> None:
    res = deepseek(None, **{"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2,
                                                 "all2allBackend": "nixl_ep"},
                            "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 8}})
    assert validate(res) == []
    inf = parse(res)
    assert inf.redundancy_in_force == wide_ep.fault_tolerance_floor(256, 1, 16, 8) == 256
    assert multinode_leader_args(inf)[-5:] == ["--data-parallel-start-rank", "0", "--data-parallel-multi-port-external-lb",
                                               "--data-parallel-supervisor-port", "9256"]
    single = parse(qwen3("0.34.0", **{"spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "nixl_ep"},
                                       "spec.faultTolerance": {"enabled": True}}))
    args = engine_args(single, single.effective)
    assert args[args.index("--data-parallel-size-local") + 1] == "4"
    assert "--data-parallel-multi-port-external-lb" in args and "--enable-fault-tolerance" in args


# --- all2all backend, communicator, DeepEP low latency ---------------------------------------------

@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"spec.parallelism.all2allBackend": "mori", "spec.engine.image": "vllm/vllm-openai-rocm:v0.33.0",
      "spec.engine.gpuResourceName": "amd.com/gpu", "spec.eplb.numRedundantExperts": 4},
     "spec.parallelism.all2allBackend", "mori needs vLLM >= 0.34.0"),
    ({"spec.parallelism.all2allBackend": "mori"}, "spec.parallelism.all2allBackend", "on AMD GPUs only"),
    ({"spec.parallelism.all2allBackend": "deepep_low_latency", "spec.engine.gpuResourceName": "amd.com/gpu",
      "spec.engine.image": "vllm/vllm-openai-rocm:v0.34.0"}, "spec.parallelism.all2allBackend",
     "on NVIDIA GPUs only"),
    ({"spec.parallelism.all2allBackend": "moonep"}, "spec.parallelism.all2allBackend", "moonep does not support EPLB"),
    ({"spec.parallelism.all2allBackend": "pplx"}, "spec.parallelism.all2allBackend", "were removed"),
    ({"spec.eplb.communicator": "symm_mem", "spec.parallelism": {"tensor": 1, "data": 6, "nodes": 2}},
     "spec.eplb.communicator", "one NVLink domain"),
    ({"spec.eplb.communicator": "symm_mem", "spec.engine.image": "vllm/vllm-openai:v0.33.0",
      "spec.eplb.numRedundantExperts": 4}, "spec.eplb.communicator", "symm_mem needs vLLM >= 0.34.0"),
])
def test_backend_and_communicator_refusals_by_both(changes, field, words) -> None:
    res = qwen3("0.34.0", **changes)
    assert words in messages(validate(res), field), validate(res)
    assert words in messages(apiserver_problems(res), field), apiserver_problems(res)


def test_backend_and_communicator_render_as_the_version_expects() -> None:
    amd = {"spec.engine.gpuResourceName": "amd.com/gpu"}
    res = qwen3("0.34.0", **{"spec.parallelism.all2allBackend": "mori", **amd,
                             "spec.engine.image": "vllm/vllm-openai-rocm:v0.34.0"})
    assert validate(res) == []
    args = engine_args(parse(res), parse(res).effective)
    assert args[args.index("--all2all-backend") + 1] == "mori"
    res = qwen3("0.34.0", **{"spec.eplb.communicator": "symm_mem"})
    assert validate(res) == []
    assert eplb_config(engine_args(parse(res), parse(res).effective))["communicator"] == "symm_mem"
    old = qwen3("0.33.0", **{"spec.parallelism.all2allBackend": "mori_low_latency", "spec.eplb.numRedundantExperts": 4,
                             **amd, "spec.engine.image": "vllm/vllm-openai-rocm:v0.33.0"})
    assert validate(old) == []  # the per-mode names are still accepted (deprecated from 0.34)


def test_nccl_communicators_refuse_async_eplb() -> None:
    res = qwen3("0.34.0", **{"spec.eplb.communicator": "torch_nccl"})
    assert "async" in messages(validate(res), "spec.eplb.communicator")
    assert validate(qwen3("0.34.0", **{"spec.eplb.communicator": "torch_nccl", "spec.eplb.async": False})) == []


def test_all2all_backend_in_extra_args_is_checked_and_cannot_repeat_the_field() -> None:
    moonep = qwen3("0.34.0", **{"spec.engine.extraArgs": ["--all2all-backend", "moonep"]})
    assert "moonep does not support EPLB" in messages(validate(moonep), "spec.engine.extraArgs[0]")
    both = qwen3("0.34.0", **{"spec.parallelism.all2allBackend": "nixl_ep",
                              "spec.engine.extraArgs": ["--all2all-backend=nixl_ep"]})
    assert "generated by the operator" in messages(validate(both), "spec.engine.extraArgs[0]")


def test_deepep_low_latency_buffer_formula() -> None:
    # DeepSeek-V3: hidden 7168 (56 scales); 256 tokens per rank (vLLM's default), 288 physical experts:
    # dispatch 16 + 2*7168 = 14352 B, combine 4*56 + 2*7168 = 14560 B per token and expert
    expected = 2 * (288 * 256 * 14560 + 288 * 256 * 14560 + 3456)
    assert wide_ep.deepep_ll_buffer_bytes(256, 7168, 288) == expected
    assert wide_ep.deepep_ll_buffer_bytes(2048, 7168, 288) <= wide_ep.DEEPEP_LL_BUFFER_LIMIT
    assert wide_ep.deepep_ll_buffer_bytes(2048, 7168, 304) > wide_ep.DEEPEP_LL_BUFFER_LIMIT
    assert wide_ep.largest_deepep_ll_redundancy(256, 16, 2048, 7168) == 32


def test_deepep_low_latency_redundancy_over_32_gib_is_refused_with_the_largest_that_fits() -> None:
    res = deepseek(48, **{"spec.engine.extraArgs": ["--max-num-batched-tokens", "2048"]})
    msg = messages(validate(res), "spec.eplb.numRedundantExperts")
    assert "32 GiB" in msg and "use numRedundantExperts 32 or less" in msg, msg
    assert validate(deepseek(32, **{"spec.engine.extraArgs": ["--max-num-batched-tokens", "2048"]})) == []
    assert validate(deepseek(48)) == []  # 256 tokens per rank (the default): 4.7 GiB
