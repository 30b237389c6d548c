"""Window and interval changed LIVE on a REAL vLLM engine, on both EP ranks at one engine step, under
traffic, with no restart and no request lost (vLLM on CPU with the test bridge).

One engine (the "full" MoEInference of :func:`moe_eplb_harness.vllm_engine.harness.manifest`, window
24 / interval 100, vLLM's ``logBalancedness`` on: rank 0 then logs, at every step, vLLM's
rearrangement counter and the steps left to the next rearrangement, i.e. the interval vLLM itself
uses at that step). Requests run in the background the whole time. The operator's own code
(:func:`moe_eplb.controller.live.apply_live`, with the control token the pod mounts) sends, in turn:

* a request without the token (refused, nothing changed);
* a command for a step already past (every rank refuses, the change is called off);
* a command while one EP rank's worker is frozen (SIGSTOP: it does not answer; called off);
* a command to a resource one of whose pods runs a plugin without live apply (a second exporter
  process over the same engine with ``MOE_EPLB_LIVE_APPLY=off``: it answers 404 on the route, as a
  plugin that predates live apply does, so the change is refused before any pod is told);
* the change itself: window 24 -> 48, interval 100 -> 60.

Each failure ends with the previous values on every rank and a reason; the change ends with both
ranks on the new values from the agreed step, and vLLM's own log lines show the interval it used
at every step switching exactly there, its rearrangements following the new interval from there on
each rank (the exporter's per-rank rearrangement steps agree with vLLM's counter).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.contracts import live_protocol as lp
from moe_eplb.contracts import metric_names
from moe_eplb.controller.live import LivePod, apply_live
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.vllm_engine import harness

from .conftest import record_note, record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

WINDOW, INTERVAL = 24, 100
NEW_WINDOW, NEW_INTERVAL = 48, 60
TOKEN = "live-apply-test-token"
#: vLLM 0.32's rank-0 line with log_balancedness (eplb_state.py ``step``): the counter before the
#: step's increment, and the steps left to the next rearrangement (interval - counter)
STEP_LINE = re.compile(r"EPLB step: (?P<counter>\d+) for model .+?: avg_tokens=[\d.]+, max_tokens=\d+, "
                       r"balancedness=[\d.]+, steps until the next rearrangement: (?P<left>-?\d+)")


def _manifest() -> dict:
    res = harness.manifest("full")
    res["metadata"]["name"] = "tiny-live"
    res["spec"]["eplb"].update(windowSize=WINDOW, stepInterval=INTERVAL, logBalancedness=True)
    return res


class Traffic:
    """Requests in the background until stopped: every one must complete with all its tokens."""

    def __init__(self, engine: harness.Engine, concurrency: int = 4, max_tokens: int = 48) -> None:
        self.engine, self.max_tokens = engine, max_tokens
        self.stop_event = threading.Event()
        self.done, self.errors = [], []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = 0
        while not self.stop_event.is_set():
            prompt = harness.PROMPTS[(i + k) % len(harness.PROMPTS)]
            k += 1
            try:
                out = self.engine.complete(prompt, self.max_tokens, timeout=300)
                self.done.append(out["usage"]["completion_tokens"])
            except Exception as exc:  # noqa: BLE001 - a lost request: reported by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(300)


@pytest.fixture(scope="module")
def live_pod(cpu_wheel, tiny_model, bridge_dir, engine_root):
    work = os.path.join(engine_root, "live")
    os.makedirs(work, exist_ok=True)
    rendered = harness.render(_manifest(), work)
    token_file = os.path.join(work, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN)
    # the rendered MOE_EPLB_CONTROL_TOKEN_FILE names the Secret's mount; here a local file
    engine = harness.Engine(rendered, tiny_model, bridge_dir, work, extra_env={"MOE_EPLB_CONTROL_TOKEN_FILE": token_file})
    try:
        engine.start(timeout=3 * harness.START_TIMEOUT)  # ~30 s on two free cores; a shared machine is slower
        record_time("live-apply engine: start until /health (s)", engine.ready_seconds)
        engine.complete("warm up", 4, timeout=600)
        yield engine
    finally:
        engine.stop()


def _settings(engine: harness.Engine, port: int | None = None) -> list[lp.RankStatus]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port or engine.exporter_port}{lp.PATH}", timeout=10) as resp:
        return [lp.RankStatus.from_mapping(r) for r in json.loads(resp.read())["ranks"]]


def _wait_steps(engine: harness.Engine, step: int, timeout: float = 240.0) -> list[lp.RankStatus]:
    deadline = time.monotonic() + timeout
    while True:
        ranks = _settings(engine)
        if len(ranks) == 2 and min(r.step for r in ranks) >= step:
            return ranks
        assert time.monotonic() < deadline, f"the engine did not reach step {step}: {ranks}"
        time.sleep(0.2)


def _unchanged(engine: harness.Engine) -> list[lp.RankStatus]:
    ranks = _settings(engine)
    assert [(r.ep_rank, r.window_size, r.step_interval, r.since_step) for r in ranks] == [
        (0, WINDOW, INTERVAL, 0), (1, WINDOW, INTERVAL, 0)], ranks
    return ranks


def _old_plugin_exporter(engine: harness.Engine) -> tuple[subprocess.Popen, int]:
    """A second exporter process over the engine's directory, started with live apply off: on the
    route it answers what a plugin without live apply answers (404)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_EPLB_")}
    env.update(MOE_EPLB_EXPORTER_DIR=engine.exporter_dir, MOE_EPLB_EXPORTER_PORT=str(port),
               MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1", MOE_EPLB_LIVE_APPLY="off",
               PYTHONPATH=os.pathsep.join([harness.OPERATOR_DIR, env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "moe_eplb.exporter.server"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the second exporter did not start")


def _vllm_steps(log: str) -> list[tuple[int, int]]:
    """(counter, interval in force) of every step vLLM's rank 0 logged, in step order."""
    return [(int(m["counter"]), int(m["counter"]) + int(m["left"])) for m in STEP_LINE.finditer(log)]


def test_live_apply_changes_window_and_interval_on_every_rank_at_one_step(live_pod):
    engine = live_pod
    pod = LivePod("tiny-live-0", f"http://127.0.0.1:{engine.exporter_port}", "tiny-live-0", 2)
    pid_before = engine.proc.pid
    traffic = Traffic(engine)
    t0 = time.monotonic()
    try:
        _wait_steps(engine, 50)
        before = _unchanged(engine)

        # 1. no token: refused before anything is read; nothing changed
        req = urllib.request.Request(pod.url + lp.PATH, data=b'{"op": "prepare"}', method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401 and "Authorization: Bearer" in json.loads(err.value.read())["error"]
        assert all(not r.command for r in _unchanged(engine))

        # 2. a step already past: every rank refuses, the change is called off
        past = asyncio.run(apply_live([pod], TOKEN, Knobs(NEW_WINDOW, NEW_INTERVAL, 2), Knobs(WINDOW, INTERVAL, 2),
                                      at_step=1))
        assert not past.ok and "already past" in past.reason and "called off on every rank" in past.reason, past
        assert {r.command["state"] for r in _unchanged(engine)} == {lp.REFUSED}

        # 3. one EP rank does not answer (its worker frozen): called off; the other rank aborted
        frozen = next(r.pid for r in before if r.ep_rank == 1)
        os.kill(frozen, signal.SIGSTOP)
        try:
            stuck = asyncio.run(apply_live([pod], TOKEN, Knobs(NEW_WINDOW, NEW_INTERVAL, 2),
                                           Knobs(WINDOW, INTERVAL, 2), answer_seconds=3.0))
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert not stuck.ok and "EP rank 1 (pod tiny-live-0) did not answer" in stuck.reason, stuck
        time.sleep(1.0)  # rank 1 reads the command file again: it holds an abort of a command it never took
        states = {r.ep_rank: r.command.get("state") for r in _unchanged(engine)}
        assert states[0] == lp.ABORTED and states[1] != lp.ARMED, states

        # 4. a pod whose plugin has no live apply: refused before any pod is told
        old, old_port = _old_plugin_exporter(engine)
        try:
            seen = {r.ep_rank: r.command.get("id") for r in _settings(engine)}
            mixed = asyncio.run(apply_live([pod, LivePod("old-plugin-0", f"http://127.0.0.1:{old_port}",
                                                         "old-plugin-0", 2)],
                                           TOKEN, Knobs(NEW_WINDOW, NEW_INTERVAL, 2), Knobs(WINDOW, INTERVAL, 2)))
        finally:
            old.terminate()
            old.wait(30)
        assert not mixed.ok and "pod old-plugin-0's exporter has no live-apply route" in mixed.reason, mixed
        assert {r.ep_rank: r.command.get("id") for r in _unchanged(engine)} == seen  # no command reached it

        # 5. the change
        t_apply = time.monotonic()
        done = asyncio.run(apply_live([pod], TOKEN, Knobs(NEW_WINDOW, NEW_INTERVAL, 2), Knobs(WINDOW, INTERVAL, 2)))
        record_time("live-apply engine: apply_live (prepare, commit, confirm) (s)", time.monotonic() - t_apply)
        assert done.ok, done
        at = done.step
        ranks = _wait_steps(engine, at + 3 * NEW_INTERVAL + 2)
    finally:
        traffic.stop()
    record_time("live-apply engine: traffic (s)", time.monotonic() - t0)
    assert not traffic.errors, traffic.errors[:3]
    assert traffic.done and set(traffic.done) == {48}, "a request came back short"
    assert engine.proc is not None and engine.proc.pid == pid_before and engine.proc.poll() is None  # no restart

    # both ranks: the new values from the agreed step, and the same rearrangement steps
    assert [(r.ep_rank, r.window_size, r.step_interval, r.since_step, r.source, r.command["state"]) for r in ranks] == [
        (0, NEW_WINDOW, NEW_INTERVAL, at, lp.SOURCE_LIVE, lp.APPLIED), (1, NEW_WINDOW, NEW_INTERVAL, at, lp.SOURCE_LIVE,
                                                                        lp.APPLIED)], ranks
    assert ranks[0].rearranged_at == ranks[1].rearranged_at

    # vLLM's own lines (rank 0, one per step): the interval it used switches at the agreed step
    log = engine.log()
    steps = _vllm_steps(log)
    assert len(steps) > at + 3 * NEW_INTERVAL, len(steps)
    used = [interval for _, interval in steps]
    assert set(used[:at]) == {INTERVAL} and set(used[at:]) == {NEW_INTERVAL}, (used[at - 2:at + 2], at)
    # vLLM rearranged where its counter reached the interval in force: each step whose logged counter
    # is interval - 1 (the increment then reaches it); the exporter counted the same steps on each rank
    vllm_rearranged = [k for k, (c, i) in enumerate(steps) if c + 1 >= i]
    kept = [s for s in vllm_rearranged if s >= ranks[0].rearranged_at[0]]
    assert kept[:len(ranks[0].rearranged_at)] == list(ranks[0].rearranged_at), (vllm_rearranged, ranks[0].rearranged_at)
    after = [s for s in vllm_rearranged if s >= at]
    counter_at = steps[at][0]
    assert after[:3] == [at + NEW_INTERVAL - 1 - counter_at + k * NEW_INTERVAL for k in range(3)], (after, counter_at)
    before_at = [s for s in vllm_rearranged if s < at]
    assert all(b - a == INTERVAL for a, b in zip(before_at, before_at[1:]))
    # each rank logged the change, with the window's counts all kept (24 -> 48 steps)
    lines = [ln for ln in log.splitlines() if "moe-eplb live: EP rank" in ln and "in force from engine step" in ln]
    assert len(lines) == 2 and all(f"from engine step {at}" in ln for ln in lines), lines
    for ln in lines:
        kept_counts = re.search(r"window counts kept (\d+)/(\d+)", ln)
        assert kept_counts and kept_counts[1] == kept_counts[2], ln
    # the exporter's series: per rank, and moe_eplb_config_info shows what runs
    exp = harness.Samples(engine.exporter_text())
    for r in (0, 1):
        assert exp.value(metric_names.SETTINGS_STEP_INTERVAL, rank=r) == NEW_INTERVAL
        assert exp.value(metric_names.SETTINGS_WINDOW_SIZE, rank=r) == NEW_WINDOW
        assert exp.value(metric_names.SETTINGS_SINCE_STEP, rank=r) == at
    (info,) = exp.select(metric_names.CONFIG_INFO)
    assert (info[0]["window_size"], info[0]["step_interval"]) == (str(NEW_WINDOW), str(NEW_INTERVAL))
    record_note("live apply", f"agreed step {at} (vLLM's counter {counter_at}); vLLM rearranged at {before_at[-3:]} "
                              f"(every {INTERVAL}) then {after[:4]} (every {NEW_INTERVAL}); exporter, each rank: "
                              f"{list(ranks[0].rearranged_at)[-6:]}; {len(traffic.done)} requests, none lost")
