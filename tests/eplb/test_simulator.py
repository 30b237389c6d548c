"""The simulator against an independent step-by-step replay of vLLM's EplbState, plus the cost
model, hand-computed cases and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.policy import rebalance
from moe_eplb.eplb.replay.simulator import (
    Knobs,
    Replay,
    SimError,
    Topology,
    simulate,
    simulate_clairvoyant,
    simulate_static,
)
from moe_eplb.eplb.workload.trace import LoadTrace

# every test runs on the compiled kernels and on the NumPy path (tests/eplb/conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")


def _vllm_policy():
    """vLLM's own policy when the wheel is installed (then the reference is fully independent)."""
    try:
        import torch
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    except Exception:  # noqa: BLE001 - any import failure means: use the project's policy
        return None

    def run(weight, replicas, groups, nodes, gpus, old):
        out = DefaultEplbPolicy.rebalance_experts(
            torch.tensor(weight), replicas, groups, nodes, gpus, torch.tensor(old)
        )
        return out.numpy().astype(np.int64)

    return run


def _our_policy(weight, replicas, groups, nodes, gpus, old):
    return rebalance(weight, replicas, groups, nodes, gpus, old_phy2log=old)[0]


def reference_replay(trace: LoadTrace, topo: Topology, knobs: Knobs, policy):
    """Step by step, as vLLM 0.32's ``EplbState.step``: per-step load = bucket load / steps; the
    rearrangement counter starts at ``I - I // 4``; a step is recorded into the W-slot ring buffer
    when ``I - counter <= W``; rearrange when the counter reaches I, passing the current map (so
    staying experts keep their slots). The window is kept in logical experts (see docs/tuner.md).

    Returns (busiest-GPU load [T, L] summed over each bucket's steps, rearrangement steps, slots
    changed per rearrangement)."""
    T, L, E = trace.load.shape
    W, I, R = knobs.window_size, knobs.step_interval, knobs.num_redundant_experts
    P = E + R
    G = topo.ep_size
    phy2log = np.tile(np.concatenate([np.arange(E), np.arange(R) % E]), (L, 1))
    ring = np.zeros((W, L, E))
    ring_pos = 0
    counter = max(0, I - I // 4)
    M = np.zeros((T, L))
    steps_done, instants, moved = 0, [], []
    for b in range(T):
        n = int(trace.bucket_steps[b])
        for _ in range(n):
            x = trace.load[b] / n
            cnt = np.stack([np.bincount(phy2log[l], minlength=E) for l in range(L)])
            slot = np.take_along_axis(x, phy2log, axis=1) / np.take_along_axis(cnt, phy2log, axis=1)
            M[b] += slot.reshape(L, G, P // G).sum(axis=2).max(axis=1)
            if I - counter <= W:
                ring[ring_pos] = x
                ring_pos = (ring_pos + 1) % W
            counter += 1
            steps_done += 1
            if counter >= I:
                counter = 0
                new = policy(ring.sum(axis=0), P, topo.num_groups, topo.num_nodes, G, phy2log)
                instants.append(steps_done)
                moved.append(int((new != phy2log).sum()))
                phy2log = new
    return M, instants, moved


def _int_trace(seed: int, T=6, L=3, E=8, zero_bucket=True) -> LoadTrace:
    """Per-step loads are whole numbers (so both replays see identical float32 windows)."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(3, 12, size=T)
    if zero_bucket:
        steps[T // 2] = 0
    per_step = rng.integers(0, 20, size=(T, L, E)) * (rng.random((T, 1, E)) < 0.8)
    per_step[:, :, rng.integers(0, E)] += 25  # a hot expert
    return LoadTrace(load=per_step * steps[:, None, None], bucket_steps=steps)


@pytest.mark.parametrize("seed", range(6))
def test_matches_step_by_step_reference(seed):
    policy = _vllm_policy() or _our_policy
    trace = _int_trace(seed)
    rng = np.random.default_rng(100 + seed)
    topo = Topology(ep_size=4, num_nodes=2, num_groups=4) if seed % 2 else Topology(ep_size=2)
    for _ in range(4):
        r = int(rng.choice([0, 4, 8]))
        knobs = Knobs(int(rng.integers(1, 25)), int(rng.integers(1, 14)), r)
        ref_M, ref_k, ref_moved = reference_replay(trace, topo, knobs, policy)
        res = Replay(trace, topo).run(knobs)
        assert res.rearrangement_steps.tolist() == [k for k in ref_k if k < trace.total_steps]
        n = res.rearrangements
        assert res.moved_per_rearrangement.tolist() == ref_moved[:n], knobs
        mean = trace.load.sum(axis=2) / topo.ep_size
        assert res.balancedness == pytest.approx(mean.sum() / ref_M.sum(), rel=1e-6), knobs
        with np.errstate(invalid="ignore"):
            ref_layer = mean.sum(0) / ref_M.sum(0)
        np.testing.assert_allclose(res.balancedness_per_layer, ref_layer, rtol=1e-6)


def test_instants_follow_vllms_counter():
    trace = LoadTrace(load=np.ones((4, 1, 4)), bucket_steps=[2500, 2500, 2500, 2500])
    rp = Replay(trace, Topology(2))
    assert rp.instants(3000).tolist() == [750, 3750, 6750, 9750]
    assert rp.instants(1000)[:3].tolist() == [250, 1250, 2250]
    assert rp.instants(3).tolist()[:3] == [1, 4, 7]  # I // 4 == 0: after the first step
    assert rp.windows(Knobs(1000, 3000, 0))[:2] == [(0, 750), (2750, 3750)]


def test_moved_counts_by_hand_and_in_one_pass():
    rp = Replay(LoadTrace(load=np.ones((2, 1, 4)), bucket_steps=[5, 5]), Topology(2))
    old = np.array([[0, 1, 1, 2, 3, 3]])  # GPU 0: 0, 1, 1; GPU 1: 2, 3, 3
    new = np.array([[1, 1, 1, 3, 2, 0]])  # GPU 0 keeps both 1s, receives a third; GPU 1 keeps 2, 3
    assert rp.moved(old, new) == 1 + 1  # GPU 0: one 1; GPU 1: expert 0
    assert rp.moved(old, old) == 0
    # Many placements with experts twice on a GPU, without and with redundancy (S = 4 and 6):
    # the one-pass count is the pairwise one.
    rng = np.random.default_rng(3)
    for num_slots in (8, 12):
        rp = Replay(LoadTrace(load=np.ones((2, 5, 8)), bucket_steps=[5, 5]), Topology(2))
        seq = rng.integers(0, 8, (30, 5, num_slots))
        keep = rng.random(seq.shape) < 0.6
        for i in range(1, len(seq)):
            seq[i][keep[i]] = seq[i - 1][keep[i]]
        expected = [rp.moved(seq[i], seq[i + 1]) for i in range(len(seq) - 1)]
        assert rp.moved_many(seq).tolist() == expected
        assert min(expected) >= 0 and max(expected) > 0


def test_window_load_is_uniform_inside_buckets():
    load = np.zeros((2, 1, 2))
    load[0, 0] = [100.0, 0.0]  # bucket 0: 10 steps, expert 0 only
    load[1, 0] = [0.0, 40.0]  # bucket 1: 4 steps, expert 1 only
    rp = Replay(LoadTrace(load=load, bucket_steps=[10, 4]), Topology(2))
    w = rp.cumulative(np.array([12])) - rp.cumulative(np.array([5]))
    np.testing.assert_allclose(w[0, 0], [50.0, 20.0])  # steps 5..9 of bucket 0, 10..11 of bucket 1


def test_static_and_hand_computed_balancedness():
    # 4 experts on 2 GPUs: static puts {0,1} on GPU 0 and {2,3} on GPU 1.
    load = np.array([[[10.0, 10.0, 0.0, 0.0]], [[10.0, 0.0, 10.0, 0.0]]])
    trace = LoadTrace(load=load, bucket_steps=[5, 5], bucket_seconds=1.0)
    res = simulate_static(trace, ep_size=2, cost=CostModel(moe_time_share=0.5))
    # bucket 0: loads 20 / 0 -> mean 10, max 20; bucket 1: 10 / 10 -> balanced.
    assert res.balancedness == pytest.approx(20 / 30)
    np.testing.assert_allclose(res.balancedness_over_time, [0.5, 1.0])
    # bucket 0 takes (0.5 + 0.5 * 2) x its ideal time, bucket 1 its ideal time.
    assert res.throughput.imbalance_factor == pytest.approx(2 / (1.5 + 1.0))
    assert res.throughput.relative == pytest.approx(2 / 2.5)
    assert res.rearrangements == 0 and res.experts_moved == 0


def test_static_with_uneven_split():
    load = np.ones((1, 1, 5))
    res = simulate_static(LoadTrace(load=load, bucket_steps=[1]), ep_size=2)
    assert res.balancedness == pytest.approx(2.5 / 3)  # 3 experts on GPU 0, 2 on GPU 1


def test_eplb_fixes_a_hot_expert_and_costs_memory():
    rng = np.random.default_rng(0)
    T, L, E = 12, 2, 16
    load = rng.poisson(20, size=(T, L, E)).astype(float)
    load[:, :, 3] += 2000  # one very hot expert
    trace = LoadTrace(load=load, bucket_steps=np.full(T, 100), bucket_seconds=5.0)
    cost = CostModel(bytes_per_expert=1e8)
    static = simulate_static(trace, ep_size=4, cost=cost)
    no_red = simulate(trace, ep_size=4, window_size=50, step_interval=100, num_redundant_experts=0,
                      cost=cost)
    red = simulate(trace, ep_size=4, window_size=50, step_interval=100, num_redundant_experts=4,
                   cost=cost)
    clair = simulate_clairvoyant(trace, ep_size=4, num_redundant_experts=4, cost=cost)
    # Without redundancy the hot expert's GPU stays the bottleneck; a replica splits it.
    assert red.balancedness > no_red.balancedness + 0.2
    assert clair.balancedness >= red.balancedness - 1e-9
    assert static.balancedness < red.balancedness
    assert red.throughput.kv_factor < 1.0 == no_red.throughput.kv_factor
    assert red.throughput.redundant_bytes_per_gpu == pytest.approx(L * 1e8 * 4 / 4)
    assert red.rearrangements == len(range(25, 1200, 100))
    json.dumps(red.to_dict())  # JSON-able
    d = red.to_dict()
    assert d["config"] == {"window_size": 50, "step_interval": 100, "num_redundant_experts": 4}
    assert len(d["balancedness_over_time"]) == T and len(d["balancedness_per_layer"]) == L


def test_sync_and_async_overheads():
    rng = np.random.default_rng(1)
    load = rng.integers(1, 100, size=(8, 58, 256)).astype(float)
    trace = LoadTrace(load=load, bucket_steps=np.full(8, 500), bucket_seconds=25.0)
    kw = dict(ep_size=32, num_nodes=4, num_groups=8, window_size=500, step_interval=1000,
              num_redundant_experts=32)
    sync = simulate(trace, cost=CostModel(use_async=False), **kw)
    asyn = simulate(trace, cost=CostModel(use_async=True), **kw)
    assert sync.throughput.overhead_seconds == pytest.approx(0.91 * sync.rearrangements)
    expected = CostModel().async_s_per_moved_byte * 3 * 7168 * 2048 * asyn.experts_moved / 32
    assert asyn.throughput.overhead_seconds == pytest.approx(expected)
    assert sync.balancedness == asyn.balancedness
    # DeepSeek-V3 shape: 58 layers x 44 MB x 32 / 32 GPUs taken from a 40 GiB KV cache.
    share = 58 * 3 * 7168 * 2048 / (40 * 1024**3)
    assert asyn.throughput.kv_factor == pytest.approx(1 - 0.5 * share)


def test_layer_stride_estimate_scales_moves_and_memory():
    trace = _int_trace(3, T=5, L=8, E=8, zero_bucket=False)
    full = Replay(trace, Topology(4)).run(Knobs(10, 7, 4))
    half = Replay(trace, Topology(4), layer_stride=2).run(Knobs(10, 7, 4))
    assert half.balancedness_per_layer.shape == (4,)
    np.testing.assert_allclose(half.balancedness_per_layer, full.balancedness_per_layer[::2])
    assert half.throughput.redundant_bytes_per_gpu == full.throughput.redundant_bytes_per_gpu
    assert half.rearrangements == full.rearrangements


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(num_redundant_experts=3), "num_redundant_experts"),
        (dict(window_size=0), "window_size"),
        (dict(step_interval=-5), "step_interval"),
        (dict(ep_size=0), "ep_size"),
        (dict(num_groups=3, num_nodes=1), "num_groups"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, needle):
    trace = LoadTrace(load=np.ones((2, 1, 8)), bucket_steps=[10, 10])
    args = {**dict(ep_size=4, window_size=10, step_interval=10, num_redundant_experts=0), **kwargs}
    with pytest.raises(SimError, match=needle):
        simulate(trace, **args)


def test_trace_without_steps_is_rejected():
    with pytest.raises(SimError, match="bucket_steps"):
        simulate_static(LoadTrace(load=np.ones((2, 1, 4)), bucket_steps=[0, 0]), ep_size=2)


def test_cost_model_rejects_bad_parameters():
    with pytest.raises(ValueError, match="moe_time_share"):
        CostModel(moe_time_share=1.5)
    with pytest.raises(ValueError, match="horizon_s"):
        CostModel(horizon_s=0)


@pytest.mark.parametrize("seed", range(4))
def test_batched_replay_equals_segment_by_segment(seed):
    """``run`` replays every segment and counts every move in one pass; the same numbers as one
    ``_replay`` segment and one ``moved`` pair at a time (zero-step buckets and redundancy with an
    expert twice on a GPU included): moves exactly, loads up to the float32 summation order of the
    per-GPU sum (BLAS may add a GPU's slots in another order for another number of rows)."""
    trace = _int_trace(seed, T=9, L=3, E=8)
    topo = Topology(ep_size=4, num_nodes=2, num_groups=4) if seed % 2 else Topology(ep_size=2)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        knobs = Knobs(int(rng.integers(1, 25)), int(rng.integers(1, 14)), int(rng.choice([0, 4, 8])))
        rp = Replay(trace, topo)
        res = rp.run(knobs)
        wins = rp.windows(knobs)
        placements = [rp.initial_placement(knobs.num_redundant_experts)]
        placements += [rp._cache[(s, e, knobs.num_redundant_experts)] for s, e in wins]
        bounds = [0] + [e for _, e in wins] + [rp.N]
        M = rp._replay([(bounds[j], bounds[j + 1], p) for j, p in enumerate(placements)])
        moved = [rp.moved(a, b) for a, b in zip(placements, placements[1:])]
        assert res.moved_per_rearrangement.tolist() == moved, knobs
        with np.errstate(invalid="ignore", divide="ignore"):
            per_layer = np.where(M.sum(0) > 0, rp.mean_gpu.sum(0) / M.sum(0), np.nan)
        np.testing.assert_allclose(res.balancedness_per_layer, per_layer, rtol=1e-6)
        assert res.balancedness == pytest.approx(rp.mean_gpu.sum() / M.sum(), rel=1e-6)


def test_window_whose_group_sum_overflows_float32_names_the_steps():
    """Loads that fit float32 but whose expert-group sum over a rearrangement window does not (the
    1e38 case): a SimError on ``load`` naming the window's steps and the layer, not a policy crash."""
    load = np.ones((4, 2, 8))
    load[2, 1, :4] = 1e37 * 10  # bucket 2 (steps 20..29): 1e37 per step for experts 0..3, one group
    trace = LoadTrace(load=load, bucket_steps=np.array([10, 10, 10, 10]))
    with pytest.raises(SimError) as err:
        Replay(trace, Topology(ep_size=4, num_nodes=2, num_groups=2)).run(Knobs(15, 8, 0))
    msg = str(err.value)
    assert msg.startswith("load: the window of engine steps 19..34, MoE layer 1: expert group 0")
    assert "divide by 1e6" in msg
