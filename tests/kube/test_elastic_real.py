"""Elastic groups on the REAL control plane with the REAL LeaderWorkerSet controller, the real
StatefulSet controller (kube-controller-manager) and the simulated elastic protocol of vLLM 0.34
(:mod:`moe_eplb_harness.engines.elastic`; each pod's ranks serve their API on the pod's IP, and the
pod's exporter port serves the product's relay, :mod:`moe_eplb.exporter.elastic_relay`).

- what the real LWS controller does with a size change (the reason the joining pods are a StatefulSet
  of their own: :mod:`moe_eplb.render.elastic`);
- grow 2 -> 4 pods under load, shrink 4 -> 2, a failed grow rolled back, an operator restart mid-resize,
  each checked for the known-state rule: ``status.elastic.dataParallel`` only ever the old or the new
  size (never a half-joined group), never below ``minData``, and requests served meanwhile;
- a resize request from another pod's address (no token, a wrong token) refused by the pod's relay.

The timelines of a grow and of a failed grow are printed (``-s``) for the record (docs/resource.md).
"""

from __future__ import annotations

import asyncio
import copy
import time

import aiohttp
import pytest

from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.controller.elastic import request_size
from moe_eplb.render.objects import render_children
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.engines.elastic import ElasticFaults
from moe_eplb_harness.real import lwscontroller
from moe_eplb_harness.real.controlplane import find_binaries
from tests.autotune.conftest import RESOURCE
from tests.kube.conftest import tiny_resource
from tests.polling import eventually
from tests.require import missing


@pytest.fixture()
def built() -> None:
    if find_binaries() is None or lwscontroller.find_lws_binary() is None:
        missing("the control plane and the LWS controller are not built (run `make kube`)")


def _workload():
    from moe_eplb.eplb.workload import synth

    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1, bucket_seconds=15,
                          seed=4)


async def test_elastic_lws_size_change_recreates_the_group(built, real_control_plane) -> None:
    """The finding the design rests on: the real LWS controller (v0.8.0) treats a change of
    ``leaderWorkerTemplate.size`` as a new template revision and recreates the group (every pod gets a new
    uid), so an LWS whose size changes cannot grow a running group. The joining pods are therefore a
    StatefulSet beside the founders' LWS (render.elastic)."""
    world = SimWorld(workload=_workload(), api="real", lws="real", scale=100.0, startup_seconds=5.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane)
    async with world.run():
        ns, cluster = world.namespace, world.cluster
        res = copy.deepcopy(RESOURCE)
        res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
        res["spec"]["replicas"] = 1
        lws = next(c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet")
        lws["metadata"]["namespace"] = ns
        path = f"/apis/{k8s_names.LWS_API_VERSION}/namespaces/{ns}/leaderworkersets"
        await cluster.create(path, lws)

        async def pods(n: int, ready_too: bool = True):
            ps = [p for p in await cluster.list(f"/api/v1/namespaces/{ns}/pods", "eplb.ai/name=tiny")
                  if not p["metadata"].get("deletionTimestamp")]
            ready = [p for p in ps if any(c["type"] == "Ready" and c["status"] == "True"
                                          for c in (p.get("status") or {}).get("conditions") or [])]
            return ps if len(ps) == n and (len(ready) == n or not ready_too) else None

        before = await eventually(lambda: pods(2), timeout=120, interval=0.1, what="a group of 2 pods")
        leader_uid = next(p["metadata"]["uid"] for p in before if p["metadata"]["name"] == "tiny-0")
        # 4 pods: what a grow would ask of an LWS group (only the size changes)
        await cluster.request("PATCH", f"{path}/tiny", {"spec": {"leaderWorkerTemplate": {"size": 4}}},
                              content_type="application/merge-patch+json")
        after = await eventually(lambda: pods(4, ready_too=False), timeout=120, interval=0.1, what="a group of 4 pods")
        names = sorted(p["metadata"]["name"] for p in after)
        assert names == ["tiny-0", "tiny-0-1", "tiny-0-2", "tiny-0-3"]
        new_uids = {p["metadata"]["uid"] for p in after}
        # the running leader was replaced, and so was its worker: the group was recreated
        assert leader_uid not in new_uids
        assert new_uids.isdisjoint(p["metadata"]["uid"] for p in before)


# --- the operator drives resizes -----------------------------------------------------------------

NAME = "tiny"


def elastic_resource(pods: int = 2) -> dict:
    """The tiny MoE (16 experts) as an elastic group: launched at 4 ranks over 2 pods of 2 ranks, up to
    8 ranks (4 pods); vLLM 0.34; ``spec.replicas`` counts the pods."""
    res = tiny_resource(NAME, replicas=pods)
    res["spec"]["engine"] = {"image": "vllm/vllm-openai:v0.34.0", "startupTimeoutSeconds": 60, "drainSeconds": 2}
    res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2, "elastic": {"enabled": True, "maxData": 8}}
    return res


class Load:
    """Requests to every endpoint the Service routes to, as a gateway in front of the group would send
    them: the ready pods its selector picks (``eplb.ai/serving=true`` included), on their API ports.
    (Read from the pods as the EndpointSlice controller does: it refuses the simulated nodes' loopback
    pod IPs as endpoint addresses.) Each answer is recorded as ``(time, pod IP:port, status)``."""

    def __init__(self, world: SimWorld, workers: int = 4) -> None:
        self.world, self.workers = world, workers
        self.answers: list[tuple[float, str, int]] = []
        self.endpoints: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def _refresh(self) -> None:
        cluster, ns = self.world.cluster, self.world.namespace
        while True:
            svc = await cluster.get(f"/api/v1/namespaces/{ns}/services/{NAME}")
            selector = ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items())
            eps = []
            for pod in await cluster.list(f"/api/v1/namespaces/{ns}/pods", selector):
                st = pod.get("status") or {}
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
                if ready and st.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                    eps += [f"{st['podIP']}:{p['containerPort']}" for c in pod["spec"]["containers"]
                            for p in c.get("ports") or [] if p["name"].startswith("http")]
            self.endpoints = sorted(eps)
            await asyncio.sleep(0.2)

    async def _send(self, i: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            n = i
            while True:
                eps = self.endpoints
                if not eps:
                    await asyncio.sleep(0.05)
                    continue
                ep = eps[n % len(eps)]
                n += 1
                try:
                    async with http.post(f"http://{ep}/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                        self.answers.append((time.time(), ep, r.status))
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    self.answers.append((time.time(), ep, 0))
                await asyncio.sleep(0.01)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._refresh())] + [asyncio.create_task(self._send(i))
                                                                 for i in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def between(self, start: float, end: float) -> dict[int, int]:
        out: dict[int, int] = {}
        for t, _ep, status in self.answers:
            if start <= t <= end:
                out[status] = out.get(status, 0) + 1
        return out


class Recorder:
    """``status.elastic`` sampled every 0.1 s: (time, phase, dataParallel, targetDataParallel, epoch)."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self.samples: list[tuple[float, str, int, int, str | None]] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            try:
                st = ((await self.world.get(NAME)).get("status") or {}).get("elastic")
            except Exception:  # noqa: BLE001 - a failed read is a gap in the record
                st = None
            if st:
                self.samples.append((time.time(), st.get("phase"), st.get("dataParallel"),
                                     st.get("targetDataParallel"), st.get("epoch")))
            await asyncio.sleep(0.1)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def phases(self, since: float) -> list[tuple[float, str, int, int]]:
        """The phase changes after ``since``: (seconds after it, phase, dataParallel, target)."""
        out: list[tuple[float, str, int, int]] = []
        for t, phase, dp, target, _epoch in self.samples:
            if t >= since and (not out or out[-1][1:] != (phase, dp, target)):
                out.append((round(t - since, 2), phase, dp, target))
        return out


async def _elastic(world: SimWorld) -> dict:
    return ((await world.get(NAME)).get("status") or {}).get("elastic") or {}


async def _stable_at(world: SimWorld, dp: int, phase: str = "Stable", timeout: float = 120.0) -> dict:
    last: list = []

    async def check():
        st = await _elastic(world)
        last[:] = [st]
        return st if st.get("phase") == phase and st.get("dataParallel") == dp else None

    try:
        return await eventually(check, timeout=timeout, interval=0.1, what=f"status.elastic {phase} at {dp} ranks")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status.elastic was {last}") from None


async def _scale(world: SimWorld, pods: int) -> None:
    """``kubectl scale moe tiny --replicas=N``: the /scale subresource, as an autoscaler writes it."""
    path = world.cluster.moeinference_path(world.namespace, NAME) + "/scale"
    await world.cluster.request("PATCH", path, {"spec": {"replicas": pods}},
                                content_type="application/merge-patch+json")


def _pods(world: SimWorld) -> list:
    return sorted(p.name for p in world.kubelet.agent.pods.values() if p.instance == NAME and p.elastic is not None)


def _print_timeline(title: str, phases: list, load: dict) -> None:
    print(f"\n{title}")
    for t, phase, dp, target in phases:
        print(f"  +{t:6.2f}s  {phase:<16} dataParallel {dp} -> target {target}")
    print(f"  requests meanwhile: {load}")


def _known_states(rec: Recorder, sizes: set[int], minimum: int) -> None:
    seen = {dp for _t, _p, dp, _tg, _e in rec.samples}
    assert seen <= sizes, f"dataParallel took {seen - sizes}: a half-joined group"
    assert min(seen) >= minimum


@pytest.fixture()
async def elastic_world(built, real_control_plane):
    world = SimWorld(workload=_workload(), api="real", lws="real", scale=1.0, startup_seconds=1.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane, elastic_tick=0.3)
    async with world.run():
        world.kubelet.agent.elastic.faults[(world.namespace, NAME)] = ElasticFaults(
            join_seconds=1.5, commit_seconds=0.6, launch_seconds=1.0)
        await world.start_operator()
        await world.apply(elastic_resource(2))
        await _stable_at(world, 4)
        yield world


async def test_elastic_grow_and_shrink_under_load(elastic_world) -> None:
    world = elastic_world
    rec, load = Recorder(world), Load(world)
    rec.start()
    load.start()
    try:
        await asyncio.sleep(1.0)
        t0 = time.time()
        # the path fault recovery (39F) asks for a size on: /scale, as the autoscaler does
        await request_size(world.operators[0]["controller"].client, world.namespace, NAME, 8, 2)
        await _stable_at(world, 8)
        await asyncio.sleep(0.3)  # the recorder's next sample
        t1 = time.time()
        grow = rec.phases(t0)
        grow_load = load.between(t0, t1)
        # every new pod serves: the Service routes to all 8 ranks
        await eventually(lambda: len(load.endpoints) == 8 or None, timeout=30, what="8 endpoints")
        assert _pods(world) == ["tiny-0", "tiny-0-1", "tiny-join-0", "tiny-join-1"]
        async def sized():
            obj = await world.get(NAME)
            return obj if obj["status"]["replicas"] == 4 and obj["status"]["epSize"] == 8 else None

        obj = await eventually(sized, timeout=30, what="status.replicas 4 pods, epSize 8")
        # vLLM's redundancy after the grow: (16 + 0) x 8 / 4 - 16 = 16, shown without a restart
        assert obj["status"]["eplb"]["numRedundantExperts"] == 16
        await asyncio.sleep(1.0)
        t2 = time.time()
        await _scale(world, 2)
        await _stable_at(world, 4)
        await eventually(lambda: _pods(world) == ["tiny-0", "tiny-0-1"] or None, timeout=30, what="joiners gone")
        await asyncio.sleep(0.3)  # the recorder's next sample
        t3 = time.time()
        shrink = rec.phases(t2)
    finally:
        await load.stop()
        await rec.stop()
    _print_timeline("grow 4 -> 8 ranks (2 -> 4 pods)", grow, grow_load)
    _print_timeline("shrink 8 -> 4 ranks (4 -> 2 pods)", shrink, load.between(t2, t3))
    names = [p[1] for p in grow]
    assert names.index("Starting") < names.index("Preparing") and grow[-1][1:] == ("Stable", 8, 8), grow
    names = [p[1] for p in shrink]
    assert names.index("Draining") < names.index("Preparing") < names.index("Retiring"), shrink
    assert shrink[-1][1:] == ("Stable", 4, 4), shrink
    _known_states(rec, {4, 8}, 4)
    assert grow_load.get(200, 0) > 0 and load.between(t2, t3).get(200, 0) > 0
    group = world.kubelet.agent.elastic.groups[(world.namespace, NAME)]
    events = [e for _t, e, _d in group.history]
    assert events.count("completed") == 2 and "failed" not in events


async def test_elastic_failed_grow_rolls_back_and_a_foreign_resize_is_refused(elastic_world) -> None:
    world = elastic_world
    group = world.kubelet.agent.elastic.groups[(world.namespace, NAME)]
    group.faults.fail_at, group.faults.error = "preparing", "simulated: a new rank failed to load its weights"
    rec, load = Recorder(world), Load(world)
    rec.start()
    load.start()
    try:
        await asyncio.sleep(0.5)
        t0 = time.time()
        await _scale(world, 4)
        st = await _stable_at(world, 4, phase="Failed")
        await asyncio.sleep(0.3)  # the recorder's next sample
        t1 = time.time()
        await eventually(lambda: _pods(world) == ["tiny-0", "tiny-0-1"] or None, timeout=30, what="new pods removed")
        failed = rec.phases(t0)
    finally:
        await load.stop()
        await rec.stop()
    _print_timeline("failed grow 4 -> 8 ranks, rolled back", failed, load.between(t0, t1))
    assert "a new rank failed to load" in st["lastError"] and st["targetDataParallel"] == 8
    assert "RollingBack" in [p[1] for p in failed]
    _known_states(rec, {4}, 4)
    assert load.between(t0, t1).get(200, 0) > 0
    obj = await world.get(NAME)
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "Resizing")
    assert cond["status"] == "False" and cond["reason"] == "ResizeFailed"
    # a resize from another address: no token, a wrong token -> refused by the pod's relay, nothing sent
    leader = next(p for p in world.kubelet.agent.pods.values() if p.name == "tiny-0")
    url = f"http://{leader.ip}:{leader.port}{k8s_names.ELASTIC_SCALE_PATH}"
    async with aiohttp.ClientSession() as http:
        for headers, code in (({}, 401), ({"Authorization": "Bearer guess"}, 403)):
            async with http.post(url, json={"op": "x", "new_data_parallel_size": 6}, headers=headers) as r:
                assert r.status == code, await r.text()
    assert "x" not in leader.elastic.relay.operations and group.dp == 4


async def test_elastic_operator_restart_mid_grow_resumes_from_status(elastic_world) -> None:
    world = elastic_world
    group = world.kubelet.agent.elastic.groups[(world.namespace, NAME)]
    group.faults.join_seconds = 3.0  # a slower join: the operator dies while vLLM prepares
    rec = Recorder(world)
    rec.start()
    try:
        t0 = time.time()
        await _scale(world, 4)

        async def preparing():
            st = await _elastic(world)
            return st if st.get("phase") == "Preparing" else None

        await eventually(preparing, timeout=60, interval=0.05, what="Preparing")
        await world.stop_operator(world.operators[0])
        await asyncio.sleep(1.0)
        await world.start_operator()
        # an embedded kopf that stops cancels every task started after it ("the loop is not fully
        # ours", kopf's running.py): the recorder too -- start it again
        rec.start()
        await _stable_at(world, 8)
        await asyncio.sleep(0.3)  # the recorder's next sample
        phases = rec.phases(t0)
    finally:
        await rec.stop()
    _known_states(rec, {4, 8}, 4)
    events = [e for _t, e, _d in group.history]
    assert events.count("preparing") == 1 and events.count("completed") == 1, group.history  # one operation
    assert [p[1] for p in phases][-1] == "Stable", phases
