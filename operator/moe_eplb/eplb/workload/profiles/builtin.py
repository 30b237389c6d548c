"""The built-in fits: the packaged JSON (:data:`FIT_FILE`,
written by ``bench/fit_profiles.py``), read once."""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

from moe_eplb.eplb.workload.profiles.fits import PopularityFit, TemporalFit
from moe_eplb.eplb.workload.trace import TraceError

FIT_FILE = "profiles.json"  # packaged in this package, next to this module
FIT_FORMAT_VERSION = 1


@functools.lru_cache(maxsize=1)
def _builtin_raw() -> dict[str, Any]:
    text = importlib.resources.files("moe_eplb.eplb.workload.profiles").joinpath(FIT_FILE).read_text(encoding="utf-8")
    d = json.loads(text)
    if d.get("format_version") != FIT_FORMAT_VERSION:
        raise TraceError(f"{FIT_FILE}: format_version {d.get('format_version')} is not {FIT_FORMAT_VERSION}")
    return d


def builtin_popularity(name: str = "olmoe") -> PopularityFit:
    """A shipped :class:`PopularityFit` (``olmoe``: OLMoE-1B-7B, 64 experts; ``mixtral``:
    Mixtral-8x7B, 8 experts; ``olmoe-sft``: OLMoE SFT, chat only; ``deepseek-v3``: DeepSeek-V3,
    256 experts in 8 groups, every MoE layer, the six SGLang regimes as domains)."""
    fits = _builtin_raw()["popularity"]
    if name not in fits:
        raise TraceError(f"popularity fit {name!r} is not shipped; choose one of {', '.join(fits)}")
    return PopularityFit.from_dict(fits[name])


def builtin_temporal() -> TemporalFit:
    """The shipped :class:`TemporalFit` (Mixtral-8x7B-Instruct, GSM8K + HumanEval generations)."""
    return TemporalFit.from_dict(_builtin_raw()["temporal"])
