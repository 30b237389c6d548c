"""Experiments with the real operator (``spec.autotune.experiments``): a change runs on one replica
(the trial arm: a second Deployment behind the same Service, or a LeaderWorkerSet's highest group by
its ``partition``) while the other keeps the running settings (the control arm), on the same
traffic, and is promoted or discarded on the objective measured from the pods' metrics -- after a
pre-period in which the pods' own differences are measured on the running settings (the cross-pod
design: the simulated engines cannot take settings live, so nothing runs interleaved here). Each
scenario runs on a Deployment and a LeaderWorkerSet, on the emulated API and on the real control
plane, and checks that the ready serving replicas (trial included) never drop below the floor
``replicas - maxUnavailable``."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.engines.physics import TrueCost

from .conftest import NAME, SCALE, START, autotune_status, events, resource, running_settings, wait_for

pytestmark = pytest.mark.integration

START_KNOBS = (START["windowSize"], START["stepInterval"], START["numRedundantExperts"])


def _knobs(s) -> tuple:
    return (s.knobs.window_size, s.knobs.step_interval, s.num_redundant_experts)


def _world(workload, **kw) -> SimWorld:
    kw.setdefault("scale", SCALE)
    kw.setdefault("startup_seconds", 60.0)
    kw.setdefault("tick_seconds", 0.2)
    return SimWorld(workload=workload, **kw)


def _resource(kind: str, **experiments) -> dict:
    res = resource(kind)
    # judged time for at least 2 batches of 8 buckets even where a loaded machine stretches the
    # loop's ticks (20 s of simulated time when it keeps up)
    res["spec"]["autotune"]["experiments"] = {"enabled": True, "minSeconds": 300, "maxSeconds": 1800,
                                              "confidence": 0.9, "baselineSeconds": 600, "warmupSeconds": 120,
                                              **experiments}
    return res


@contextlib.asynccontextmanager
async def _capacity(world, seen: list[int]):
    """Record the ready serving replicas (the MoEInference's status.readyReplicas, which counts the
    trial's) every 50 ms once the resource first had both ready."""
    async def watch():
        while True:
            r = await world.get(NAME) or {}
            ready = (r.get("status") or {}).get("readyReplicas")
            if ready == 2 or seen:
                seen.append(int(ready or 0))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def _done(r) -> dict | None:
    at = autotune_status(r)
    return (at.get("experiments") or [None])[-1] if not at.get("experiment") else None


async def test_trial_promoted(workload, kind, api, plane):
    # quiet engines (0.5 % step noise, no outlier buckets): this scenario checks the operator's way
    # from a winning trial to every replica running it; how often the judge promotes a true gain in
    # a cluster's noise is bench/bench_experiments.py's question (docs/tuner.md)
    world = _world(workload, api=api, shared_plane=plane, true_cost=TrueCost(step_noise=0.005, outlier_share=0.0))
    seen: list[int] = []
    async with world.run():
        await world.start_operator()
        await world.apply(_resource(kind))
        async with _capacity(world, seen):
            started = await wait_for(world, lambda r: autotune_status(r).get("experiment") and r, timeout=40)
            assert autotune_status(started)["lastEvaluation"]["decision"] == "Experiment"
            assert autotune_status(started)["experiment"]["phase"] == "Baseline"
            assert running_settings(world) == {START_KNOBS}  # the pre-period restarts nothing
            running = await wait_for(world, lambda r: (autotune_status(r).get("experiment") or {}).get("phase")
                                     == "Running" and r, timeout=40)
            exp = autotune_status(running)["experiment"]
            trial = exp["trial"]["knobs"]
            want = (trial["windowSize"], trial["stepInterval"], trial["numRedundantExperts"])
            # both arms serve side by side, on the same traffic
            assert running_settings(world) == {want, START_KNOBS}
            done = await wait_for(world, _done, timeout=90)
        assert done["verdict"] == "promoted", repr({k: v for k, v in done.items() if k not in ("control", "trial")})
        # the sequential interval beat the restart charge
        assert done["outcome"] == "wins" and done["ciLow"] > done["restartCharge"], done["reason"]
        assert done["design"] == "cross-pod" and done["looks"], done
        assert set(done["observations"]) == {"trial", "control"}
        final = await wait_for(world, lambda r: running_settings(world) == {want} and r, timeout=30)
        assert final["status"]["eplb"] == {"enabled": True, **trial}
        assert min(seen) >= 1, seen
        reasons = [e["reason"] for e in await events(world)]
        assert {"ExperimentStarted", "ExperimentRunning", "ExperimentPromoted"} <= set(reasons)


async def test_trial_discarded(workload, kind, api, plane):
    from moe_eplb_harness.engines.engine import EngineFaults

    # the trial's settings run with a broken expert map (hot experts packed together): slower steps
    world = _world(workload, api=api, shared_plane=plane,
                   faults_for=lambda s: EngineFaults(clustered_placement=_knobs(s) != START_KNOBS))
    seen: list[int] = []
    async with world.run():
        await world.start_operator()
        await world.apply(_resource(kind))
        async with _capacity(world, seen):
            done = await wait_for(world, _done, timeout=120)
        assert done["verdict"] == "discarded", done
        assert done["outcome"] == "loses" and done["ciHigh"] < 0, done
        assert "override" not in autotune_status(await world.get(NAME))
        await wait_for(world, lambda r: running_settings(world) == {START_KNOBS}, timeout=30)
        assert min(seen) >= 1, seen


async def test_trial_ended_by_a_scale_in(workload, kind, api, plane):
    world = _world(workload, api=api, shared_plane=plane)
    seen: list[int] = []
    async with world.run():
        await world.start_operator()
        await world.apply(_resource(kind, minSeconds=3000, maxSeconds=6000))
        async with _capacity(world, seen):
            await wait_for(world, lambda r: (autotune_status(r).get("experiment") or {}).get("phase") == "Running",
                           timeout=60)
            await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME) + "/scale",
                                      {"spec": {"replicas": 1}})
            done = await wait_for(world, _done, timeout=60)
        assert done["verdict"] == "discarded" and "scale-in" in done["reason"], done
        await wait_for(world, lambda r: running_settings(world) == {START_KNOBS}
                       and (r.get("status") or {}).get("readyReplicas") == 1, timeout=40)
        assert min(seen) >= 1, seen


async def test_trial_crash_loop_ends_it(workload, kind, api, plane):
    if kind == "LeaderWorkerSet":
        world = _world(workload, api=api, shared_plane=plane,
                       crash_pod_if=lambda s, worker: worker == 1 and _knobs(s) != START_KNOBS)
    else:
        world = _world(workload, api=api, shared_plane=plane, crash_if=lambda s: _knobs(s) != START_KNOBS)
    seen: list[int] = []
    async with world.run():
        await world.start_operator()
        await world.apply(_resource(kind))
        async with _capacity(world, seen):
            done = await wait_for(world, _done, timeout=90)
        assert done["verdict"] == "discarded" and "crash-loops" in done["reason"], done
        assert "override" not in autotune_status(await world.get(NAME))
        await wait_for(world, lambda r: running_settings(world) == {START_KNOBS}
                       and (r.get("status") or {}).get("readyReplicas") == 2, timeout=40)
        assert min(seen) >= 1, seen
        assert any(e["reason"] == "ExperimentDiscarded" and e["type"] == "Warning" for e in await events(world))
