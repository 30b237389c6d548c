"""One rule for tests that need parts built by ``make kube`` (or installed, like Prometheus):
skipped with the reason on a developer's machine, failed in CI (``MOE_EPLB_REQUIRE_KUBE=1``), where a
missing part is a broken build, not a reason to run less."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    """Skip the test for ``reason``, or fail it where ``MOE_EPLB_REQUIRE_KUBE=1``."""
    if os.environ.get("MOE_EPLB_REQUIRE_KUBE") == "1":
        pytest.fail(f"MOE_EPLB_REQUIRE_KUBE=1 but {reason}")
    pytest.skip(reason)
