"""The test bridge itself: its torch port of vLLM's mapping/recording kernel against a plain-Python
transcription of the Triton kernel, and its refusal to bridge code vLLM no longer has.
No engine is started here (a few seconds)."""

from __future__ import annotations

import subprocess

import pytest

from moe_eplb_harness.vllm_engine import harness

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]


@pytest.fixture(scope="module")
def bridge(cpu_wheel):
    from moe_eplb_harness.vllm_engine import cpu_eplb_bridge

    return cpu_eplb_bridge


def kernel_reference(topk_ids, load, l2p, count, record, unpadded):
    """A transcription of ``_eplb_map_and_record_i32_kernel`` (vllm/model_executor/layers/fused_moe/router/
    base_router.py, vLLM 0.32.0) element by element."""
    flat = topk_ids.reshape(-1).tolist()
    k = topk_ids.shape[-1]
    E = count.shape[0]
    out = []
    for offs, expert in enumerate(flat):
        valid = 0 <= expert < E
        safe = expert if valid else 0
        rc = max(int(count[safe]) if valid else 1, 1)
        replica = ((offs // k) * 2654435769 & 0xFFFFFFFF) % rc
        phys = int(l2p[safe, replica]) if valid else -1
        out.append(phys)
        unpadded_ok = True if unpadded is None else offs < int(unpadded) * k
        if record and unpadded_ok and 0 <= phys < load.shape[0]:
            load[phys] += 1
    import torch

    return torch.tensor(out, dtype=topk_ids.dtype).reshape(topk_ids.shape)


@pytest.mark.parametrize("record,unpadded", [(True, None), (True, 5), (False, None), (True, 0)])
def test_torch_port_matches_the_triton_kernel(bridge, record, unpadded):
    import torch

    gen = torch.Generator().manual_seed(7)
    E, P, N, k = 6, 9, 11, 2
    # a placement with replicas: experts 1, 4 and 5 have 2 copies
    p2l = [0, 1, 2, 3, 4, 5, 1, 4, 5]
    count = torch.tensor([p2l.count(e) for e in range(E)], dtype=torch.int64)
    l2p = torch.full((E, 2), -1, dtype=torch.int64)
    for e in range(E):
        slots = [p for p, x in enumerate(p2l) if x == e]
        l2p[e, : len(slots)] = torch.tensor(slots)
    ids = torch.randint(0, E, (N, k), generator=gen, dtype=torch.int32)
    ids[3, 1] = -1  # invalid ids: mapped to -1, not counted
    ids[7, 0] = E
    want_load = torch.zeros(P, dtype=torch.int32)
    want = kernel_reference(ids, want_load, l2p, count, record, unpadded)
    load = torch.zeros(P, dtype=torch.int32)
    got = bridge.eplb_map_to_physical_and_record(
        ids, load, l2p, count, torch.tensor(record), None if unpadded is None else torch.tensor([unpadded]))
    assert torch.equal(got, want) and got.dtype == ids.dtype
    assert torch.equal(load, want_load)
    if record and unpadded is None:
        assert int(load.sum()) == N * k - 2  # every (token, slot) but the two invalid ids


def test_replicas_share_an_experts_tokens_by_token_hash(bridge):
    """Every token routed to a replicated expert lands on one of its replicas, spread by the hash."""
    import torch

    l2p = torch.tensor([[0, 2], [1, -1]])
    count = torch.tensor([2, 1])
    ids = torch.zeros((64, 1), dtype=torch.int64)
    load = torch.zeros(3, dtype=torch.int32)
    got = bridge.eplb_map_to_physical_and_record(ids, load, l2p, count, torch.tensor(True))
    assert set(got.reshape(-1).tolist()) == {0, 2}
    assert load.tolist()[1] == 0 and sum(load.tolist()) == 64 and min(load[0], load[2]) > 16


def test_a_one_token_batch_always_takes_the_first_replica(bridge):
    """vLLM hashes the token's index IN THE BATCH (hash(0) = 0): when each step routes one token
    (a single request decoding), an expert's redundant replicas get none of its load. The
    simulated engines split an expert's tokens evenly over its replicas whatever the batch."""
    import torch

    l2p = torch.tensor([[0, 2], [1, -1]])
    count = torch.tensor([2, 1])
    load = torch.zeros(3, dtype=torch.int32)
    for _ in range(50):  # 50 decode steps of one token, top-1 on the replicated expert
        bridge.eplb_map_to_physical_and_record(torch.zeros((1, 1), dtype=torch.int64), load, l2p, count,
                                               torch.tensor(True))
    assert load.tolist() == [50, 0, 0]


def test_each_point_refuses_code_vllm_no_longer_has(bridge, monkeypatch):
    import vllm
    from vllm.model_executor.layers.fused_moe.router import base_router

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(bridge.BridgeOutdated, match="point 0"):
        bridge.check_version()
    monkeypatch.undo()

    def fixed_upstream(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count,
                       record_enabled, num_unpadded_tokens=None):
        return logical_to_physical_map[topk_ids.long(), 0]

    monkeypatch.setattr(base_router, "eplb_map_to_physical_and_record", fixed_upstream)
    with pytest.raises(bridge.BridgeOutdated, match="point 4"):
        bridge.bridge_router()
    assert base_router.eplb_map_to_physical_and_record is fixed_upstream  # left alone


def test_register_bridges_all_five_points_in_a_fresh_process(bridge_dir):
    """What vLLM's plugin loader does in each process: the entry point from the generated
    dist-info, found through PYTHONPATH alone."""
    from moe_eplb_harness.vllm_engine import plugin_dist

    env = plugin_dist.prepend_path({"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "cpu_eplb_bridge"}, bridge_dir,
                                   harness.OPERATOR_DIR)
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.model_executor.layers.fused_moe.router import base_router as b; "
            "from vllm.distributed.eplb import eplb_state as s; "
            "print(b.eplb_map_to_physical_and_record.__module__, s.torch.Event.__name__)")
    out = subprocess.run([harness.PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpu-eplb-bridge: 5/5 gaps bridged (vLLM 0.32.0" in out.stderr
    assert out.stdout.split() == ["cpu_eplb_bridge", "PerfCounterEvent"]
