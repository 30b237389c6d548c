"""The hook against per-version stand-ins of layouts the installed wheel does not have, and its
fail-soft behaviour."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from moe_eplb.exporter import hook  # noqa: E402
from moe_eplb.exporter.layout import UnsupportedLayout, detect  # noqa: E402
from moe_eplb.exporter.recorder import StateRecorder  # noqa: E402
from tests.exporter.exporter_helpers import make_standin_v010, make_standin_v012  # noqa: E402


def _factory(recs, ep_info=lambda: (0, 1)):
    def factory(state, layout):
        rec = StateRecorder(state, layout, None, flush_seconds=1e9, ep_info=ep_info)
        recs.append(rec)
        return rec

    return factory


def test_v012_layout_counts_exactly_and_keeps_vllm_behaviour():
    cls = make_standin_v012(L=2, E=4, R=2)
    recs = []
    assert hook.patch_eplb_state(cls, _factory(recs, ep_info=lambda: (1, 2)))
    st = cls()
    ms = st.model_states["h"]
    rng = np.random.default_rng(0)
    expected = np.zeros((2, 4))
    expected_rank = np.zeros((2, 2))
    for i in range(6):
        pass_ = rng.integers(0, 5, size=(2, 6)).astype(np.int32)
        ms.expert_load_pass.copy_(torch.from_numpy(pass_))
        p2l = ms.physical_to_logical_map.numpy()
        for l in range(2):
            np.add.at(expected[l], p2l[l], pass_[l])
        expected_rank += pass_.reshape(2, 2, 3).sum(axis=2)
        st.step()
        if i == 3:
            st.rearrange()  # the map changes in place: later steps must count in the new logical space
    assert st.calls == 6, "vLLM's own step must run exactly once per call"
    (rec,) = recs
    rec.flush_now()
    m = rec.models[0]
    assert rec.layout.name == "multi-model" and not rec.layout.gated
    np.testing.assert_array_equal(m.expert_tokens, expected)
    np.testing.assert_array_equal(m.rank_tokens, expected_rank)
    assert (m.ep_rank, m.ep_size) == (1, 2)
    assert m.rearrangements == 1
    np.testing.assert_array_equal(m.replicas, [[1, 2, 1, 2]] * 2)
    hook.unpatch_eplb_state(cls)


def test_v012_dummy_and_profile_steps_are_not_counted_as_load():
    cls = make_standin_v012()
    recs = []
    hook.patch_eplb_state(cls, _factory(recs))
    st = cls()
    ms = st.model_states["h"]
    ms.expert_load_pass.fill_(5)
    st.step(is_dummy=True)
    ms.expert_load_pass.fill_(5)
    st.step(False, True)  # profile run: vLLM does a dummy rearrangement only
    recs[0].flush_now()
    assert recs[0].models[0].expert_tokens.sum() == 0
    assert recs[0].models[0].steps == 1
    hook.unpatch_eplb_state(cls)


def test_pre_012_layout_is_refused_softly(caplog):
    cls = make_standin_v010()
    recs = []
    with caplog.at_level(logging.ERROR, logger="moe_eplb.exporter"):
        assert not hook.patch_eplb_state(cls, _factory(recs))
    assert "not supported" in caplog.text and "0.12.0" in caplog.text
    st = cls()
    st.step(object())
    assert st.calls == 1 and not recs
    with pytest.raises(UnsupportedLayout, match="model_states"):
        detect(st)


def test_unknown_shapes_fail_soft_once_and_the_engine_keeps_stepping(caplog):
    cls = make_standin_v012(L=2, E=4, R=2)
    recs = []
    hook.patch_eplb_state(cls, _factory(recs))
    st = cls()
    st.model_states["h"].expert_load_pass = torch.zeros((2, 3), dtype=torch.int32)  # per-local-slot pass
    st.model_states["h"].expert_load_window = torch.zeros((2, 2, 3), dtype=torch.int32)
    with caplog.at_level(logging.ERROR, logger="moe_eplb.exporter"):
        for _ in range(5):
            st.step()
    assert st.calls == 5
    assert not recs
    assert caplog.text.count("exporting nothing") == 1
    hook.unpatch_eplb_state(cls)


def test_an_exporter_exception_never_reaches_the_engine(caplog):
    cls = make_standin_v012(L=2, E=4, R=2)
    recs = []
    hook.patch_eplb_state(cls, _factory(recs))
    st = cls()
    st.step()
    good = st.model_states["h"].physical_to_logical_map
    st.model_states["h"].physical_to_logical_map = torch.full((2, 6), 99)  # scatter index out of range
    with caplog.at_level(logging.ERROR, logger="moe_eplb.exporter"):
        st.step()  # tokens recorded under the bad map ...
        st.model_states["h"].physical_to_logical_map = good
        for _ in range(3):
            st.step()  # ... are folded when the map changes again: the scatter raises
    assert st.calls == 5
    assert caplog.text.count("exporting nothing") == 1
    hook.unpatch_eplb_state(cls)


def test_install_patches_after_a_later_import(monkeypatch, tmp_path):
    """install() before the EPLB module is imported: the meta-path finder patches it on import."""
    pkg = tmp_path / "fakevllm_eplb"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "eplb_state.py").write_text(
        "class EplbState:\n"
        "    def step(self, is_dummy=False, is_profile=False, log_stats=False):\n"
        "        return 'stepped'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hook, "EPLB_MODULE", "fakevllm_eplb.eplb_state")
    import sys

    finders = list(sys.meta_path)
    try:
        hook.install(_factory([]))
        import fakevllm_eplb.eplb_state as mod

        assert getattr(mod.EplbState, "_moe_eplb_patched", False)
        assert mod.EplbState().step() == "stepped"
    finally:
        sys.meta_path[:] = finders


def test_async_rearrangement_is_timed_until_the_last_layer_is_committed():
    base = make_standin_v012()

    class AsyncEplbState(base):
        def rearrange(self, is_profile: bool = False, rank_mapping=None):
            for ms in self.model_states.values():  # vLLM async: maps computed, layers move later
                ms.rebalanced = True

    now = [100.0]
    recs = []

    def factory(state, layout):
        rec = StateRecorder(state, layout, None, flush_seconds=1e9, ep_info=lambda: (0, 1), clock=lambda: now[0])
        recs.append(rec)
        return rec

    hook.patch_eplb_state(AsyncEplbState, factory)
    st = AsyncEplbState()
    st.is_async = True
    st.step()
    now[0] += 1.0
    st.rearrange()  # as vLLM's step() calls it when the interval is reached
    m = recs[0].models[0]
    assert m.rearrangements == 1 and m.duration_buckets.sum() == 0, "async: not finished yet"
    for _ in range(3):
        now[0] += 0.2
        st.step()
    assert m.duration_buckets.sum() == 0
    st.model_states["h"].rebalanced = False  # the last layer was committed
    now[0] += 0.2
    st.step()
    assert m.duration_buckets.sum() == 1
    assert m.duration_sum == pytest.approx(0.8)
    hook.unpatch_eplb_state(AsyncEplbState)


def test_model_state_key_follows_the_function_vllm_imports(monkeypatch):
    """vLLM keys ``model_states`` with the config hash function its EPLB module imports: 0.34's
    ``hash_config_cached``, 0.32-0.33's ``compute_hash_cached``, older ``model_config.compute_hash()``.
    The hook uses the same function, so prepare_forward finds the state on every release."""
    import sys
    import types

    from moe_eplb.exporter.layout import UnsupportedLayout

    cfg = types.SimpleNamespace(compute_hash=lambda: "old")
    module = types.ModuleType("fake_eplb_state")
    monkeypatch.setattr(hook, "EPLB_MODULE", module.__name__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert hook._hash_key(cfg) == "old"
    module.compute_hash_cached = lambda c: "cached-" + c.compute_hash()
    assert hook._hash_key(cfg) == "cached-old"
    module.hash_config_cached = lambda c: "factors"  # 0.34 keeps the old import name nowhere
    assert hook._hash_key(cfg) == "factors"
    del module.hash_config_cached, module.compute_hash_cached
    with pytest.raises(UnsupportedLayout, match="hash_config_cached, compute_hash_cached"):
        hook._hash_key(types.SimpleNamespace())
