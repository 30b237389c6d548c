"""The NumPy EPLB policy against outputs recorded from vLLM 0.32 (no vLLM needed), plus its own
invariants, errors and the ``moe-eplb rebalance`` command."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.eplb.replay import policy
from moe_eplb.eplb.replay.policy import (
    PolicyError,
    logical_to_physical,
    rebalance,
    rebalance_batch,
)

# every test runs on the compiled kernels and on the NumPy path (tests/eplb/conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")

FIXTURES = Path(__file__).parent / "fixtures"


def _load_regen():
    spec = importlib.util.spec_from_file_location("policy_fixture_regen", FIXTURES / "regen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regen = _load_regen()
DOC = json.loads((FIXTURES / "policy_vllm.json").read_text(encoding="utf-8"))
CASES = DOC["cases"]
SORT_PROBE_MATCHES = regen.sort_probe(regen.sorted_lengths(CASES)) == DOC["sort_probe"]


def _padded_log2phy(case: dict) -> np.ndarray:
    slots = case["log2phy_slots"]
    out = np.full((len(slots), len(slots[0]), case["log2phy_width"]), -1, dtype=np.int64)
    for layer, experts in enumerate(slots):
        for expert, phys in enumerate(experts):
            out[layer, expert, : len(phys)] = phys
    return out


def _run(case: dict, **kw):
    return rebalance(case["weight"], case["num_replicas"], case["num_groups"], case["num_nodes"],
                     case["num_gpus"], old_phy2log=case.get("old_phy2log"), **kw)


def test_fixtures_cover_what_the_issue_asks():
    kinds = {c["kind"] for c in CASES}
    assert {"readme", "shape", "int_small", "zeros", "constant", "uniform"} <= kinds
    assert any(c["num_groups"] % c["num_nodes"] for c in CASES), "no global-policy case"
    assert any(c["num_nodes"] > 1 and c["num_groups"] % c["num_nodes"] == 0 for c in CASES)
    assert any("old_phy2log" in c for c in CASES)
    assert any(c["num_replicas"] == len(c["weight"][0]) for c in CASES), "no zero-redundancy case"
    assert sum(not c["tie_sensitive"] for c in CASES) >= 40  # checked on every machine


def test_tie_sensitivity_flags_are_right():
    """A case flagged tie-insensitive must give the same placement whatever order ties take (it is
    then checked on every machine); the flags were computed when recording."""
    flags = [regen.tie_sensitive(c) for c in CASES]
    assert flags == [c["tie_sensitive"] for c in CASES]


def test_deepseek_readme_example():
    """The worked example from DeepSeek's EPLB README (see the project notes)."""
    w = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
         [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    phy2log, log2phy, logcnt = rebalance(w, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                               [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy.shape == (2, 12, 2)
    assert log2phy[0, 5].tolist() == [0, 2] and log2phy[0, 0].tolist() == [12, -1]
    assert all(a.dtype == np.int64 for a in (phy2log, log2phy, logcnt))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_same_as_recorded_vllm(case):
    if case["tie_sensitive"] and not SORT_PROBE_MATCHES:
        pytest.skip("this case depends on how numpy.argsort orders equal values, and this "
                    "machine's NumPy/CPU orders them differently from the one that recorded it "
                    "(vLLM's own output changes the same way); the live vllm test covers it")
    phy2log, log2phy, logcnt = _run(case)
    np.testing.assert_array_equal(phy2log, np.asarray(case["phy2log"]))
    np.testing.assert_array_equal(logcnt, np.asarray(case["logcnt"]))
    np.testing.assert_array_equal(log2phy, _padded_log2phy(case))


def test_batch_equals_single_calls(monkeypatch):
    """rebalance_batch == rebalance per item, also across chunk boundaries."""
    monkeypatch.setattr(policy, "_CHUNK_ROWS", 5)  # 3 layers x 4 items: chunks split items
    rng = np.random.default_rng(3)
    w = rng.integers(0, 6, size=(4, 3, 16)).astype(np.float64)  # tie-heavy
    w[1] = 0.0
    w[2] = rng.random((3, 16))
    old = rng.integers(-1, 16, size=(4, 3, 24))
    for old_arg in (None, old):
        phy2log, logcnt = rebalance_batch(w, 24, 4, 2, 4, old_phy2log=old_arg)
        assert phy2log.shape == (4, 3, 24) and logcnt.shape == (4, 3, 16)
        for b in range(4):
            single = rebalance(w[b], 24, 4, 2, 4,
                               old_phy2log=None if old_arg is None else old_arg[b])
            np.testing.assert_array_equal(phy2log[b], single[0])
            np.testing.assert_array_equal(logcnt[b], single[2])


@pytest.mark.parametrize("sizes", [(24, 4, 2, 4), (24, 3, 2, 6), (16, 1, 1, 8), (32, 8, 4, 8)])
def test_invariants_on_random_loads(sizes):
    replicas, groups, nodes, gpus = sizes
    rng = np.random.default_rng(sum(sizes))
    w = rng.lognormal(2.0, 1.5, size=(20, 16))
    phy2log, log2phy, logcnt = rebalance(w, replicas, groups, nodes, gpus)
    assert phy2log.shape == (20, replicas)
    assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == replicas).all()
    for layer in range(20):
        assert np.bincount(phy2log[layer], minlength=16).tolist() == logcnt[layer].tolist()
        for expert in range(16):
            slots = log2phy[layer, expert]
            real = slots[slots >= 0]
            assert len(real) == logcnt[layer, expert] and (np.diff(real) > 0).all()
            assert (phy2log[layer, real] == expert).all()
            assert (slots[len(real):] == -1).all()
    # Hierarchical: every expert of a group lands on one node.
    if groups % nodes == 0 and nodes > 1:
        group_size, per_node = 16 // groups, replicas // nodes
        node_of_slot = np.arange(replicas) // per_node
        for layer in range(20):
            for g in range(groups):
                in_group = (phy2log[layer] // group_size) == g
                assert len(set(node_of_slot[in_group])) == 1


def test_redundancy_splits_a_hot_expert():
    """One expert carries 3x a GPU's fair share: without redundancy its GPU is the bottleneck;
    with spare slots the policy replicates it and the GPUs come out nearly even."""
    rng = np.random.default_rng(11)
    w = rng.random((1, 64))
    w[0, 17] = 3 * w.sum() / 8
    balance = {}
    for replicas in (64, 72, 128):
        phy2log, _, logcnt = rebalance(w, replicas, 1, 1, 8)
        per_slot = w[0, phy2log[0]] / logcnt[0, phy2log[0]]
        gpu = per_slot.reshape(8, -1).sum(axis=1)
        balance[replicas] = gpu.mean() / gpu.max()
        assert np.isclose(gpu.sum(), w.sum())
    assert balance[64] < 0.5
    assert logcnt[0, 17] >= 3 and balance[72] > 0.9 and balance[128] > 0.98


def test_old_placement_keeps_slots_of_experts_that_stay():
    rng = np.random.default_rng(5)
    w_old, w_new = rng.random((6, 32)), rng.random((6, 32))
    old = rebalance(w_old, 48, 4, 2, 8)[0]
    plain = rebalance(w_new, 48, 4, 2, 8)[0]
    kept = rebalance(w_new, 48, 4, 2, 8, old_phy2log=old)[0]
    per_gpu = 6
    for layer in range(6):
        for g in range(8):
            sl = slice(g * per_gpu, (g + 1) * per_gpu)
            # same experts on each GPU as without old_phy2log, only reordered
            assert sorted(kept[layer, sl]) == sorted(plain[layer, sl])
            for s in range(per_gpu):
                e = old[layer, sl][s]
                if e in plain[layer, sl] and list(old[layer, sl]).count(e) == 1:
                    assert kept[layer, g * per_gpu + s] == e
    moved = (kept != old).sum()
    assert moved < (plain != old).sum()


def test_logical_to_physical_ignores_empty_slots():
    log2phy, logcnt = logical_to_physical(np.array([[2, -1, 0, 2, -1]]), 4)
    assert logcnt.tolist() == [[1, 0, 2, 0]]
    assert log2phy.tolist() == [[[2, -1], [-1, -1], [0, 3], [-1, -1]]]


@pytest.mark.parametrize(
    ("args", "param", "fragment"),
    [
        (([[1.0, 2.0]], 3, 1, 1, 2), "num_replicas", "multiple of 2"),
        (([[1.0, 2.0, 3.0, 4.0]], 2, 1, 1, 2), "num_replicas", "at least 4"),
        (([[1.0] * 6], 6, 4, 2, 2), "num_groups", "6 experts cannot be split into 4"),
        (([[1.0] * 8], 9, 2, 2, 3), "num_gpus", "multiple of 2"),
        (([[1.0] * 4], 4, 0, 1, 1), "num_groups", ">= 1"),
        (([[1.0] * 4], 4, 1, 1, 1.5), "num_gpus", "whole number"),
        (([[1.0, -1.0]], 2, 1, 1, 1), "weight", "weight[0, 1] = -1.0"),
        (([[1.0, float("nan")]], 2, 1, 1, 1), "weight", "finite"),
        (([[1.0, 1e39]], 2, 1, 1, 1), "weight", "float32"),
        (([1.0, 2.0], 2, 1, 1, 1), "weight", "L x E"),
        ((np.zeros((0, 4)), 4, 1, 1, 1), "weight", "empty"),
        (([["a", "b"]], 2, 1, 1, 1), "weight", "real numbers"),
    ],
)
def test_bad_arguments_name_the_argument(args, param, fragment):
    with pytest.raises(PolicyError) as err:
        rebalance(*args)
    assert err.value.param == param
    assert fragment in str(err.value)
    assert isinstance(err.value, ValueError)


# --- sums past float32 (loads near 1e38) ---------------------------------------------------------

# 8 experts in 2 groups of 4 on 2 nodes, 4 GPUs, 8 slots (hierarchical): every load fits float32,
# but group 0's four loads of 1e38 sum past its largest value (3.4e38). Before the check this gave
# an IndexError or a placement with an expert missing, varying from run to run.
OVERFLOW_GROUP = [[1e38, 1e38, 1e38, 1e38, 1.0, 2.0, 3.0, 4.0]]


def test_group_sum_past_float32_is_refused_naming_layer_group_and_fix():
    for _ in range(3):  # the same answer every time
        with pytest.raises(PolicyError) as err:
            rebalance(OVERFLOW_GROUP, 8, 2, 2, 4)
        assert err.value.param == "weight"
        assert "layer 0: expert group 0 (experts 0..3) sums to more than float32 holds" in str(err.value)
        assert "divide by 1e6" in str(err.value)


def test_gpu_sum_past_float32_is_refused():
    """Global policy (1 group): no group sum, but the packing puts two of the 2e38 experts on one
    GPU (4e38, past float32's 3.4e38)."""
    w = [[2e38, 2e38, 2e38, 1.0, 1.0, 1.0]]
    with pytest.raises(PolicyError) as err:
        rebalance(w, 6, 1, 1, 2)  # 3 slots per GPU; any 2 of the heavy experts on one GPU overflow
    assert err.value.param == "weight"
    assert "layer 0: GPU " in str(err.value) and "more than float32 holds" in str(err.value)


def test_batch_names_the_matrix_and_layer():
    ok = np.ones((2, 8))
    bad = np.array([ok, np.vstack([ok[0], OVERFLOW_GROUP[0]])])
    with pytest.raises(PolicyError, match=r"weight: matrix 1, layer 1: expert group 0"):
        rebalance_batch(bad, 8, 2, 2, 4)


def test_loads_near_the_limit_that_fit_are_placed_as_scaled_down():
    """Loads big enough to trigger the sum check but whose sums fit: same placement as the same
    ratios at small scale (a power of two scales float32 exactly)."""
    small = np.array([[3.0, 1.0, 2.0, 4.0, 1.0, 2.0, 3.0, 1.5]])
    big = small * 2.0**124  # max 8.5e37: 4 of them could overflow, these groups sum to 2.1e38
    for args in ((8, 2, 2, 4), (8, 1, 1, 4), (12, 2, 2, 4)):
        got, want = rebalance(big, *args), rebalance(small, *args)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), args


def test_global_policy_ignores_group_divisibility():
    """groups % nodes != 0 -> global policy; the experts need not split into those groups."""
    w = np.arange(1.0, 8.0)[None]  # 7 experts, 3 groups, 2 nodes
    phy2log, _, logcnt = rebalance(w, 8, 3, 2, 2)
    assert phy2log.shape == (1, 8) and logcnt.sum() == 8 and logcnt[0, 6] == 2


def test_bad_old_placement():
    with pytest.raises(PolicyError, match="old_phy2log: shape"):
        rebalance([[1.0, 2.0]], 2, 1, 1, 1, old_phy2log=[[0, 1, 1]])
    with pytest.raises(PolicyError, match=r"-1\.\.1"):
        rebalance([[1.0, 2.0]], 2, 1, 1, 1, old_phy2log=[[0, 5]])


# --- CLI ---------------------------------------------------------------------------------------


def _cli(tmp_path, weights, *flags):
    path = tmp_path / "w.json"
    path.write_text(weights if isinstance(weights, str) else json.dumps(weights))
    return CliRunner().invoke(main, ["rebalance", "--weights", str(path), *flags])


@pytest.mark.parametrize("name", ["deepseek-readme", "deepseek-v3-ep32"])
def test_cli_prints_vllm_placement(tmp_path, name):
    case = next(c for c in CASES if c["name"] == name)
    result = _cli(tmp_path, case["weight"], "--replicas", str(case["num_replicas"]),
                  "--groups", str(case["num_groups"]), "--nodes", str(case["num_nodes"]),
                  "--gpus", str(case["num_gpus"]))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) == {"phy2log", "logcnt"}
    assert out["phy2log"] == case["phy2log"] and out["logcnt"] == case["logcnt"]


@pytest.mark.parametrize(
    ("weights", "flags", "fragment"),
    [
        ([[1, 2, 3, 4]], ("--replicas", "5", "--groups", "1", "--nodes", "1", "--gpus", "2"),
         "--replicas"),
        ([[1, 2, 3, 4]], ("--replicas", "4", "--groups", "3", "--nodes", "1", "--gpus", "2"),
         "--groups"),
        ([[1, -2]], ("--replicas", "2", "--groups", "1", "--nodes", "1", "--gpus", "1"),
         "--weights"),
        ("{not json", ("--replicas", "2", "--groups", "1", "--nodes", "1", "--gpus", "1"),
         "not valid JSON"),
        ([[1, 2], [3]], ("--replicas", "2", "--groups", "1", "--nodes", "1", "--gpus", "1"),
         "row 1 has 1 experts"),
        ({"load": [[1]]}, ("--replicas", "1", "--groups", "1", "--nodes", "1", "--gpus", "1"),
         "2-D list"),
        ([[1, "x"]], ("--replicas", "2", "--groups", "1", "--nodes", "1", "--gpus", "1"),
         "[0][1] is 'x'"),
    ],
)
def test_cli_errors_name_the_flag(tmp_path, weights, flags, fragment):
    result = _cli(tmp_path, weights, *flags)
    assert result.exit_code == 2
    assert fragment in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_group_sum_past_float32_exits_2(tmp_path):
    result = _cli(tmp_path, OVERFLOW_GROUP, "--replicas", "8", "--groups", "2", "--nodes", "2", "--gpus", "4")
    assert result.exit_code == 2, result.output
    assert "--weights" in result.output and "expert group 0" in result.output
    assert "divide by 1e6" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_missing_file(tmp_path):
    result = CliRunner().invoke(main, ["rebalance", "--weights", str(tmp_path / "nope.json"),
                                       "--replicas", "2", "--groups", "1", "--nodes", "1",
                                       "--gpus", "1"])
    assert result.exit_code == 2 and "cannot read" in result.output and "--weights" in result.output
