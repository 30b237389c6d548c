"""Live apply of window and interval against vLLM's REAL ``EplbState`` (the installed 0.32 wheel;
tests/test_vllm_sources.py runs this module again on 0.33's and 0.34's sources).

The worker's side (:mod:`moe_eplb.exporter.live`) through the hook, as in a worker: commands taken,
applied before vLLM's step of the agreed number, vLLM's own ``step()`` then rearranging on the new
interval, the window resized with its counts; the pod's side (:mod:`moe_eplb.exporter.live_control`)
over the real files with the watcher thread running while the engine steps.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from moe_eplb.contracts import live_protocol as lp
from moe_eplb.exporter import hook, live_control
from moe_eplb.exporter.live import LiveWorker, read_startup_file
from moe_eplb.exporter.recorder import StateRecorder
from tests.exporter.exporter_helpers import make_real_state, route

pytestmark = pytest.mark.vllm


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "0.32.0"))


def _install(es, directory=None, *, start_thread=False, startup=None, version=None):
    lives: list[LiveWorker] = []

    def live(state):
        w = LiveWorker(state, directory, vllm_version=version or _version(), ep_info=lambda: (0, 1),
                       startup=startup, start_thread=start_thread, poll_seconds=0.005)
        lives.append(w)
        return w

    assert hook.patch_eplb_state(es.EplbState, lambda s, lay: StateRecorder(s, lay, None, flush_seconds=1e9), live)
    return lives


def _step(state, model, n, E=8, rng=None):
    rng = rng or np.random.default_rng(0)
    for _ in range(n):
        route(model, rng.integers(0, E, size=(model.num_moe_layers, 4, 2)))
        state.step()


def _cmd(op, at, *, window=6, interval=6, expect=(4, 10), grace=1, id_="c1"):
    return lp.Command(id=id_, op=op, at_step=at, grace_steps=grace, window_size=window, step_interval=interval,
                      expect_window_size=expect[0], expect_step_interval=expect[1])


def test_interval_changes_at_the_agreed_step_and_vllm_rearranges_on_it(real_eplb):
    lives = _install(real_eplb)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=10)
    _step(state, model, 2)  # vLLM starts its counter at 8: rearranges at step 1
    (w,) = lives
    assert w.rearranged_at == [1] and w.steps == 2
    w.take(_cmd(lp.PREPARE, 4))
    assert w.last["state"] == lp.ARMED
    w.take(_cmd(lp.COMMIT, 4))
    _step(state, model, 2)  # steps 2, 3: nothing yet
    assert state.expert_rearrangement_step_interval == 10
    counter_at = state.expert_rearrangement_step  # vLLM's counter before step 4
    _step(state, model, 24)
    assert (state.expert_rearrangement_step_interval, state.expert_load_window_size) == (6, 6)
    assert w.last == {"id": "c1", "state": lp.APPLIED, "reason": w.last["reason"], "at_step": 4, "applied_step": 4}
    first = 4 + (6 - 1 - counter_at)  # vLLM's own rule from the agreed step on, on the new interval
    assert w.rearranged_at == [1, *range(first, 28, 6)], (counter_at, w.rearranged_at)
    s = w.status()
    assert (s.window_size, s.step_interval, s.since_step, s.source) == (6, 6, 4, lp.SOURCE_LIVE)
    # the recorder's snapshot shows what runs, so moe_eplb_config_info does too
    rec = state.__dict__[hook._RECORDER]
    assert (rec.snapshot().models[0].window_size, rec.snapshot().models[0].step_interval) == (6, 6)


def _chronological(window, position):
    return np.roll(window.numpy(), -position, axis=0)


@pytest.mark.parametrize("new_window", [7, 2])
def test_the_window_keeps_its_counts_oldest_first(real_eplb, new_window):
    lives = _install(real_eplb)
    # interval 5: vLLM records into its window on 4 of every 5 steps (the last `window` before each)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=5)
    _step(state, model, 9)  # the 4-step ring wrapped
    (w,) = lives
    ms = next(iter(state.model_states.values()))
    before = _chronological(ms.expert_load_window, state.expert_load_window_step)
    assert before.sum() > 0
    w.take(_cmd(lp.PREPARE, 9, window=new_window, interval=5, expect=(4, 5), grace=0))
    w.take(_cmd(lp.COMMIT, 9, window=new_window, interval=5, expect=(4, 5), grace=0))
    w.before_step()  # what the hook does before vLLM's step 9
    assert w.last["state"] == lp.APPLIED, w.last
    after = _chronological(ms.expert_load_window, state.expert_load_window_step)
    assert ms.expert_load_window.shape[0] == new_window == state.expert_load_window_size
    keep = min(4, new_window)
    np.testing.assert_array_equal(after[new_window - keep:] if new_window > 4 else after, before[4 - keep:])
    if new_window > 4:
        assert after[:new_window - keep].sum() == 0 and after.sum() == before.sum()  # nothing lost
    # vLLM goes on writing the ring where the newest step left off
    _step(state, model, 1)
    assert _chronological(ms.expert_load_window, state.expert_load_window_step)[-2].tolist() == after[-1].tolist()


def test_refusals_change_nothing(real_eplb):
    lives = _install(real_eplb)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=10)
    _step(state, model, 5)
    (w,) = lives
    w.take(_cmd(lp.PREPARE, 3, id_="past"))
    assert w.last["state"] == lp.REFUSED and "already past" in w.last["reason"]
    w.take(_cmd(lp.PREPARE, 9, expect=(4, 20), id_="stale"))
    assert w.last["state"] == lp.REFUSED and "runs window 4, interval 10" in w.last["reason"]
    # counter 3 at step 5 (rearranged at 1); at step 9 it reads 7: 7 + grace 1 is not below min(10, 6)
    w.take(_cmd(lp.PREPARE, 9, id_="guard"))
    w.take(_cmd(lp.COMMIT, 9, id_="guard"))
    _step(state, model, 6)
    assert w.last["state"] == lp.REFUSED and "rearrangement falls within" in w.last["reason"]
    assert (state.expert_rearrangement_step_interval, state.expert_load_window_size) == (10, 4)
    assert w.status().since_step == 0 and w.status().source == lp.SOURCE_ENGINE


def test_no_commit_expires_and_abort_cancels(real_eplb):
    lives = _install(real_eplb)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=40)
    _step(state, model, 12)  # first rearrangement at step 9: counter 2 before step 12
    (w,) = lives
    w.take(_cmd(lp.PREPARE, 14, interval=30, expect=(4, 40), grace=3, id_="nocommit"))
    _step(state, model, 6)
    assert w.last["state"] == lp.ARMED  # steps 14 .. 17 = 14 + 3: still waiting for a late commit
    _step(state, model, 1)
    assert w.last["state"] == lp.EXPIRED and "no commit arrived by step 17" in w.last["reason"]
    w.take(_cmd(lp.COMMIT, 14, interval=30, expect=(4, 40), grace=3, id_="nocommit"))  # too late: ignored
    _step(state, model, 1)
    assert w.last["state"] == lp.EXPIRED and state.expert_rearrangement_step_interval == 40
    w.take(_cmd(lp.PREPARE, 22, interval=30, expect=(4, 40), id_="aborted"))
    w.take(_cmd(lp.ABORT, 22, interval=30, expect=(4, 40), id_="aborted"))
    w.take(_cmd(lp.COMMIT, 22, interval=30, expect=(4, 40), id_="aborted"))
    _step(state, model, 8)
    assert w.last["state"] == lp.ABORTED and state.expert_rearrangement_step_interval == 40


def test_a_late_commit_within_the_grace_applies_as_if_on_time(real_eplb):
    """Two engines stepping in lockstep: one has the commit at the agreed step, the other three steps
    late (inside the grace): from the agreed step on they rearrange at the same steps."""
    runs = []
    for late in (0, 3):
        lives = _install(real_eplb)
        state, model = make_real_state(L=2, E=8, R=0, window=4, interval=40)
        _step(state, model, 10)
        (w,) = lives
        w.take(_cmd(lp.PREPARE, 12, window=5, interval=25, expect=(4, 40), grace=4))
        _step(state, model, 2 + late)
        w.take(_cmd(lp.COMMIT, 12, window=5, interval=25, expect=(4, 40), grace=4))
        _step(state, model, 80 - late)
        assert w.last["state"] == lp.APPLIED and w.last["applied_step"] == 12 + late
        assert w.status().since_step == 12
        runs.append(list(w.rearranged_at))
        hook.unpatch_eplb_state(real_eplb.EplbState)
    assert runs[0] == runs[1] and len(runs[0]) >= 3, runs


def test_an_unsupported_vllm_refuses_with_the_reason(real_eplb):
    lives = _install(real_eplb, version="0.31.2")
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=10)
    _step(state, model, 1)
    (w,) = lives
    w.take(_cmd(lp.PREPARE, 5))
    assert w.last["state"] == lp.REFUSED and "checked on vLLM 0.32.x - 0.34.x" in w.last["reason"]
    assert w.status().supported is False


def test_startup_file_of_this_template_sets_the_values_before_the_first_step(real_eplb, tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({lp.FILE_WINDOW: 7, lp.FILE_INTERVAL: 12, lp.FILE_HASH: "abc", lp.FILE_STEP: 900}))
    assert read_startup_file({"MOE_EPLB_LIVE_FILE": str(path), "MOE_EPLB_CONFIG_HASH": "other"}) is None
    assert read_startup_file({"MOE_EPLB_LIVE_FILE": str(tmp_path / "none"), "MOE_EPLB_CONFIG_HASH": "abc"}) is None
    values = read_startup_file({"MOE_EPLB_LIVE_FILE": str(path), "MOE_EPLB_CONFIG_HASH": "abc"})
    lives = _install(real_eplb, startup=values)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=10)
    _step(state, model, 40)
    (w,) = lives
    ms = next(iter(state.model_states.values()))
    assert (state.expert_load_window_size, ms.expert_load_window.shape[0]) == (7, 7)
    # as if vLLM had been started with interval 12: counter at 9, first rearrangement after 3 steps
    assert w.rearranged_at == [2, 14, 26, 38]
    assert w.status().source == lp.SOURCE_STARTUP


def test_the_pods_route_and_the_watcher_thread_while_the_engine_steps(real_eplb, tmp_path):
    """The exchange over the real files: the route writes the command, the worker's thread takes
    it while the step loop runs (another thread), the route answers with the rank's state."""
    directory = str(tmp_path)
    lives = _install(real_eplb, directory, start_thread=True)
    state, model = make_real_state(L=2, E=8, R=0, window=4, interval=200)
    _step(state, model, 1)
    (w,) = lives
    for _ in range(400):  # the watcher rewrites the status at least every STATUS_EVERY_SECONDS
        status, body = live_control.answer_get(directory)
        if body["ranks"] and body["ranks"][0]["step"] == 1:
            break
        threading.Event().wait(0.01)
    assert status == 200 and body["ranks"][0]["step_interval"] == 200 and body["ranks"][0]["step"] == 1
    stop = threading.Event()

    def engine():
        while not stop.is_set():
            _step(state, model, 1)

    cmd = dict(json.loads(_cmd(lp.PREPARE, 0, interval=150, expect=(4, 200), grace=20).to_json()))
    # the first step 400 ahead where neither interval rearranges within the grace (the operator's rule)
    cmd["at_step"] = lp.safe_step(w.steps, state.expert_rearrangement_step, 200, 150, lead_steps=400, grace_steps=20)
    assert cmd["at_step"] >= w.steps + 400
    try:
        t = threading.Thread(target=engine, daemon=True)
        t.start()
        status, body = live_control.answer_post(directory, json.dumps({**cmd, "answer_seconds": 5}).encode())
        assert status == 200 and [r["command"]["state"] for r in body["ranks"]] == [lp.ARMED], body
        cmd["op"] = lp.COMMIT
        status, body = live_control.answer_post(directory, json.dumps(cmd).encode())
        assert [r["command"]["state"] for r in body["ranks"]] in ([lp.COMMITTED], [lp.APPLIED]), body
        while w.steps < cmd["at_step"] + 2:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        t.join(10)
        w.close()
    w.write_status()
    _, body = live_control.answer_get(directory)
    (rank,) = body["ranks"]
    assert (rank["step_interval"], rank["since_step"], rank["command"]["state"]) == (150, cmd["at_step"], lp.APPLIED)
    bad = live_control.answer_post(directory, b'{"op": "prepare"}')
    assert bad[0] == 400 and "id: required" in bad[1]["error"]
