"""Elastic groups in the resource: vLLM's redundancy rule across a resize, the sizes a group may run, the
typed spec and status, and what is rendered (founders, the joining pods' StatefulSet, vLLM's flags, the
Service and the NetworkPolicy)."""

from __future__ import annotations

import copy
import shlex
import subprocess

import pytest
import yaml

from moe_eplb.api import elastic as el
from moe_eplb.api.elastic import ElasticError, ElasticStatus
from moe_eplb.api.spec import parse
from moe_eplb.api.validation import validate
from moe_eplb.contracts import k8s_names
from moe_eplb.render.objects import render_children
from tests.example_manifests import EXAMPLES, load_moeinferences

EXAMPLE = EXAMPLES / "deepseek-v3-elastic.yaml"


def example(**status) -> dict:
    doc = load_moeinferences(EXAMPLE)[0]
    if status:
        doc["status"] = {"elastic": ElasticStatus(**status).to_crd()}
    return doc


def kinds(children: list[dict]) -> dict[str, dict]:
    return {c["kind"]: c for c in children}


# --- vLLM's arithmetic -----------------------------------------------------------------------------

def test_redundancy_follows_vllms_rule() -> None:
    # DeepSeek-V3: 256 experts, 32 redundant at 16 ranks (18 slots per rank) -> 320 at 32 ranks, 176 at 24
    assert el.redundancy_at(256, 32, 16, 32) == 320
    assert el.redundancy_at(256, 32, 16, 24) == 176
    assert (256 + 176) % 24 == 0 and (256 + 320) % 32 == 0
    # a chain of resizes lands where a direct one does (the slots per rank stay constant)
    assert el.redundancy_at(256, el.redundancy_at(256, 32, 16, 24), 24, 32) == 320
    assert el.redundancy_at(256, 320, 32, 16) == 32
    with pytest.raises(ElasticError, match="cannot hold all 256 experts"):
        el.redundancy_at(256, 32, 16, 8)  # 8 ranks x 18 slots < 256


def test_sizes_are_pod_steps_and_size_problems_name_why() -> None:
    assert el.sizes(16, 32, 8) == (16, 24, 32)
    assert el.sizes(4, 2, 2) == ()
    assert el.size_problem(256, 32, 1, 16, 32) is None
    assert "cannot hold" in el.size_problem(256, 32, 1, 16, 8)
    # E + R not divisible at launch: vLLM's integer division leaves a remainder at the new size
    assert "does not divide" in el.size_problem(10, 0, 1, 4, 6)
    assert el.size_problem(None, 0, 1, 4, 8) is None


def test_the_status_record_round_trips_and_tolerates_garbage() -> None:
    st = ElasticStatus(16, 32, el.PREPARING, epoch="ab", last_error=None)
    assert el.parse_status(st.to_crd()) == st and "lastError" not in st.to_crd()
    assert el.parse_status({"dataParallel": "x"}) is None and el.parse_status(None) is None
    assert el.parse_status({"dataParallel": 8, "phase": "Weird"}) == ElasticStatus(8, 8, el.STABLE)


@pytest.mark.parametrize("phase,joiners,size", [
    (el.LAUNCHING, 0, 16), (el.STABLE, 0, 16), (el.STARTING, 2, 32), (el.PREPARING, 2, 32),
    (el.COMMITTING, 2, 32), (el.ROLLING_BACK, 0, 16), (el.FAILED, 0, 16), (el.RESTARTING_GROUP, 0, 16)])
def test_the_joining_pods_follow_the_phase_of_a_grow(phase, joiners, size) -> None:
    st = ElasticStatus(16, 32, phase)
    assert el.joiner_pods(st, 16, 8) == joiners and el.joiner_launch_size(st) == size


def test_a_shrink_keeps_the_retiring_pods_until_committed() -> None:
    assert el.joiner_pods(ElasticStatus(32, 16, el.DRAINING), 16, 8) == 2
    assert el.joiner_pods(ElasticStatus(32, 16, el.COMMITTING), 16, 8) == 2
    assert el.joiner_pods(ElasticStatus(16, 16, el.RETIRING), 16, 8) == 0


# --- the typed spec ------------------------------------------------------------------------------

def test_the_example_is_valid_and_reads_typed() -> None:
    doc = example()
    assert validate(doc) == []
    inf = parse(doc)
    p = inf.parallelism
    assert inf.elastic_enabled and inf.uses_lws and (p.min_data, p.max_data, p.data_local) == (16, 32, 8)
    assert inf.replica_groups == 1 and inf.elastic_desired == 16  # replicas: 2 pods
    assert inf.layout.lb == "external" and inf.layout.api_servers_per_pod == 8
    # no status yet: the group launches at spec.parallelism.data
    assert inf.elastic_status == ElasticStatus(16, 16, el.LAUNCHING)
    grown = parse(example(data_parallel=32, target_data_parallel=32, phase=el.STABLE))
    assert grown.data_parallel_now == 32 and grown.redundancy_at(32) == 320


def test_desired_size_is_replicas_pods_within_the_bounds() -> None:
    doc = example()
    doc["spec"]["replicas"] = 3
    assert parse(doc).elastic_desired == 24
    doc["spec"]["replicas"] = 9  # refused by validation; the typed value still stays inside the bounds
    assert parse(doc).elastic_desired == 32


# --- rendering -----------------------------------------------------------------------------------

def test_render_founders_joiners_service_and_network_policy() -> None:
    children = kinds(render_children(parse(example())))
    lws, sts, svc, netpol = (children[k] for k in ("LeaderWorkerSet", "StatefulSet", "Service", "NetworkPolicy"))
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["metadata"]["labels"][k8s_names.ELASTIC_ROLE_LABEL] == "founder"
    args = leader["spec"]["containers"][0]["args"]
    flag = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert (flag("--data-parallel-size"), flag("--elastic-ep-max-dp-size")) == ("16", "32")
    assert "--enable-elastic-ep" in args and '"use_async":false' in flag("--eplb-config")
    assert flag("--data-parallel-start-rank") == "0" and "--data-parallel-multi-port-external-lb" in args
    # the joiners: a StatefulSet of no pods yet, OnDelete, their own selector
    assert sts["metadata"]["name"] == "deepseek-v3-elastic-join" and sts["spec"]["replicas"] == 0
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"} and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["selector"]["matchLabels"][k8s_names.ELASTIC_ROLE_LABEL] == "joiner"
    # every pod of the group serves (external LB): the Service selects them while they serve
    assert svc["spec"]["selector"][k8s_names.SERVING_LABEL] == "true"
    assert [p["port"] for p in svc["spec"]["ports"]][:8] == list(range(8000, 8008))
    private = netpol["spec"]["ingress"][2]
    assert {p["port"] for p in private["ports"]} == {9400, 9256}
    assert {p["port"] for p in netpol["spec"]["ingress"][0]["ports"]} == set(range(8000, 8008))


def test_render_a_grow_in_progress_creates_the_joiners_for_the_target() -> None:
    sts = kinds(render_children(parse(example(data_parallel=16, target_data_parallel=32, phase=el.STARTING))))["StatefulSet"]
    assert sts["spec"]["replicas"] == 2
    c = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env[el.SCALE_UP_LAUNCH_ENV]["value"] == "1"
    assert env[k8s_names.POD_NAME_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = c["args"]
    assert args[args.index("--data-parallel-size") + 1] == "32"
    assert args[-2:] == ["--data-parallel-address", "deepseek-v3-elastic-0.deepseek-v3-elastic-0"]


def test_a_joiners_rank_comes_from_its_ordinal_through_the_shell() -> None:
    """The fixed script, after Kubernetes' expansion, run by a real ``sh`` for pod ``...-join-1``:
    its first rank is data + 1 x dataLocal = 24."""
    sts = kinds(render_children(parse(example(data_parallel=16, target_data_parallel=32, phase=el.STARTING))))["StatefulSet"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    script = c["command"][2].replace("$$", "$").replace("rm -rf", ": rm").replace("exec vllm serve", "echo")
    out = subprocess.run(["sh", "-c", script, "vllm", "model"], env={k8s_names.POD_NAME_ENV: "deepseek-v3-elastic-join-1"},
                         capture_output=True, text=True, check=True).stdout
    words = shlex.split(out)
    assert words[words.index("--data-parallel-start-rank") + 1] == "24"


def test_nothing_changes_for_resources_without_elastic() -> None:
    doc = yaml.safe_load((EXAMPLES / "deepseek-v3-fault-tolerant.yaml").read_text())
    children = render_children(parse(doc))
    assert {c["kind"] for c in children} == {"Service", "LeaderWorkerSet", "PodDisruptionBudget", "ConfigMap"}
    inf = parse(copy.deepcopy(doc))
    assert not inf.elastic_enabled and inf.replica_groups == inf.replicas and inf.data_parallel_now == 32


def test_the_autoscaler_scales_the_groups_pods_through_scale() -> None:
    children = kinds(render_children(parse(example())))
    so = children["ScaledObject"]["spec"]
    assert so["scaleTargetRef"]["kind"] == "MoEInference" and so["scaleTargetRef"]["name"] == "deepseek-v3-elastic"
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (2, 4)  # minData / 8, maxData / 8 pods
