"""The exporter through vLLM's own model runner code: the runner's ``EPLBController``
(``v1/worker/gpu/eplb_utils.py``), which creates, registers, steps and suppresses the worker's real
``EplbState``. From vLLM 0.34 it is the only runner (``v1/worker/gpu_model_runner.py``, Model Runner
V1, is gone) and ``GPUModelRunner.eplb_state`` (``v1/worker/gpu/model_runner.py``) is a property
returning the controller's state. Runs against the installed wheel (0.32) and, through
tests/test_vllm_sources.py, against 0.33's and 0.34's sources.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from moe_eplb.exporter import hook
from moe_eplb.exporter.recorder import StateRecorder
from tests.exporter.exporter_helpers import StandInModelConfig, logical_counts, make_moe_model, route, vllm_world

pytestmark = pytest.mark.vllm

L, E, R, K = 2, 6, 2, 2  # layers, logical experts, redundant experts, top-k


@pytest.fixture()
def runner_eplb(real_eplb):
    try:
        from vllm.v1.worker.gpu import eplb_utils
    except Exception as exc:  # noqa: BLE001 - an older wheel or one of its imports
        pytest.skip(f"vLLM's model runner EPLB controller is not importable: {exc}")
    recs: list = []
    assert hook.patch_eplb_state(real_eplb.EplbState, _factory(recs))
    return eplb_utils, recs


def _factory(recs: list):
    def factory(state, layout):
        rec = StateRecorder(state, layout, None, flush_seconds=1e9)
        recs.append(rec)
        return rec

    return factory


def _controller(eplb_utils, window=3, interval=10**9):
    """The runner's EPLB controller after ``load_model()``: state created, the model registered."""
    import torch
    from vllm.config import ParallelConfig, set_current_vllm_config

    vc = vllm_world()
    pc = ParallelConfig()
    pc.enable_eplb = True
    pc.eplb_config.window_size = window
    pc.eplb_config.step_interval = interval
    pc.eplb_config.num_redundant_experts = R
    pc.eplb_config.use_async = False
    pc.eplb_config.communicator = "torch_gloo"
    ctrl = eplb_utils.EPLBController(pc, torch.device("cpu"))
    model, mc = make_moe_model(L, E, R), StandInModelConfig("org/runner", "runner-served")
    with set_current_vllm_config(vc):
        ctrl.prepare_load()
        assert ctrl.maybe_register_model(model, mc)
    return ctrl, model, mc


def _known_ids(step: int, n: int) -> np.ndarray:
    """[L, n, K] logical experts of a known load: token t of layer l goes to (t + step) % E and
    (t + step + l + 1) % E."""
    t = np.arange(n)
    return np.stack([np.stack([(t + step) % E, (t + step + l + 1) % E], axis=1) for l in range(L)])


def _serve(ctrl, model, mc, tokens, dummy=()):
    """Engine steps as the runner runs them: prepare_forward, the forward's routing, step (after the
    forward, ``step_eplb_after``); a dummy step only steps. Returns [L, E] routed counts."""
    total = np.zeros((L, E))
    for i, n in enumerate(tokens):
        if i in dummy:
            ctrl.step(is_dummy=True)
            continue
        ctrl.prepare_forward(mc, n)
        ids = _known_ids(i, n)
        route(model, ids)
        total += logical_counts(ids, E)
        ctrl.step()
    return total


def test_exact_counts_through_the_runner_controller(runner_eplb):
    eplb_utils, recs = runner_eplb
    ctrl, model, mc = _controller(eplb_utils, window=4, interval=10)
    tokens = [6] * 25
    total = _serve(ctrl, model, mc, tokens, dummy={7, 14})
    (rec,) = recs
    rec.flush_now()
    (m,) = rec.models
    real = sum(n for i, n in enumerate(tokens) if i not in {7, 14})
    # the known load: every routed (token, slot) counted once, by logical expert
    assert total.sum() == real * K * L == 2 * 23 * 6 * 2
    np.testing.assert_array_equal(m.expert_tokens, total)
    np.testing.assert_array_equal(m.rank_tokens[:, 0], total.sum(axis=1))
    assert m.step_tokens_sum == real  # prepare_forward's unpadded tokens: the key of the model state held
    assert m.steps == 25 and m.rearrangements == 3  # vLLM's first after I // 4 steps, then every I
    assert m.handle.name == "runner-served"
    np.testing.assert_array_equal(m.replicas, next(iter(ctrl.state.model_states.values())).logical_replica_count.numpy())


def test_runner_property_returns_the_patched_state(runner_eplb):
    eplb_utils, _ = runner_eplb
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"vLLM's model runner is not importable: {exc}")
    import vllm

    ctrl, _, _ = _controller(eplb_utils)
    runner = GPUModelRunner.__new__(GPUModelRunner)  # only the attribute the property reads
    runner.eplb = ctrl
    assert isinstance(GPUModelRunner.__dict__["eplb_state"], property)
    assert runner.eplb_state is ctrl.state
    assert getattr(type(runner.eplb_state), "_moe_eplb_patched", False), "the runner's state class is not hooked"
    version = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    if version >= (0, 34):  # Model Runner V1 is gone: this runner is the only one
        assert importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None


def test_recording_stays_on_with_flip_only_writes_and_vllm_is_unchanged(runner_eplb, real_eplb):
    """vLLM 0.34 writes ``should_record_tensor`` only when its own gate flips. The exporter turns it
    on after every step; vLLM's window and expert maps must be exactly what they are without it."""
    eplb_utils, recs = runner_eplb

    def run():
        ctrl, model, mc = _controller(eplb_utils, window=3, interval=8)
        st = ctrl.state
        seen = []
        for _ in range(20):
            _serve(ctrl, model, mc, [5])
            ms = next(iter(st.model_states.values()))
            seen.append((ms.expert_load_window.clone(), ms.physical_to_logical_map.clone(),
                         bool(st.should_record_tensor), getattr(st, "_should_record_value", None)))
        return seen

    hook.unpatch_eplb_state(real_eplb.EplbState)
    plain = run()
    assert hook.patch_eplb_state(real_eplb.EplbState, _factory(recs))
    exported = run()
    assert recs, "the exporter did not attach"
    assert not all(flag for _, _, flag, _ in plain), "vLLM's own gate never turned recording off"
    for i, ((w0, m0, _, v0), (w1, m1, flag, v1)) in enumerate(zip(plain, exported)):
        assert (w0 == w1).all(), f"vLLM's window differs after step {i}"
        assert (m0 == m1).all(), f"vLLM's expert map differs after step {i}"
        assert v0 == v1, f"vLLM's own gate value differs after step {i}"
        assert flag, f"recording is off after step {i}"


def test_warmup_under_suppress_is_not_counted(runner_eplb):
    """The runner's warm-up forwards run under ``EPLBController.suppress()``: the router records
    nothing and no step happens; the exporter counts only the served step."""
    eplb_utils, recs = runner_eplb
    if not hasattr(eplb_utils.EPLBController, "suppress"):
        pytest.skip("this vLLM's runner has no EPLBController.suppress() (new in 0.33)")
    ctrl, model, mc = _controller(eplb_utils)
    _serve(ctrl, model, mc, [4])  # one served step: the recorder exists
    with ctrl.suppress():
        route(model, _known_ids(0, 50))
        ctrl.step()
    total = _serve(ctrl, model, mc, [3])
    (rec,) = recs
    rec.flush_now()
    (m,) = rec.models
    assert m.steps == 2
    assert m.expert_tokens.sum() == (4 + 3) * K * L
    np.testing.assert_array_equal(m.expert_tokens.sum(axis=0) - logical_counts(_known_ids(0, 4), E).sum(axis=0),
                                  total.sum(axis=0))
    assert bool(ctrl.state.should_record_tensor), "suppress() did not restore the exporter's recording flag"


def test_logical_to_physical_map_width(runner_eplb):
    """0.34 sizes the map ``R + 1`` wide (``MAX_EXPERT_REDUNDANCY + 1`` before, and under elastic EP);
    the exporter reads only the physical->logical map and the replica counts, whose shapes hold."""
    eplb_utils, recs = runner_eplb
    import vllm

    from moe_eplb.contracts.vllm_facts import MAX_REDUNDANT_EXPERTS  # vLLM's MAX_EXPERT_REDUNDANCY

    ctrl, model, mc = _controller(eplb_utils)
    ms = next(iter(ctrl.state.model_states.values()))
    width = ms.logical_to_physical_map.shape[-1]
    version = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    assert width == (R + 1 if version >= (0, 34) else MAX_REDUNDANT_EXPERTS + 1)
    _serve(ctrl, model, mc, [2])
    assert tuple(recs[0].models[0].handle.physical_to_logical.shape) == (L, E + R)
