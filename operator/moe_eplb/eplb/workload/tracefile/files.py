"""Trace files: ``load_trace`` and ``save_trace`` by suffix (JSON, gzip'd JSON or ``.npz``), read
within the bounds of :mod:`moe_eplb.contracts.bounded_read`."""

from __future__ import annotations

import os
from pathlib import Path

from moe_eplb.contracts import trace_format
from moe_eplb.eplb.workload.trace import (
    LoadTrace,
    TraceError,
)
from moe_eplb.eplb.workload.tracefile.convert import trace_from_dict, trace_to_dict
from moe_eplb.eplb.workload.tracefile.routing import ROUTING_KINDS

TRACE_SUFFIXES = trace_format.SUFFIXES


def trace_suffix(path: str | os.PathLike) -> str:
    """The trace format ``path`` names (one of :data:`TRACE_SUFFIXES`); anything else raises."""
    return trace_format.suffix_of(path)


def load_trace(path: str | os.PathLike, *, max_bytes: int = trace_format.MAX_TRACE_BYTES) -> LoadTrace:
    """Read a trace file (``.json``, ``.json.gz`` or ``.npz``, chosen by suffix), bounded (at most
    ``max_bytes``, see :func:`moe_eplb.contracts.trace_format.read_trace_file`) and strict."""
    d = trace_format.read_trace_file(path, max_bytes=max_bytes)
    if d.get("kind") in ROUTING_KINDS:
        raise TraceError(
            f"{path}: is a routing data file (kind {d['kind']!r}), not a load trace; "
            "use read_routing_file() or `moe-eplb trace synth --from`"
        )
    try:
        return trace_from_dict(d)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def save_trace(trace: LoadTrace, path: str | os.PathLike) -> Path:
    """Write ``trace`` to ``path`` in the format its suffix names (atomically); returns the path."""
    return trace_format.write_trace_file(trace_to_dict(trace, arrays=True), path)
