"""Advice that deploys: every refusal of the admission tables (tests/api/test_api_apply_time.py,
tests/kube/test_admission.py, the pod-template overlay's) and of issue 37's findings, walked. A
refusal whose message suggests one edit carries it (``Problem.fix``); applied (a fix may uncover the
next refusal, which carries its own), the resource validates, renders, and its pods launch in vLLM's
own launch logic as the operator means them to (tests/launch_logic/expect.py) -- a deployable pod.

Refusals that ask for the user's intent carry no fix, and are listed in :data:`WITHOUT_FIX` with why;
the list is checked both ways (a refusal that gains a fix leaves it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from moe_eplb.api.problem import apply_fix
from moe_eplb.api.validation import validate
from moe_eplb.api.versions import format_version
from tests.api.test_api_apply_time import BAD
from tests.example_manifests import DELETE, EXAMPLES, load_moeinferences, set_path
from tests.kube.test_admission import DEEPSEEK_R1, OPERATOR_ONLY
from tests.launch_logic.expect import launch_group, problems
from tests.launch_logic.test_launch_logic import render

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

H100 = {"spec.engine.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
#: issue 37's findings as refusals (changes to the seed)
ISSUE = {
    # 4: a vLLM the exporter does not support: the advice (inject: false) gives the stock engine's pod
    "exporter-on-an-unsupported-vllm": ({"spec.engine.image": "vllm/vllm-openai:v0.35.0",
                                         "spec.engine.version": DELETE, "spec.autotune.mode": "Recommend"},
                                        "spec.engine.exporter.inject"),
    # 6: DeepSeek-R1 at EP 16 over 2 pods of 8 ranks surviving one lost rank on 80 GB GPUs
    "ft-one-lost-rank-on-h100": ({**DEEPSEEK_R1, **H100, "spec.faultTolerance": {"enabled": True,
                                                                                 "rankFailuresToSurvive": 1}},
                                 "spec.faultTolerance.rankFailuresToSurvive"),
    # 6: the same with GPU memory unknown: the layout with the smallest floor (one rank a pod, R 32)
    "ft-one-lost-rank-memory-unknown": ({**DEEPSEEK_R1, "spec.faultTolerance": {"enabled": True,
                                                                                "rankFailuresToSurvive": 1}},
                                        "spec.faultTolerance.rankFailuresToSurvive"),
}
CASES: dict[str, tuple[dict[str, Any], str]] = {
    **{case: (changes, field) for case, (changes, field, _) in BAD.items()}, **OPERATOR_ONLY, **ISSUE}

#: refusals without a one-edit fix, by why: the message names the allowed values or asks what the
#: user means, and the right answer is theirs
OUT_OF_RANGE = "a value outside the schema's type, range, enum or pattern: the message names what is allowed"
INTENT = "asks what the user means (which model, format, version or size); the message says what to set"
WITHOUT_FIX = {
    **dict.fromkeys([
        "all2all-backend-passthrough", "all2all-backend-unknown", "autotune-mode-typo", "bad-version",
        "bounds-missing-max", "drain-seconds-negative", "engine-toleration-operator-enum", "experiments-confidence-over-1",
        "experiments-too-short", "gpu-memory-not-a-quantity", "gpu-memory-utilization-0", "gpu-memory-utilization-over-1",
        "gpu-resource-name-without-domain", "image-with-space", "interval-0", "malformed-image",
        "memory-budget-not-a-quantity", "missing-model-name", "mm-encoder-mode", "name-too-long", "negative-mm-limit",
        "overlay-bad-label-key", "prometheus-url", "quantity-passes-pattern-only", "quantization-unknown",
        "redundant-negative", "redundant-over-1023", "replicas-negative", "window-0", "window-wrong-type",
        "workload-bad-label-key", "bounds-min-over-max", "experiments-min-over-max", "topk-over-experts",
        "groups-do-not-divide", "data-not-multiple-of-nodes"], OUT_OF_RANGE),
    **dict.fromkeys([
        "4bit-name-without-quantization", "arch-too-old-for-eplb", "eplb-with-ep-1", "quantization-without-eplb",
        "unknown-architecture-without-moe", "unknown-model-without-moe", "version-unknown",
        "overlay-pythonpath-while-injected"], INTENT),
}


@pytest.fixture()
def newest(launchers):
    """The newest release in range that is here (the launch logic is the same in 0.32-0.34)."""
    from tests.require import missing_vllm

    here = [launcher for launcher in launchers.values() if not isinstance(launcher, str)]
    if not here:
        missing_vllm("no vLLM release is here for the launch-logic tier")
    return here[-1]


def _seed() -> dict[str, Any]:
    return load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]


def _with(changes: dict[str, Any]) -> dict[str, Any]:
    res = copy.deepcopy(_seed())
    for dotted, value in changes.items():
        set_path(res, dotted, value)
    return res


def walk(res: dict[str, Any], rounds: int = 4) -> tuple[dict[str, Any], list]:
    """Apply the fixes of every refusal until the resource validates (or a refusal has none):
    (the resource, the refusals left)."""
    for _ in range(rounds):
        found = validate(res)
        if not found or any(p.fix is None for p in found):
            return res, found
        for p in found:
            res = apply_fix(res, p.fix)
    return res, validate(res)


@pytest.mark.parametrize("case", sorted(CASES))
def test_launch_logic_every_refusals_advice_deploys(newest, case):
    changes, field = CASES[case]
    res = _with(changes)
    found = validate(res)
    assert field in {p.field for p in found}, (case, [str(p) for p in found])
    fixed, left = walk(res)
    if case in WITHOUT_FIX:
        assert left and any(p.fix is None for p in left), f"{case} has a fix now: drop it from WITHOUT_FIX"
        return
    assert left == [], (case, [str(p) for p in left])
    children = render(fixed)
    out = launch_group(children, newest)
    assert problems(children, out) == [], (case, problems(children, out))


def test_launch_logic_the_fault_tolerance_advice_names_the_layouts_that_fit(newest):
    """Finding 6: DeepSeek-R1 at EP 16 surviving one lost rank on 80 GB GPUs: 8 ranks a pod needs
    R 256 (about 100 GiB a GPU); the refusal names the layouts that survive with their floors (one
    rank a pod: R 32) and moves to the one with the most ranks a pod that fits."""
    res = _with(CASES["ft-one-lost-rank-on-h100"][0])
    (refusal,) = validate(res)
    assert "8: R 256" in refusal.message and "(too much)" in refusal.message and "1: R 32" in refusal.message
    fixed, left = walk(res)
    assert left == []
    assert fixed["spec"]["parallelism"]["dataLocal"] == 2 and fixed["spec"]["parallelism"]["nodes"] == 8
    unknown, _ = walk(_with(CASES["ft-one-lost-rank-memory-unknown"][0]))
    assert unknown["spec"]["parallelism"]["dataLocal"] == 1 and unknown["spec"]["parallelism"]["nodes"] == 16
    children = render(unknown)
    out = launch_group(children, newest)
    assert problems(children, out) == [] and out.lb == "external" and out.served == list(range(16))
    (pod,) = [c for c in children if c["kind"] == "LeaderWorkerSet"]
    assert f"{format_version((0, 34, 0))}" in pod["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"][
        "containers"][0]["image"]
