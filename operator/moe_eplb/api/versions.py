"""vLLM versions: parsing, comparison, and the version thresholds the project relies on.

A version is a tuple ``(major, minor, patch)`` of ints; pre-release/build suffixes are dropped
(``v0.12.0rc1`` -> ``(0, 12, 0)``).
"""

from __future__ import annotations

import re

Version = tuple[int, int, int]

_VERSION_RE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")

EPLB_FIRST = (0, 9, 0)  # --enable-eplb exists
EPLB_CONFIG_JSON = (0, 10, 2)  # --eplb-config '{...}' replaces the flat flags
FLAT_EPLB_FLAGS_REMOVED = (0, 12, 0)  # --num-redundant-experts etc. no longer accepted
SHUTDOWN_TIMEOUT_FLAG = (0, 18, 0)  # --shutdown-timeout N: drain in-flight requests on SIGTERM (vLLM PR #34730)


def parse_version(text: str | None) -> Version | None:
    """First ``X.Y.Z`` in ``text`` (optionally ``v``-prefixed), else None."""
    if not text:
        return None
    match = _VERSION_RE.search(text)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def format_version(version: Version) -> str:
    return ".".join(map(str, version))


def uses_eplb_config_json(version: Version) -> bool:
    """True when EPLB settings go in ``--eplb-config`` JSON (vLLM >= 0.10.2); else flat flags."""
    return version >= EPLB_CONFIG_JSON
