"""``spec.engine.podTemplate`` merged into the engine pods (moe_eplb.render.overlay): the container
named vllm merges into the engine container, other containers are sidecars, lists merge by their
keys, the operator's parts stay, and an overlay change rolls the pods without touching the EPLB
config hash or arguments."""

from __future__ import annotations

from typing import Any

from moe_eplb.api.podtemplate import PodTemplateOverlay
from moe_eplb.api.spec import parse
from moe_eplb.contracts.k8s_names import CONFIG_HASH_ANNOTATION, EXPORTER_INIT_CONTAINER
from moe_eplb.render.objects import render_children
from moe_eplb.render.overlay import merge_pod_template

P = "spec.engine.podTemplate"
MULTINODE = {"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}}


def templates(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine pod templates: the Deployment's, or the leader's and the worker's."""
    for child in render_children(parse(res)):
        if child["kind"] == "Deployment":
            return [child["spec"]["template"]]
        if child["kind"] == "LeaderWorkerSet":
            lwt = child["spec"]["leaderWorkerTemplate"]
            return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    raise AssertionError("no workload")


def engine(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == "vllm")


OVERLAY = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}},
    "spec": {
        "containers": [
            {"name": "vllm", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}, {"name": "HF_HOME", "value": "/x"}],
             "envFrom": [{"secretRef": {"name": "s3"}}],
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
             "resources": {"limits": {"rdma/ib": 1}},
             "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
             "startupProbe": {"failureThreshold": 900}},
            {"name": "proxy", "image": "envoyproxy/envoy:v1.31.0"},
        ],
        "initContainers": [{"name": "warm", "image": "busybox:1.36"}],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "tolerations": [{"key": "rdma", "operator": "Exists"}],
        "nodeSelector": {"net": "ib"},
        "priorityClassName": "inference-high",
        "terminationGracePeriodSeconds": 300,
    },
}


def test_overlay_reaches_every_engine_pod(variant) -> None:
    res = variant({**MULTINODE, P: OVERLAY, "spec.engine.tolerations": [{"key": "gpu", "operator": "Exists"}],
                   "spec.engine.nodeSelector": {"gpu": "h200"}})
    tmpls = templates(res)
    assert len(tmpls) == 2
    for t in tmpls:
        meta, spec, c = t["metadata"], t["spec"], engine(t)
        assert meta["labels"]["team"] == "ml" and meta["labels"]["eplb.ai/name"] == "qwen3-vl-30b"
        assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        assert CONFIG_HASH_ANNOTATION in meta["annotations"]
        # the engine container: merged, the operator's parts kept
        assert c["command"][0] in ("vllm", "/bin/sh") and c["image"] == "vllm/vllm-openai:v0.32.0"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1}
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        env = {e["name"]: e for e in c["env"]}
        assert env["NCCL_IB_HCA"]["value"] == "mlx5" and env["VLLM_PLUGINS"]["value"] == "moe_eplb_exporter"
        assert [e["name"] for e in c["env"]].count("HF_HOME") <= 1
        assert c["envFrom"] == [{"secretRef": {"name": "s3"}}]
        assert [m["mountPath"] for m in c["volumeMounts"]][-1] == "/scratch" and "/dev/shm" in {
            m["mountPath"] for m in c["volumeMounts"]}
        # sidecars and init containers added after the operator's
        assert [x["name"] for x in spec["containers"]] == ["vllm", "proxy"]
        assert [x["name"] for x in spec["initContainers"]] == [EXPORTER_INIT_CONTAINER, "warm"]
        assert [v["name"] for v in spec["volumes"]][-1] == "scratch"
        assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}, {"key": "rdma", "operator": "Exists"}]
        assert spec["nodeSelector"] == {"gpu": "h200", "net": "ib"}
        assert spec["priorityClassName"] == "inference-high" and spec["terminationGracePeriodSeconds"] == 300
    leader = engine(tmpls[0])
    assert leader["startupProbe"]["failureThreshold"] == 900 and leader["startupProbe"]["httpGet"]["path"] == "/health"


def test_overlay_leaves_the_eplb_arguments_and_hash(variant) -> None:
    plain, overlaid = variant(MULTINODE), variant({**MULTINODE, P: OVERLAY})
    for a, b in zip(templates(plain), templates(overlaid)):
        assert engine(a)["command"] == engine(b)["command"] and engine(a)["args"] == engine(b)["args"]
        assert a["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == b["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        assert a != b  # the overlay is part of the pod template: changing it rolls the pods


def test_env_entry_replaces_by_name_and_ports_append(variant) -> None:
    res = variant({"spec.engine.env": [{"name": "X", "value": "1"}],
                   P: {"spec": {"containers": [{"name": "vllm", "env": [{"name": "X", "valueFrom": {
                       "secretKeyRef": {"name": "s", "key": "k"}}}], "ports": [{"containerPort": 9000}]}]}}})
    c = engine(templates(res)[0])
    x = [e for e in c["env"] if e["name"] == "X"]
    assert x == [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]  # not value + valueFrom
    assert [p["containerPort"] for p in c["ports"]] == [8000, 9400, 9000]
    assert c["ports"][-1]["protocol"] == "TCP"  # defaulted like the apiserver does


def test_no_overlay_is_the_same_object() -> None:
    tmpl = {"metadata": {}, "spec": {"containers": [{"name": "vllm"}]}}
    assert merge_pod_template(tmpl, None) is tmpl
    merged = merge_pod_template(tmpl, PodTemplateOverlay(spec={"hostNetwork": True}))
    assert merged["spec"]["hostNetwork"] is True and "hostNetwork" not in tmpl["spec"]  # pure: input unchanged


def test_tolerations_are_not_duplicated() -> None:
    tol = {"key": "gpu", "operator": "Exists"}
    merged = merge_pod_template({"spec": {"tolerations": [tol]}}, PodTemplateOverlay(spec={"tolerations": [tol]}))
    assert merged["spec"]["tolerations"] == [tol]


def _example(name: str) -> dict[str, Any]:
    from tests.example_manifests import EXAMPLES, load_moeinferences

    return load_moeinferences(EXAMPLES / name)[0]


def test_rdma_example_reaches_leader_and_workers() -> None:
    tmpls = templates(_example("deepseek-v3-deepep-rdma.yaml"))
    assert len(tmpls) == 2
    for t in tmpls:
        c = engine(t)
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1}
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert t["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["HF_HOME"] == "/models"
        assert c["args"][c["args"].index("--all2all-backend") + 1] == "deepep_low_latency"


def test_restricted_example_sets_the_restricted_profile() -> None:
    (t,) = templates(_example("qwen3-30b-a3b-restricted.yaml"))
    pod = t["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert engine(t)["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    init = t["spec"]["initContainers"][0]["securityContext"]
    assert init["allowPrivilegeEscalation"] is False and init["capabilities"] == {"drop": ["ALL"]}


def test_kueue_and_s3_examples() -> None:
    (t,) = templates(_example("qwen3-30b-a3b-kueue.yaml"))
    assert t["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-inference"
    assert t["spec"]["priorityClassName"] == "inference-high"
    doc = _example("qwen3-30b-a3b-s3-streamer.yaml")
    assert parse(doc).catalog_model is not None  # recognised by the last segment of the s3:// path
    (t,) = templates(doc)
    c = engine(t)
    assert c["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    assert c["args"][0] == "s3://models/Qwen/Qwen3-30B-A3B-Instruct-2507" and "runai_streamer" in c["args"]
    assert not any("AWS_SECRET" in str(e) for e in c["env"])  # credentials only through the Secret
