"""One rule for tests that need parts that are built or installed separately: skipped with the
reason on a developer's machine, failed in CI, where a missing part is a broken build, not a reason
to run less.

* ``make kube``'s control plane (or an installed binary, like Prometheus): :func:`missing`, failed
  where ``MOE_EPLB_REQUIRE_KUBE=1``;
* vLLM's CPU wheel (``make setup-vllm``) for the tests marked ``vllm``: ``tests/conftest.py`` skips
  every such test with :func:`vllm_missing_reason` when the wheel (or torch) is absent, and fails
  it where ``MOE_EPLB_REQUIRE_VLLM=1`` -- so a fresh clone's ``make test-fast`` passes without vLLM,
  and CI (``.ci/run`` sets both variables) cannot silently run less;
* a Prometheus server and its ``promtool`` for the tests marked ``prometheus`` (the Debian package's,
  or ``make prometheus``'s build from its Go module, or ``$MOE_EPLB_PROMETHEUS``:
  :func:`moe_eplb_harness.floor.prometheus.find_prometheus`): :func:`prometheus_tools`, failed where
  ``MOE_EPLB_REQUIRE_PROMETHEUS=1``.

``make test`` and ``make test-slow`` set every ``MOE_EPLB_REQUIRE_*`` to 1 unless it is set already
(they build or install each part first), so there a missing part fails with one line naming the make
target to run; ``pytest`` run by hand skips with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, NoReturn

import pytest

REQUIRE_KUBE = "MOE_EPLB_REQUIRE_KUBE"
REQUIRE_VLLM = "MOE_EPLB_REQUIRE_VLLM"
REQUIRE_PROMETHEUS = "MOE_EPLB_REQUIRE_PROMETHEUS"


def missing(reason: str, *, required_by: str = REQUIRE_KUBE) -> NoReturn:
    """Skip the test for ``reason``, or fail it where ``required_by`` is set to 1."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@functools.cache
def vllm_missing_reason() -> str | None:
    """None when vLLM's CPU wheel and torch are installed, else what is missing (found, not imported:
    importing vLLM takes seconds; a test that needs more of it says so itself)."""
    for module in ("torch", "vllm"):
        if importlib.util.find_spec(module) is None:
            return f"needs vLLM (marker vllm): the {module!r} package is not installed (make setup-vllm)"
    return None


def missing_vllm(reason: str) -> NoReturn:
    """Skip a test that needs vLLM for ``reason``, or fail it where ``MOE_EPLB_REQUIRE_VLLM=1``."""
    missing(reason, required_by=REQUIRE_VLLM)


def prometheus_tools() -> Any:
    """The Prometheus server and ``promtool`` to run (a
    :class:`~moe_eplb_harness.floor.prometheus.PrometheusTools`); without a pair, the test is skipped
    with the one-line reason (it names ``make prometheus``), or failed where ``MOE_EPLB_REQUIRE_PROMETHEUS=1``."""
    from moe_eplb_harness.floor.prometheus import find_prometheus

    found = find_prometheus()
    if found.problem is not None:
        missing(found.problem, required_by=REQUIRE_PROMETHEUS)
    return found
