"""Operator-in-the-loop with spec.autoscaling: the real operator renders the autoscaler as a child
(the emulated API server admits the ScaledObject against KEDA's published CRD), an autoscaler's
write to /scale scales the workload with a Scaled Event, the Autoscaling condition and the replica
gauges say what runs, switching the backend swaps the child, and turning autoscaling off removes it."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import yaml
from prometheus_client import REGISTRY

from tests.controller.test_operator_loop import NS, ROOT, children, events_for, observed, workloads

pytestmark = pytest.mark.integration  # the real operator and an emulated API server

EXAMPLE = ROOT / "examples" / "qwen3-30b-a3b-autoscaled.yaml"


def example() -> dict:
    res = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d.get("kind") == "MoEInference")
    res["spec"]["replicas"] = 1  # the CRD's default, which a real API server stores (the emulator does not)
    return res


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def scaled_event(emulated_cluster, name: str) -> dict | None:
    return next((e for e in await events_for(emulated_cluster, name) if e["reason"] == "Scaled"), None)


async def test_autoscaler_lifecycle(emulated_cluster, eventually, started):
    res = example()
    name = res["metadata"]["name"]
    path = emulated_cluster.moeinference_path(NS, name)
    async with started(res) as obj:
        kids = await children(emulated_cluster, name)
        so = kids[f"ScaledObject/{name}"]
        assert so["spec"]["scaleTargetRef"] == {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": name}
        assert so["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        cond = condition(obj, "Autoscaling")
        assert cond["status"] == "True" and "between 1 and 4 on vllm:num_requests_waiting" in cond["message"]
        labels = {"namespace": NS, "name": name}
        assert REGISTRY.get_sample_value("moe_eplb_autoscaler_max_replicas", labels) == 4
        assert REGISTRY.get_sample_value("moe_eplb_replicas", {**labels, "state": "desired"}) == 1

        # KEDA's HPA writes /scale: the workload follows, with a Scaled Event
        await emulated_cluster.patch(path + "/scale", {"spec": {"replicas": 3}})
        await eventually(lambda: observed(emulated_cluster, name, 2))
        assert sum(w["spec"]["replicas"] for w in workloads(await children(emulated_cluster, name)).values()) == 3
        await eventually(lambda: scaled_event(emulated_cluster, name))
        assert REGISTRY.get_sample_value("moe_eplb_replicas", {**labels, "state": "desired"}) == 3

        # the HPA backend instead: the ScaledObject goes, an autoscaling/v2 HPA comes
        await emulated_cluster.patch(path, {"spec": {"autoscaling": {"backend": "HPA", "hpa": {"metricsApi": "External"}}}})
        await eventually(lambda: observed(emulated_cluster, name, 3))
        kinds = {k.split("/")[0] for k in await children(emulated_cluster, name)}
        assert "HorizontalPodAutoscaler" in kinds and "ScaledObject" not in kinds

        # off: the autoscaler is removed, the condition says so, spec.replicas is the user's again
        await emulated_cluster.patch(path, {"spec": {"autoscaling": {"enabled": False}}})
        stored = await eventually(lambda: observed(emulated_cluster, name, 4))
        kinds = {k.split("/")[0] for k in await children(emulated_cluster, name)}
        assert not kinds & {"HorizontalPodAutoscaler", "ScaledObject"}
        assert (condition(stored, "Autoscaling")["status"], condition(stored, "Autoscaling")["reason"]) == \
            ("False", "Disabled")
        assert REGISTRY.get_sample_value("moe_eplb_autoscaler_max_replicas", labels) is None
        assert sum(w["spec"]["replicas"] for w in workloads(await children(emulated_cluster, name)).values()) == 3


async def test_a_scaled_object_kedas_crd_refuses_is_never_applied(emulated_cluster, eventually, started):
    """The emulated API server enforces KEDA's CRD: a ScaledObject written by hand with min > max is
    refused there (422), the same object the rendered one is checked against."""
    import aiohttp

    res = example()
    name = res["metadata"]["name"]
    async with started(res):
        so = (await children(emulated_cluster, name))[f"ScaledObject/{name}"]
        bad = {"apiVersion": so["apiVersion"], "kind": so["kind"], "metadata": {"name": "hand-made"},
               "spec": {**so["spec"], "minReplicaCount": "one"}}
        with pytest.raises(aiohttp.ClientResponseError) as err:
            await emulated_cluster.create("/apis/keda.sh/v1alpha1/namespaces/default/scaledobjects", bad)
        assert err.value.status == 422
