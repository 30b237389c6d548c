"""Shared fixtures of the EPLB math tests."""

from __future__ import annotations

import pytest

from moe_eplb.eplb.replay import kernels


@pytest.fixture(params=["compiled", "numpy"])
def kernel_path(request, monkeypatch):
    """Run the test once with the compiled kernels (:mod:`moe_eplb.eplb.replay.kernels`, Numba) and once
    with the NumPy code they replace; both must give the same answers. The compiled run is skipped
    where Numba cannot be imported (or ``MOE_EPLB_NO_JIT=1`` is set)."""
    if request.param == "compiled" and not kernels.AVAILABLE:
        pytest.skip(f"no compiled kernels here ({kernels.DISABLED_REASON}); the NumPy run covers this")
    monkeypatch.setattr(kernels, "ENABLED", request.param == "compiled")
    return request.param
