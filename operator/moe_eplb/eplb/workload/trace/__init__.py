"""``LoadTrace``, the one in-memory trace type, and what a trace holds beside the load (a contract
of its file format: :mod:`moe_eplb.contracts.trace_format`, docs/traces.md), in two parts:

- ``loadtrace``: ``LoadTrace``, ``Telemetry``, ``Rearrangement``, ``RecordedConfig``, ``served_imbalance``;
- ``consistency``: ``physical_checks``, the physical consistency of the telemetry with the load
  (docs/traces.md, "Consistency checks").
"""

from moe_eplb.contracts.trace_format import OPTIONAL_KEYS as TRACE_KEYS_OPTIONAL
from moe_eplb.contracts.trace_format import REQUIRED_KEYS as TRACE_KEYS_REQUIRED
from moe_eplb.contracts.trace_format import TELEMETRY_KEYS as TRACE_KEYS_TELEMETRY
from moe_eplb.contracts.trace_format import TraceError
from moe_eplb.eplb.workload.trace.consistency import physical_checks
from moe_eplb.eplb.workload.trace.loadtrace import LoadTrace, Rearrangement, RecordedConfig, Telemetry, served_imbalance

__all__ = ["LoadTrace", "Telemetry", "Rearrangement", "RecordedConfig", "TraceError", "TRACE_KEYS_REQUIRED",
           "TRACE_KEYS_OPTIONAL", "TRACE_KEYS_TELEMETRY", "served_imbalance", "physical_checks"]
