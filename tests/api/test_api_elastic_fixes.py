"""The fixes elastic groups' refusals carry (``Problem.fix``) where the admission tables' seeds do not
reach: the group stays elastic wherever one edit makes it run, and turns elastic off only where no
edit can (a custom image, a model without EPLB, a launch size with no room to grow). The walk of every
refusal's advice through vLLM's launch logic is tests/launch_logic/test_launch_logic_advice.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from moe_eplb.api.problem import apply_fix
from moe_eplb.api.validation import validate
from tests.api.test_api_apply_time import elastic
from tests.example_manifests import EXAMPLES, load_moeinferences, set_path


def _resource(changes: dict[str, Any]) -> dict[str, Any]:
    res = copy.deepcopy(load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0])
    for dotted, value in changes.items():
        set_path(res, dotted, value)
    return res


def _fixed(changes: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(the refusals, the resource with every refusal's fix applied until it validates)."""
    res = _resource(changes)
    said = [str(p) for p in validate(res)]
    for _ in range(4):
        found = validate(res)
        if not found:
            return said, res
        assert all(p.fix is not None for p in found), [str(p) for p in found if p.fix is None]
        for p in found:
            res = apply_fix(res, p.fix)
    assert validate(res) == []
    return said, res


def _elastic(res: dict[str, Any]) -> dict[str, Any]:
    return res["spec"]["parallelism"]["elastic"]


@pytest.mark.parametrize(("changes", "expect"), [
    # data 1 with room to grow: launch at 2 ranks (a pod), the group grows to maxData 4
    ({"spec.parallelism": {"tensor": 4, "data": 1, "elastic": {"enabled": True, "maxData": 4}}, "spec.replicas": 1},
     {"spec.parallelism.data": 2, "spec.parallelism.elastic.enabled": True}),
    # data 1 and maxData 2: data 2 could never grow, the extra GPUs would buy nothing: elastic off
    ({"spec.parallelism": {"tensor": 4, "data": 1, "elastic": {"enabled": True, "maxData": 2}}, "spec.replicas": 1},
     {"spec.parallelism.data": 1, "spec.parallelism.elastic.enabled": False}),
])
def test_an_elastic_group_at_data_1_launches_with_data_parallel_where_it_can_grow(changes, expect):
    said, res = _fixed(elastic(changes))
    assert any("data parallel > 1" in s for s in said), said
    for dotted, value in expect.items():
        node: Any = res
        for key in dotted.split("."):
            node = node[key]
        assert node == value, (dotted, node)


def test_an_elastic_group_on_vllm_032_moves_to_vllms_first_release_with_it_or_off_on_a_custom_image():
    _, official = _fixed(elastic({"spec.engine.image": "vllm/vllm-openai:v0.32.0@sha256:" + "a" * 64}))
    assert official["spec"]["engine"]["image"] == "vllm/vllm-openai:v0.33.0" and _elastic(official)["enabled"]
    _, custom = _fixed(elastic({"spec.engine.image": "registry.example.com/vllm:custom", "spec.engine.version": "0.32.0"}))
    assert custom["spec"]["engine"]["image"] == "registry.example.com/vllm:custom" and not _elastic(custom)["enabled"]


def test_maxdata_left_out_is_what_the_resource_already_asks_for():
    """Three pods of 2 ranks asked for (spec.replicas 3): maxData 6; with the autoscaler, its maxReplicas."""
    _, res = _fixed(elastic({"spec.parallelism.elastic": {"enabled": True}, "spec.replicas": 3}))
    assert _elastic(res)["maxData"] == 6 and res["spec"]["replicas"] == 3
    _, scaled = _fixed(elastic({"spec.parallelism.elastic": {"enabled": True}, "spec.monitoring.prometheusUrl":
                                "http://prometheus:9090", "spec.autoscaling": {"minReplicas": 2, "maxReplicas": 5}}))
    assert _elastic(scaled)["maxData"] == 10 and scaled["spec"]["autoscaling"]["maxReplicas"] == 5


def test_sizes_move_to_whole_pods_and_the_group_keeps_its_range():
    _, res = _fixed(elastic({"spec.parallelism.elastic.minData": 5}))
    assert _elastic(res)["minData"] == 6 and res["spec"]["replicas"] == 3  # up: a pod more, never below the launch
    _, res = _fixed(elastic({"spec.parallelism.elastic.maxData": 9}))
    assert _elastic(res)["maxData"] == 8  # down: no more GPUs than asked for


def test_elastic_without_eplb_turns_elastic_off_where_vllm_has_no_eplb_for_the_checkpoint():
    """AWQ (not compressed-tensors) has no EPLB in vLLM: enabling EPLB would leave a refusal only the
    user can answer, so the group runs without elastic instead."""
    said, res = _fixed(elastic({"spec.eplb.enabled": False, "spec.eplb.numRedundantExperts": 0,
                                "spec.model.quantization": "awq"}))
    assert any("needs EPLB" in s for s in said)
    assert not _elastic(res)["enabled"] and not res["spec"]["eplb"]["enabled"]
    _, on = _fixed(elastic({"spec.eplb.enabled": False, "spec.eplb.numRedundantExperts": 0}))
    assert _elastic(on)["enabled"] and on["spec"]["eplb"]["enabled"]
