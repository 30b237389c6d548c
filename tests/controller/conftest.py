"""Fixtures of the operator-in-the-loop tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

NS = "default"


@pytest.fixture()
def started(emulated_cluster, operator_runner, eventually) -> Callable[..., Any]:
    """``async with started(resource, **operator_kw) as obj:`` runs the real operator against
    ``emulated_cluster``, creates ``resource`` in namespace ``default`` and waits until its status has observed
    generation 1; ``obj`` is the resource as stored then. The operator stops when the block exits."""

    @contextlib.asynccontextmanager
    async def start(resource: dict, **operator_kw: Any) -> AsyncIterator[dict]:
        name = resource["metadata"]["name"]

        async def observed() -> dict | None:
            obj = await emulated_cluster.get(emulated_cluster.moeinference_path(NS, name))
            return obj if (obj.get("status") or {}).get("observedGeneration") == 1 else None

        async with operator_runner(**operator_kw):
            await emulated_cluster.create(emulated_cluster.moeinference_path(NS), resource)
            yield await eventually(observed)

    return start
