"""The LeaderWorkerSet emulation (moe_eplb_harness.emulated.lws) follows the real API: a rolling update by group
honours maxUnavailable and maxSurge, scaling changes groups only, and every object and status it
emits passes the published LWS CRD's schema (the project's own validator, apiserver-style)."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from moe_eplb.api.schema import fill_schema_defaults, schema_problems, unknown_field_problems
from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.render.objects import render_children
from moe_eplb_harness.emulated import lws as L
from moe_eplb_harness.emulated.kubeapi import lws_crd

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = lws_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _example_lws() -> dict:
    res = next(d for d in yaml.safe_load_all((ROOT / "examples" / "deepseek-v3-multinode.yaml").read_text())
               if d and d.get("kind") == "MoEInference")
    res["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    return next(c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet")


def _problems(obj: dict) -> list:
    obj = fill_schema_defaults(obj, SCHEMA)
    return unknown_field_problems(obj, SCHEMA) + schema_problems(obj, SCHEMA)


# --- the rolling update, tick by tick --------------------------------------------------------------


class Cluster:
    """Groups of one LWS under the emulated controller; a new group is ready ``startup`` ticks later."""

    def __init__(self, replicas: int, surge, unavailable, startup: int = 2) -> None:
        self.spec = {"replicas": replicas, "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
            "maxSurge": surge, "maxUnavailable": unavailable}}}
        self.startup = startup
        self.groups: dict[int, list] = {}  # index -> [revision, ticks until ready]
        self.ls = None
        self.replaced: list[int] = []

    def tick(self, revision: str) -> None:
        for g in self.groups.values():
            g[1] = max(0, g[1] - 1)
        s = L.Strategy.of(self.spec)
        states = [L.GroupState(i in self.groups and self.groups[i][1] == 0,
                               i in self.groups and self.groups[i][0] == revision, i in self.groups)
                  for i in range(max([self.ls.groups if self.ls else 0] + [i + 1 for i in self.groups]))]
        self.ls = L.plan(s, revision, self.ls, states)
        for i in [i for i in self.groups if i >= self.ls.groups]:
            del self.groups[i]
        ready = {i: g[1] == 0 for i, g in self.groups.items()}
        for i in L.replacements(self.ls, s, {i: g[0] for i, g in self.groups.items()}, ready):
            del self.groups[i]
            self.replaced.append(i)
        for i in range(self.ls.groups):
            if i not in self.groups:
                self.groups[i] = [self.ls.revision_of(i), self.startup]

    def ready(self) -> int:
        return sum(1 for g in self.groups.values() if g[1] == 0)


@pytest.mark.parametrize("replicas,surge,unavailable,floor,ceiling", [
    (1, 0, 1, 0, 1),
    (2, 0, 1, 1, 2),
    (3, 0, 1, 2, 3),
    (4, 0, 2, 2, 4),
    (3, 1, 0, 3, 4),
    (2, 1, 1, 1, 3),
    (4, "50%", "25%", 3, 6),  # surge rounds up (2), unavailable down (1)
    (3, 5, 1, 2, 5),  # surge capped at replicas (3); only what maxUnavailable needs is started: 3 + (3 - 1)
])
def test_rolling_update_by_group_keeps_capacity(replicas, surge, unavailable, floor, ceiling):
    c = Cluster(replicas, surge, unavailable)
    for _ in range(5):
        c.tick("old")
    assert c.ready() == replicas and all(g[0] == "old" for g in c.groups.values())
    ready_seen, groups_seen = [], []
    for _ in range(60):
        c.tick("new")
        ready_seen.append(c.ready())
        groups_seen.append(len(c.groups))
    assert min(ready_seen) == floor, ready_seen  # never fewer ready groups than replicas - maxUnavailable
    assert max(groups_seen) == ceiling, groups_seen  # never more groups than replicas + maxSurge
    assert sorted(c.groups) == list(range(replicas)) and all(g[0] == "new" for g in c.groups.values())
    assert c.ls.partition == 0 and c.ls.groups == replicas
    original = [i for i in c.replaced if i < replicas]
    assert original == sorted(original, reverse=True)  # from the highest index down, each group once
    assert len(original) == len(set(original))


def test_scaling_adds_and_removes_groups_without_replacing_any():
    c = Cluster(2, 0, 1)
    for _ in range(4):
        c.tick("r1")
    c.spec["replicas"] = 4
    for _ in range(4):
        c.tick("r1")
    assert sorted(c.groups) == [0, 1, 2, 3] and c.replaced == []
    c.spec["replicas"] = 1
    c.tick("r1")
    assert sorted(c.groups) == [0] and c.replaced == []


def test_a_new_template_during_an_update_rolls_to_it_and_a_rollback_keeps_unchanged_groups():
    c = Cluster(3, 0, 1)
    for _ in range(4):
        c.tick("a")
    for _ in range(3):  # group 2 replaced with "b" and ready, group 1 on its way
        c.tick("b")
    assert c.groups[2][0] == "b" and c.groups[0][0] == "a"
    c.replaced.clear()
    for _ in range(40):  # rolled back to "a": only the groups that left "a" are replaced
        c.tick("a")
    assert all(g[0] == "a" for g in c.groups.values()) and c.ready() == 3
    assert 0 not in c.replaced


def test_percentages_round_as_the_api_says():
    s = L.Strategy.of({"replicas": 10, "rolloutStrategy": {"rollingUpdateConfiguration": {
        "maxSurge": "25%", "maxUnavailable": "25%"}}})
    assert (s.max_surge, s.max_unavailable) == (3, 2)
    assert L.Strategy.of({"replicas": 3}).max_unavailable == 1  # API default 1, maxSurge 0
    assert L.Strategy.of({"replicas": 3}).max_surge == 0


# --- objects and status against the published CRD --------------------------------------------------


def test_vendored_crd_is_the_published_one_with_only_pod_templates_trimmed():
    crd = lws_crd()
    version = crd["spec"]["versions"][0]
    assert (crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"]) == (
        "leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet")
    assert version["subresources"]["scale"] == {"labelSelectorPath": ".status.hpaPodSelector",
                                                "specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas"}
    lwt = SCHEMA["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]
    for key in ("leaderTemplate", "workerTemplate"):
        assert lwt[key]["x-kubernetes-preserve-unknown-fields"] and "trimmed" in lwt[key]["description"]
    ru = SCHEMA["properties"]["spec"]["properties"]["rolloutStrategy"]["properties"]["rollingUpdateConfiguration"]
    assert set(ru["properties"]) == {"maxSurge", "maxUnavailable", "partition"}
    assert ru["properties"]["maxUnavailable"]["default"] == 1 and ru["properties"]["maxSurge"]["default"] == 0
    status = SCHEMA["properties"]["status"]["properties"]
    assert set(status) == {"conditions", "hpaPodSelector", "observedGeneration", "readyReplicas", "replicas",
                           "updatedReplicas"}
    assert (ROOT / "scripts" / "vendor_lws_crd.py").is_file()


def test_rendered_lws_and_every_emitted_status_pass_the_crd():
    lws = _example_lws()
    assert _problems(lws) == []
    lws["metadata"].update(name="deepseek-v3", namespace="default", generation=3)
    ls = L.LeaderSet(groups=2, partition=1, revision="r2", stable="r1", replicas=1)
    conditions = None
    for states in ([L.GroupState(True, False), L.GroupState(False, True)],  # rolling, with a surge group
                   [L.GroupState(False, True, exists=False), L.GroupState(True, True)],
                   [L.GroupState(True, True)]):
        status = L.status(lws, ls, states, "2026-01-01T00:00:00Z", conditions)
        assert _problems({**lws, "status": status}) == [], status
        conditions = status["conditions"]
    assert status["hpaPodSelector"] == (f"{k8s_names.LWS_NAME_LABEL}=deepseek-v3,"
                                        f"{k8s_names.LWS_WORKER_INDEX_LABEL}=0")
    types = {c["type"]: c["status"] for c in conditions}
    assert types["Available"] == "True" and types["Progressing"] == "False"  # exclusive


def test_the_crd_check_catches_what_the_apiserver_would_refuse():
    """Negative controls: the same validator refuses a bad enum, a wrong type, an unknown field and
    a condition without its required fields."""
    lws = _example_lws()
    bad = copy.deepcopy(lws)
    bad["spec"]["startupPolicy"] = "Eager"
    assert _problems(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurges"] = 1
    assert "maxSurges" in str(_problems(bad))
    bad = copy.deepcopy(lws)
    bad["status"] = {"replicas": "2"}
    assert _problems(bad)
    bad["status"] = {"conditions": [{"type": "Available", "status": "True", "reason": "AllGroupsReady"}]}
    assert {p.field for p in _problems(bad)} >= {"status.conditions[0].lastTransitionTime",
                                                 "status.conditions[0].message"}


def test_group_pods_carry_what_lws_adds():
    lws = _example_lws()
    lws["metadata"].update(name="ds", namespace="ns1", uid="u1")
    rev = L.template_revision(lws["spec"])
    leader = L.group_pod(lws, lws["spec"], 1, 0, rev)
    worker = L.group_pod(lws, lws["spec"], 1, 1, rev)
    assert (leader["metadata"]["name"], worker["metadata"]["name"]) == ("ds-1", "ds-1-1")
    for pod, index in ((leader, "0"), (worker, "1")):
        labels, ann = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels[k8s_names.LWS_NAME_LABEL] == "ds" and labels[k8s_names.LWS_GROUP_INDEX_LABEL] == "1"
        assert labels[k8s_names.LWS_WORKER_INDEX_LABEL] == index
        assert labels[k8s_names.LWS_TEMPLATE_REVISION_LABEL] == rev
        assert labels[k8s_names.LWS_GROUP_KEY_LABEL] == L.group_key("ns1", "ds-1")
        assert ann[k8s_names.LWS_SIZE_ANNOTATION] == "2"
        assert ann[k8s_names.CONFIG_HASH_ANNOTATION]  # the template's own annotations are kept
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[k8s_names.LWS_LEADER_ADDRESS_ENV] == "ds-1.ds-1.ns1" and env[k8s_names.LWS_WORKER_INDEX_ENV] == index
    assert worker["metadata"]["annotations"][k8s_names.LWS_LEADER_NAME_ANNOTATION] == "ds-1"
    assert "--headless" in worker["spec"]["containers"][0]["command"][2]  # the worker template
    assert L.template_revision({**lws["spec"], "replicas": 7}) == rev  # replicas is not the template
