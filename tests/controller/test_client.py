"""controller/k8s.py against the emulated API server: the small client's contract."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

from moe_eplb.controller.k8s import ApiError, Connection, KubeClient  # noqa: E402


def svc(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default",
                                                                 "labels": {"a": "1"}},
            "spec": {"ports": [{"name": "http", "port": 8000}]}}


async def test_client_verbs_and_errors(emulated_cluster):
    async with KubeClient(Connection(server=emulated_cluster.url, token="t")) as client:
        assert await client.get("v1", "Service", "default", "s") is None
        created = await client.create(svc("s"))
        assert created["metadata"]["uid"]
        with pytest.raises(ApiError) as exc:
            await client.create(svc("s"))
        assert exc.value.status == 409
        dry = await client.patch("v1", "Service", "default", "s", {"metadata": {"labels": {"a": "2"}}}, dry_run=True)
        assert dry["metadata"]["labels"]["a"] == "2"
        assert (await client.get("v1", "Service", "default", "s"))["metadata"]["labels"]["a"] == "1"
        with pytest.raises(ApiError) as exc:  # conditional patch on a stale resourceVersion
            await client.patch("v1", "Service", "default", "s", {"metadata": {"resourceVersion": "1"}})
        assert exc.value.status == 409
        assert [o["metadata"]["name"] for o in await client.list("v1", "Service", "default", "a=1")] == ["s"]
        assert await client.delete("v1", "Service", "default", "s") is True
        assert await client.delete("v1", "Service", "default", "s") is False
        await client.post_event(created, type="Normal", reason="Test", message="hello")
        events = await client.list("v1", "Event", "default")
        assert events[0]["involvedObject"]["uid"] == created["metadata"]["uid"] and events[0]["reason"] == "Test"
    assert ("create", "", "services", None) in client.calls and ("delete", "", "services", None) in client.calls


async def test_unreachable_server_is_a_retryable_api_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with KubeClient(Connection(server=f"http://127.0.0.1:{port}")) as client:
        with pytest.raises(ApiError) as exc:
            await client.get("v1", "Service", "default", "s")
    assert exc.value.status == 503


def test_unknown_kind_names_the_fix():
    from moe_eplb.controller.k8s import kind_of

    with pytest.raises(KeyError, match="RBAC_RULES"):
        kind_of("v1", "PersistentVolumeClaim")  # (a ConfigMap is known: the live-settings child)


async def test_patch_status_is_conditional_and_events_are_best_effort(emulated_cluster):
    """``patch_status``: True when written, False when the object changed meanwhile (409) or is gone
    (404); ``try_post_event`` never raises (the loops' Events are best effort)."""
    async with KubeClient(Connection(server=emulated_cluster.url, token="t")) as client:
        created = await client.create(svc("s"))
        rv = created["metadata"]["resourceVersion"]
        assert await client.patch_status("v1", "Service", "default", "s", {"loadBalancer": {}},
                                         resource_version="1") is False
        assert await client.patch_status("v1", "Service", "default", "s", {"loadBalancer": {}},
                                         resource_version=rv) is True
        assert await client.try_post_event(created, type="Normal", reason="Test", message="hello") is True
        assert await client.delete("v1", "Service", "default", "s") is True
        assert await client.patch_status("v1", "Service", "default", "s", {"loadBalancer": {}},
                                         resource_version=rv) is False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with KubeClient(Connection(server=f"http://127.0.0.1:{port}")) as client:
        assert await client.try_post_event(created, type="Normal", reason="Test", message="hello") is False
        with pytest.raises(ApiError) as exc:  # not a conflict: the caller sees it
            await client.patch_status("v1", "Service", "default", "s", {}, resource_version=rv)
    assert exc.value.status == 503
