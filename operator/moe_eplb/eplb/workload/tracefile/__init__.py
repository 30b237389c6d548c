"""Reading and writing load traces, and the real routing data files (``expert_counts_by_domain``
and ``token_routing_sequence`` JSON).

The file format itself (keys, types, suffixes, the bounded raw reader and the atomic writer) is the
contract :mod:`moe_eplb.contracts.trace_format`; here the raw mapping is validated strictly into a
:class:`~moe_eplb.eplb.workload.trace.LoadTrace` (:func:`trace_from_dict`) and back (:func:`trace_to_dict`).
Everything except :func:`load_trace` / :func:`save_trace` / :func:`read_routing_file` is a pure
function. Every problem raises :class:`~moe_eplb.eplb.workload.trace.TraceError` whose message starts with
the key (or file) at fault and says how to fix it.

In parts (each imports only the ones listed before it):

- ``convert``: the mapping <-> ``LoadTrace``, strict;
- ``routing``: the real routing data files;
- ``files``: ``load_trace``, ``save_trace``.
"""

from moe_eplb.eplb.workload.tracefile.convert import telemetry_from_dict, telemetry_to_dict, trace_from_dict, trace_to_dict
from moe_eplb.eplb.workload.tracefile.files import TRACE_SUFFIXES, load_trace, save_trace, trace_suffix
from moe_eplb.eplb.workload.tracefile.routing import (
    KIND_EXPERT_COUNTS,
    KIND_TOKEN_ROUTING,
    MAX_ROUTING_FILE_BYTES,
    ROUTING_KINDS,
    ROUTING_RANGES,
    DomainCounts,
    TokenRouting,
    domain_counts_from_dict,
    read_routing_file,
    token_routing_from_dict,
)

__all__ = ["DomainCounts", "KIND_EXPERT_COUNTS", "KIND_TOKEN_ROUTING", "MAX_ROUTING_FILE_BYTES", "ROUTING_KINDS",
           "ROUTING_RANGES", "TRACE_SUFFIXES", "TokenRouting", "domain_counts_from_dict", "load_trace", "read_routing_file",
           "save_trace", "telemetry_from_dict", "telemetry_to_dict", "token_routing_from_dict", "trace_from_dict",
           "trace_suffix", "trace_to_dict"]
