"""The HTTP contract of a resize is vLLM's own code: vLLM 0.34's elastic EP router
(``entrypoints/serve/elastic_ep/api_router.py`` of the release's extracted sources, served by uvicorn in a
child process: tests/controller/elastic_router_child.py), with the harness's simulated ranks behind it as
its ``EngineClient``. Driven here by the product's relay (:mod:`moe_eplb.exporter.elastic_relay`), read by
the operator's :func:`moe_eplb.controller.elastic.rank_report` and decided by its state machine:

- the paths, bodies, status codes and phase names the operator relies on, as vLLM's router answers them
  (a bad body 400 with vLLM's words, above ``--elastic-ep-max-dp-size`` 400, a new rank that never comes
  408 -- vLLM maps its prepare timeout to the drain-timeout answer --, a failure 500 "Scale failed" with
  the reason only in the store, ``/is_scaling_elastic_ep``'s five keys);
- a grow 4 -> 6 ranks through two pods' relays, followed by the state machine to ``Stable`` at 6;
- the harness's own HTTP (what the kube tier runs) answers every one of these requests as vLLM's router does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from moe_eplb.api import elastic as el
from moe_eplb.api.elastic import ElasticStatus
from moe_eplb.controller import elastic_plan as plan
from moe_eplb.controller.elastic import rank_report
from moe_eplb.exporter.elastic_relay import ElasticRelay
from moe_eplb_harness.engines.elastic import ElasticFaults, ElasticGroup, route
from tests import ROOT
from tests.vllm_sources import vllm_source_root

pytestmark = pytest.mark.integration

VERSION = "0.34.0"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root, why = vllm_source_root(VERSION)
    if root is None:
        pytest.skip(why)
    port_file = tmp_path_factory.mktemp("router") / "ports.json"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(root), str(ROOT / "operator"), str(ROOT / "harness"), str(ROOT)]))
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "controller" / "elastic_router_child.py"),
                              str(port_file)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600  # importing a release's vLLM on a loaded 2-core machine takes a while
        while not port_file.exists() or not port_file.read_text():
            if child.poll() is not None:
                pytest.fail("the router child ended: " + child.stdout.read().decode()[-3000:])
            if time.time() > deadline:
                pytest.fail("the router child did not start")
            time.sleep(0.2)
        info = json.loads(port_file.read_text())
        yield {int(k): v for k, v in info["ranks"].items()}, info
    finally:
        child.terminate()
        child.wait(10)


def call(url: str, body: object = None, content_type: str = "application/json") -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data if data is not None else b"", method="POST",
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_the_router_is_the_releases(router) -> None:
    _urls, info = router
    assert info["vllm"] == VERSION and "vllm-src/0.34.0/vllm/entrypoints/serve/elastic_ep/api_router.py" in info["router"]


def test_phase_names_and_the_redundancy_rule_are_vllms(router) -> None:
    """``ExternalElasticEPScalePhase`` and ``_calculate_num_redundant_experts`` run in the release's own code
    (the child): the operator's names and :func:`moe_eplb.api.elastic.redundancy_at` agree case by case."""
    _urls, info = router
    assert tuple(info["phases"]) == el.VLLM_PHASES
    for experts, redundant, cur, new, theirs in info["redundancy"]:
        try:
            ours = el.redundancy_at(experts, redundant, cur, new)
        except el.ElasticError:
            assert isinstance(theirs, str) and "cannot retain all model experts" in theirs, theirs
            continue
        assert ours == theirs, (experts, redundant, cur, new)


BAD_BODIES = [({}, "new_data_parallel_size is required"),
              ({"new_data_parallel_size": 0}, "new_data_parallel_size must be a positive integer"),
              ({"new_data_parallel_size": "8"}, "new_data_parallel_size must be a positive integer"),
              ({"new_data_parallel_size": 6, "drain_timeout": 0}, "drain_timeout must be a positive integer"),
              ({"new_data_parallel_size": 16}, "--elastic-ep-max-dp-size is 8")]


def test_refusals_status_codes_and_words_are_vllms_and_the_harness_answers_alike(router) -> None:
    urls, _ = router
    sim = ElasticGroup(("t", "parity"), launch=4, data_local=2, max_data=8, experts=16, redundant=0,
                       faults=ElasticFaults(launch_seconds=0.0))
    sim.attach("a", (0, 1, 2, 3), founder=True)
    while sim.dp is None:
        time.sleep(0.02)
    for body, words in BAD_BODIES:
        code, answer = call(urls[0] + el.SCALE_PATH, body)
        assert code == 400 and words in answer["detail"], (body, code, answer)
        assert route(sim, 0, "POST", el.SCALE_PATH, json.dumps(body).encode()) == (code, answer), body
    code, answer = call(urls[0] + el.SCALE_PATH, b"{not json")
    assert (code, answer) == (400, {"detail": "Invalid JSON format"})
    code, answer = call(urls[0] + el.STATUS_PATH)
    assert code == 200 and answer == {"is_scaling_elastic_ep": False, "phase": "idle", "epoch": None, "error": None,
                                      "requested_data_parallel_size": None}
    assert route(sim, 0, "POST", el.STATUS_PATH, b"") == (code, answer)
    sim.close()


def relays(urls: dict[int, str], pods: int) -> list[ElasticRelay]:
    """The relay of each pod of 2 ranks (as an engine pod's exporter runs it, here reaching vLLM's router)."""
    return [ElasticRelay((urls[2 * i], urls[2 * i + 1])) for i in range(pods)]


def follow(rs: list[ElasticRelay], op: str, timeout: float = 60.0) -> tuple[list[plan.RankReport], list[str]]:
    phases: list[str] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        reports = [rank_report(r.status(), op) for r in rs]
        if reports[0].phase and (not phases or phases[-1] != reports[0].phase):
            phases.append(reports[0].phase)
        if all(r.op_state == plan.DONE for r in reports):
            reports = [rank_report(r.status(), op) for r in rs]  # the store's phase once every rank answered
            if phases[-1:] != [reports[0].phase]:
                phases.append(reports[0].phase)
            return reports, phases
        time.sleep(0.05)
    raise AssertionError(f"{op} did not end: {phases}")


def test_grow_timeout_then_grow_then_failed_shrink_through_the_relays(router) -> None:
    urls, _ = router
    old = relays(urls, 2)
    # 4 -> 8: ranks 6-7 never start, vLLM's prepare times out; its router answers 408 (the drain words)
    for r in old:
        assert r.scale({"op": "dp8-1", "new_data_parallel_size": 8, "drain_timeout": 30})[0] == 202
    reports, phases = follow(old, "dp8-1")
    assert {(r.op_code, r.op_detail) for r in reports} == {(408, "Scale failed due to request drain timeout after 30 seconds")}
    assert reports[0].phase == "failed" and "Timed out waiting for external Elastic EP ranks" in reports[0].error
    assert reports[0].serving is None  # no /v1/models on this router: neither serving nor paused
    # the state machine: a failure with the old ranks not paused rolls back
    view = plan.ElasticView(desired=8, launch=4, data_local=2, founders_expected=2,
                            founders=(plan.PodState("p0", ready=True, running=True),
                                      plan.PodState("p1", ready=True, running=True)),
                            reports={"p0": reports[0], "p1": reports[1]}, now=10.0, since=0.0)
    step = plan.advance(ElasticStatus(4, 8, el.PREPARING), view)
    assert step.status.phase == el.ROLLING_BACK and "408" in step.status.last_error

    # 4 -> 6: ranks 4-5 joined; every old rank answers 200 once vLLM committed
    for r in old:
        r.scale({"op": "dp6-2", "new_data_parallel_size": 6})
    reports, phases = follow(old, "dp6-2")
    assert {r.op_code for r in reports} == {200}
    assert phases[-1] == "completed" and "committing" in phases
    assert (reports[0].requested, reports[0].error) == (6, None) and reports[0].epoch
    view = plan.ElasticView(desired=6, launch=4, data_local=2, founders_expected=2,
                            founders=view.founders, joiners=(plan.PodState("p2", ordinal=0, running=True),),
                            reports={"p0": reports[0], "p1": reports[1]}, now=10.0, since=0.0)
    step = plan.advance(ElasticStatus(4, 6, el.COMMITTING), view)
    assert step.status == ElasticStatus(6, 6, el.STABLE, epoch=reports[0].epoch)

    # 6 -> 4 with a failure in prepare: every rank answers 500 "Scale failed"; the reason is in the store
    assert call(urls[0] + "/_sim/faults", {"fail_at": "preparing", "error": "boom"})[0] == 200
    three = relays(urls, 3)
    for r in three:
        r.scale({"op": "dp4-3", "new_data_parallel_size": 4})
    reports, _ = follow(three, "dp4-3")
    assert {(r.op_code, r.op_detail) for r in reports} == {(500, "Scale failed")}
    assert (reports[0].phase, reports[0].error, reports[0].requested) == ("failed", "boom", 4)
