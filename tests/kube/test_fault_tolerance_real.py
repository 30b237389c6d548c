"""Fault recovery on the REAL control plane with the REAL LeaderWorkerSet controller: the operator as
the orchestrator vLLM's fault tolerance waits for, against the simulated engines' side of vLLM's
protocol (:mod:`moe_eplb_harness.engines.fault_tolerance`, one data-parallel rank per pod) run by the
node agent (:mod:`moe_eplb_harness.real.ft_groups`).

A group of 4 pods (DP 4, EP 4, vLLM 0.34 flags, ``restartPolicy: None``), the clock 10x: a pod killed
mid-traffic is recovered by ``scale_down`` while the survivors serve, then restored at a planned
moment; a transient fault is recovered by ``retry`` (one failed on purpose), with vLLM's ``--api-key``
on and a stranger's round refused; a second fault during a round ends in a known state; an operator
restarted mid-recovery finishes the round it finds (no second round) after the lowest rank's loss
moved the store master. ``-k fault_tolerance`` selects them. Each prints its timeline."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.controller import recovery as rec
from moe_eplb.controller.control import read_token
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.real import ft_groups, lwscontroller
from moe_eplb_harness.real.controlplane import find_binaries
from tests.kube.conftest import tiny_resource
from tests.polling import eventually
from tests.require import missing

SCALE = 10.0  # simulated seconds per wall second
TIMING = {"detect_s": 4.0, "recover_s": 4.0}  # simulated: the survivors notice, the recovery runs


@pytest.fixture()
def built() -> None:
    if find_binaries() is None or lwscontroller.find_lws_binary() is None:
        missing("the control plane and the LWS controller are not built (run `make kube`)")


def _resource(replicas: int = 1, survive: int = 1, **engine) -> dict:
    res = tiny_resource("tiny", replicas=replicas)
    res["spec"]["engine"] = {"image": "vllm/vllm-openai:v0.34.0", **engine}
    res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 4, "all2allBackend": "deepep_low_latency"}
    # R >= k x (16 + R) / 4: 8 for one lost rank, 16 for two
    res["spec"]["eplb"]["numRedundantExperts"] = {1: 8, 2: 16}[survive]
    res["spec"]["faultTolerance"] = {"enabled": True, "rankFailuresToSurvive": survive, "recoveryTimeoutSeconds": 300}
    return res


def _world(real_control_plane, seed: int) -> SimWorld:
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=seed, shift_at=0.5)
    return SimWorld(workload=workload, api="real", lws="real", scale=SCALE, startup_seconds=20.0,
                    kubelet_poll=0.1, tick_seconds=0.2, api_ports=True, shared_plane=real_control_plane)


class Timeline:
    """What the test saw, every 0.1 s: the phase, the rounds, and the requests the engines served."""

    def __init__(self, world: SimWorld) -> None:
        self.world, self.t0, self.rows, self.task = world, time.monotonic(), [], None

    def served(self) -> tuple[int, int]:
        done = aborted = 0
        for e in self.world.kubelet.engines("tiny"):
            if e.ft is not None:
                d, a = e.ft.served()
                done, aborted = done + d, aborted + a
        return done, aborted

    def by_group(self) -> str:
        """Requests each group's running engine finished and aborted so far (``g0 120/12``)."""
        out = []
        for (_, _, gi), g in sorted(self.world.kubelet.agent.groups.items()):
            if g.engine is not None and g.engine.ft is not None:
                d, a = g.engine.ft.served()
                out.append(f"g{gi} {d}/{a}")
        return " ".join(out)

    async def _watch(self) -> None:
        while True:
            st = ((await self.world.get("tiny")).get("status") or {}).get("faultTolerance") or {}
            rounds = [f"{r.get('instruction') or '?'}:{r.get('state')}/{r.get('result') or '-'}" for r in st.get("rounds") or []]
            row = (round(time.monotonic() - self.t0, 1), st.get("phase", "Healthy"), tuple(rounds), self.by_group())
            if not self.rows or self.rows[-1][1:3] != row[1:3]:
                self.rows.append(row)
            await asyncio.sleep(0.1)

    def __enter__(self) -> Timeline:
        self.task = asyncio.create_task(self._watch())
        return self

    def __exit__(self, *exc) -> None:
        self.task.cancel()
        print("\n  wall s | sim s | phase      | rounds | requests finished/aborted per group's engine")
        for t, phase, rounds, served in self.rows:
            print(f"  {t:6.1f} | {t * SCALE:5.0f} | {phase:10} | {', '.join(rounds) or '-'} | {served}")


async def _status(world: SimWorld) -> dict:
    return ((await world.get("tiny")).get("status") or {})


async def _phase(world: SimWorld, phase: str, timeout: float = 60.0, what: str = "") -> dict:
    seen = {}

    async def check():
        st = await _status(world)
        seen["phase"] = (st.get("faultTolerance") or {}).get("phase", "Healthy")
        seen["condition"] = next((c.get("message") for c in st.get("conditions") or [] if c.get("type") == rec.CONDITION), None)
        return st if seen["phase"] == phase else None

    return await eventually(check, timeout=timeout, interval=0.1,
                            what=lambda: f"{what or f'phase {phase}'} (phase {phase} awaited; last seen: {seen})")


async def _serving(world: SimWorld, pods: int) -> None:
    async def check():
        ps = [p for p in await world.cluster.list(f"/api/v1/namespaces/{world.namespace}/pods", "eplb.ai/name=tiny")
              if not p["metadata"].get("deletionTimestamp")]
        ready = [p for p in ps if any(c["type"] == "Ready" and c["status"] == "True"
                                      for c in (p.get("status") or {}).get("conditions") or [])]
        engines = world.kubelet.engines("tiny")
        return len(ready) == pods and engines and all(e.ft is not None and e.ft.serving() for e in engines)

    await eventually(check, timeout=90, interval=0.1, what=f"{pods} pods ready and serving")


async def _events(world: SimWorld) -> list[str]:
    return [e["reason"] for e in sorted(await world.cluster.list(f"/api/v1/namespaces/{world.namespace}/events"),
                                        key=lambda e: e.get("lastTimestamp") or "")
            if (e.get("involvedObject") or {}).get("kind") == "MoEInference"]


async def test_fault_tolerance_a_pod_killed_mid_traffic_is_scaled_down_survivors_serve_and_it_is_restored(
        built, real_control_plane) -> None:
    world = _world(real_control_plane, seed=21)
    async with world.run():
        world.kubelet.agent.ft_timing = dict(TIMING)
        await world.start_operator()
        await world.apply(_resource(replicas=2))
        await _serving(world, 8)
        ns = world.namespace
        with Timeline(world) as tl:
            await asyncio.sleep(1.0)
            served_before = tl.served()[0]
            # a node fails: its pod goes at once (no drain); LWS (restartPolicy None) replaces only it
            await world.cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/tiny-0-2",
                                        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            st = await _phase(world, "Restoring", timeout=60, what="scale_down, then the planned restart")
            ft = st["faultTolerance"]
            (rnd,) = [r for r in ft["rounds"] if r["group"] == "0"]
            assert rnd["instruction"] == "scale_down" and rnd["result"] == "Succeeded"
            assert rnd["removedRanks"] == [2] and rnd["ranks"] == [0, 1, 3] and sorted(rnd["sentTo"]) == [0, 1, 3]
            assert "storeMaster" not in rnd  # rank 0 lived
            degraded = [row for row in tl.rows if row[1] == "Degraded"]
            assert degraded, tl.rows  # the survivors served on 3 of 4 ranks before the restart
            await _phase(world, "Healthy", timeout=90, what="the group restored")
            await _serving(world, 8)
        served_after = tl.served()[0]
        assert served_after > served_before
        reasons = await _events(world)
        for r in ("FaultDetected", "RecoveryRoundSent", "RecoveryRoundSucceeded", "RecoveryDegraded",
                  "RestoreStarted", "RecoveryRestored"):
            assert r in reasons, reasons
        cond = next(c for c in (await _status(world))["conditions"] if c["type"] == rec.CONDITION)
        assert cond["status"] == "True"


async def test_fault_tolerance_a_transient_fault_is_retried_behind_vllms_api_key(built, real_control_plane) -> None:
    world = _world(real_control_plane, seed=22)
    async with world.run():
        world.kubelet.agent.ft_timing = dict(TIMING)
        op = await world.start_operator()
        await world.apply(_resource(extraArgs=["--api-key", "user-key"]))
        await _serving(world, 4)
        ns, agent = world.namespace, world.kubelet.agent
        (engine,) = world.kubelet.engines("tiny")
        token = await read_token(op["controller"].client, ns, "tiny")
        assert engine.ft.cfg.api_keys == (token, "user-key")  # the operator's token joined the user's key
        # a round from another pod's address without one of vLLM's keys is refused (401), nothing changes
        stranger = agent._next_ip(None)
        url = f"http://{engine.hosts[1]}:8000{ftp.apply_path((0, 34, 0))}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(stranger, 0))) as s:
            async with s.post(url, json=ftp.apply_body("retry", "intruder")) as r:
                assert r.status == 401 and (await r.json()) == {"error": "Unauthorized"}
        with Timeline(world) as tl:
            ft_groups.fault(agent, ns, "tiny", fail_retries=1)

            async def retried():
                st = await _status(world)
                ft = st.get("faultTolerance") or {}
                done = [r for r in ft.get("rounds") or [] if r.get("result") == "Succeeded"]
                return st if done and ft.get("phase") == "Healthy" else None

            st = await eventually(retried, timeout=60, interval=0.1, what="retried to health")
            await asyncio.sleep(0.5)
        rounds = st["faultTolerance"]["rounds"]
        assert [(r["instruction"], r["result"]) for r in rounds] == [("retry", "Failed"), ("retry", "Succeeded")]
        assert "Recovery vote failed" in rounds[0]["reason"] and rounds[1]["attempt"] == 2
        assert st["faultTolerance"]["lostRanks"] == [] and engine.ft.dead == set()
        assert tl.served()[0] > 0


async def test_fault_tolerance_a_second_fault_during_a_round_ends_in_a_restarted_group(built, real_control_plane) -> None:
    world = _world(real_control_plane, seed=23)
    async with world.run():
        world.kubelet.agent.ft_timing = {"detect_s": 4.0, "recover_s": 40.0}  # a long vote to fault into
        await world.start_operator()
        await world.apply(_resource(survive=2))
        await _serving(world, 4)
        ns = world.namespace
        with Timeline(world):
            await world.cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/tiny-0-2",
                                        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})

            async def sent():
                ft = (await _status(world)).get("faultTolerance") or {}
                return any(r.get("state") == "Sent" and not r.get("finishedAt") for r in ft.get("rounds") or [])

            await eventually(sent, timeout=60, interval=0.05, what="the round sent")
            # the second fault: pod 3 goes while the survivors vote (vLLM: the scale_down vote fails, dead)
            await world.cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/tiny-0-3",
                                        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
            await _phase(world, "Restoring", timeout=60, what="the failed group restarted")
            st = await _status(world)
            await _phase(world, "Healthy", timeout=90, what="the group whole again")
            await _serving(world, 4)
        (first, *more) = st["faultTolerance"]["rounds"]
        assert first["instruction"] == "scale_down" and first["removedRanks"] == [2]
        assert first["result"] in ("Superseded", "Failed"), first
        reasons = await _events(world)
        assert "RestoreStarted" in reasons and "RecoveryRestored" in reasons, reasons


async def test_fault_tolerance_an_operator_restarted_mid_recovery_finishes_the_round_it_finds(
        built, real_control_plane) -> None:
    world = _world(real_control_plane, seed=24)
    async with world.run():
        world.kubelet.agent.ft_timing = {"detect_s": 4.0, "recover_s": 30.0}
        op = await world.start_operator()
        await world.apply(_resource())
        await _serving(world, 4)
        ns, agent = world.namespace, world.kubelet.agent
        (engine,) = world.kubelet.engines("tiny")
        with Timeline(world) as tl:
            # the leader's engine process dies (its container restarts in place): rank 0, the store master
            ft_groups.kill_engine(agent, ns, "tiny-0")

            async def sent():
                ft = (await _status(world)).get("faultTolerance") or {}
                live = [r for r in ft.get("rounds") or [] if r.get("state") == "Sent" and not r.get("finishedAt")]
                return live[0] if live and live[0].get("sentTo") else None

            rnd = await eventually(sent, timeout=60, interval=0.05, what="the round sent")
            await world.stop_operator(op)  # killed mid-round
            assert rnd["removedRanks"] == [0] and rnd["storeMaster"] == f"{engine.hosts[1]}:{rec.STORE_PORT}"
            await asyncio.sleep(1.5)
            await world.start_operator()
            await _phase(world, "Degraded", timeout=60, what="the round finished by the new operator")
        ft = (await _status(world))["faultTolerance"]
        assert [r["requestId"] for r in ft["rounds"]] == [rnd["requestId"]]  # no second round
        assert ft["rounds"][0]["result"] == "Succeeded" and ft["lostRanks"][0]["ranks"] == [0]
        assert engine.ft.dead == {0} and engine.ft.serving() and tl.served()[0] > 0
        # a single group is not restarted under its traffic: the condition says what it waits for

        async def waits():
            cond = next((c for c in (await _status(world)).get("conditions") or [] if c["type"] == rec.CONDITION), {})
            return cond if "no other replica group is ready" in cond.get("message", "") else None

        cond = await eventually(waits, timeout=30, interval=0.1, what="the condition naming what the restart waits for")
        assert cond["status"] == "False" and cond["reason"] == "Degraded" and "1 rank(s) lost [0]" in cond["message"]
        assert (await _status(world))["faultTolerance"]["phase"] == "Degraded"  # still: not restarted
