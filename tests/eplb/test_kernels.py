"""The compiled kernels (moe_eplb.eplb.replay.kernels, Numba) against the NumPy code they replace, side by
side in one process, and how they are switched off and cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.replay import kernels
from moe_eplb.eplb.replay.policy import logical_to_physical, rebalance, rebalance_batch
from moe_eplb.eplb.replay.simulator import Replay, Topology
from moe_eplb.eplb.workload import synth

OPERATOR = Path(__file__).resolve().parents[2] / "operator"

needs_numba = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"no compiled kernels: {kernels.DISABLED_REASON}")


def _both(monkeypatch, fn, *args, **kwargs):
    """(compiled result, NumPy result) of ``fn(*args, **kwargs)``."""
    monkeypatch.setattr(kernels, "ENABLED", True)
    compiled = fn(*args, **kwargs)
    monkeypatch.setattr(kernels, "ENABLED", False)
    return compiled, fn(*args, **kwargs)


# (layers, experts, replicas, groups, nodes, gpus): hierarchical, one group per node, global
# (groups % nodes != 0), no redundancy, one slot per GPU, several slots per GPU with 1 node, one
# expert per node (a one-leaf tree) with one slot per GPU, and one GPU per node.
LAYOUTS = [(58, 256, 288, 8, 4, 32), (6, 64, 80, 4, 4, 16), (5, 60, 72, 5, 2, 8),
           (4, 32, 32, 4, 2, 8), (3, 16, 24, 4, 2, 24), (7, 30, 40, 3, 1, 4), (2, 8, 12, 1, 1, 4),
           (3, 4, 8, 4, 4, 8), (3, 4, 12, 4, 4, 4)]


def _loads(rng, shape):
    """Skewed integers (ties between experts), few distinct integers (many ties), zeros, floats."""
    return [rng.lognormal(6.0, 1.2, shape).astype(np.int64), rng.integers(0, 3, shape),
            np.zeros(shape), rng.random(shape).astype(np.float32) * 1e3]


@needs_numba
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "x".join(map(str, v)))
def test_policy_identical_on_both_paths(monkeypatch, layout):
    layers, experts, replicas, groups, nodes, gpus = layout
    rng = np.random.default_rng(experts)
    for w in _loads(rng, (layers, experts)):
        compiled, numpy_ = _both(monkeypatch, rebalance, w, replicas, groups, nodes, gpus)
        for a, b in zip(compiled, numpy_):
            np.testing.assert_array_equal(a, b)
        batch = np.stack([w, w[::-1]])
        old = np.stack([compiled[0][::-1], compiled[0]])  # kept slots: the NumPy step runs after both
        compiled_b, numpy_b = _both(monkeypatch, rebalance_batch, batch, replicas, groups, nodes, gpus,
                                    old_phy2log=old)
        np.testing.assert_array_equal(compiled_b[0], numpy_b[0])
        np.testing.assert_array_equal(compiled_b[1], numpy_b[1])
        bare = rebalance_batch(batch, replicas, groups, nodes, gpus, old_phy2log=old, with_logcnt=False)
        assert bare[1] is None
        np.testing.assert_array_equal(bare[0], numpy_b[0])


@needs_numba
def test_logical_maps_identical_with_empty_slots(monkeypatch):
    rng = np.random.default_rng(1)
    p2l = rng.integers(-1, 6, (3, 4, 10))  # -1: an empty slot, skipped
    compiled, numpy_ = _both(monkeypatch, logical_to_physical, p2l, 6)
    for a, b in zip(compiled, numpy_):
        np.testing.assert_array_equal(a, b)
    assert compiled[0].shape[-1] == int(compiled[1].max())


@needs_numba
@pytest.mark.parametrize("redundant", [0, 32, 96])
def test_replay_identical_on_both_paths(monkeypatch, redundant):
    """A DeepSeek-V3-shaped replay (every 8th layer): placements and moves exactly, busiest-GPU
    loads up to float32 rounding (the compiled sum adds a GPU's slots in float64)."""
    trace = synth.generate("deepseek-v3-chat-code-math", hours=0.25, seed=2)
    knobs = Knobs(1000, 500, redundant)

    def run():
        rp = Replay(trace, Topology(ep_size=32, num_nodes=4, num_groups=8), layer_stride=8)
        res = rp.run(knobs)
        placements = np.stack([rp._cache[k] for k in sorted(rp._cache)])
        return res, placements

    rp = Replay(trace, Topology(ep_size=32, num_nodes=4, num_groups=8), layer_stride=8)
    starts = np.array([0, 0, 17, 250, rp.N - 1, rp.N])
    ends = np.array([1, rp.N, 4000, 251, rp.N, rp.N])
    w_c, w_n = _both(monkeypatch, rp.window_loads, starts, ends)
    assert w_c.dtype == np.float32 and w_c[1].sum() > 0
    np.testing.assert_array_equal(w_c, w_n)
    (res_c, p_c), (res_n, p_n) = _both(monkeypatch, run)
    np.testing.assert_array_equal(p_c, p_n)
    assert res_c.moved_per_rearrangement.tolist() == res_n.moved_per_rearrangement.tolist()
    assert res_c.experts_moved > 0
    np.testing.assert_allclose(res_c.balancedness_per_layer, res_n.balancedness_per_layer, rtol=1e-6)
    assert res_c.balancedness == pytest.approx(res_n.balancedness, rel=1e-6)
    assert res_c.balancedness < 1.0


def _child(code: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("MOE_EPLB_NO_JIT", "NUMBA_CACHE_DIR")}
    environ.update(env, PYTHONPATH=str(OPERATOR))
    proc = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


_WARM = """
import json
import numpy as np
from moe_eplb.eplb.replay import kernels
from moe_eplb.eplb.replay.policy import rebalance
w = kernels.warm_up()
p = rebalance(np.arange(64).reshape(2, 32) % 7, 40, 4, 2, 8)[0]
print(json.dumps({"enabled": kernels.ENABLED, "hits": w.cache_hits, "misses": w.cache_misses,
                  "dir": w.cache_dir, "text": w.describe(), "p": p.tolist()}))
"""


@pytest.mark.integration
def test_no_jit_env_selects_the_numpy_path_with_the_same_answer():
    off = _child(_WARM, MOE_EPLB_NO_JIT="1")
    assert off["enabled"] is False and off["misses"] == 0
    assert "NumPy path" in off["text"] and "MOE_EPLB_NO_JIT" in off["text"]
    if kernels.AVAILABLE:
        on = _child(_WARM)
        assert on["enabled"] is True
        assert on["p"] == off["p"]


@needs_numba
@pytest.mark.integration
def test_numba_cache_dir_holds_the_compiled_code(tmp_path):
    """With NUMBA_CACHE_DIR set, the first process compiles and writes there; the next one loads
    every kernel from it (no compilation)."""
    first = _child(_WARM, NUMBA_CACHE_DIR=str(tmp_path))
    assert first["misses"] > 0 and first["dir"].startswith(str(tmp_path))
    assert any(tmp_path.rglob("*.nbi"))
    second = _child(_WARM, NUMBA_CACHE_DIR=str(tmp_path))
    assert second["misses"] == 0 and second["hits"] == first["hits"] + first["misses"]
    assert "loaded from Numba's cache" in second["text"]
    assert second["p"] == first["p"]


@needs_numba
@pytest.mark.integration
def test_numba_is_imported_only_when_the_policy_runs():
    """Importing the package (CLI included) costs no numba import (~0.5 s, ~80 MB); the first
    policy call brings it in."""
    out = _child("""
import json, sys
import numpy as np
import moe_eplb.cli, moe_eplb.eplb.replay.policy, moe_eplb.eplb.replay.simulator, moe_eplb.eplb.tuning.tuner
before = "numba" in sys.modules
moe_eplb.eplb.replay.policy.rebalance(np.ones((2, 8)), 8, 1, 1, 4)
print(json.dumps({"before": before, "after": "numba" in sys.modules}))
""")
    assert out == {"before": False, "after": True}
