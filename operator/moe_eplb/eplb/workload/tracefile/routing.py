"""Real routing data (../shared/traces style JSON): per-domain expert counts (``DomainCounts``)
and token routing sequences (``TokenRouting``), read by ``read_routing_file``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_eplb.contracts import bounded_read, trace_format
from moe_eplb.eplb.workload.trace import (
    LoadTrace,
    TraceError,
)
from moe_eplb.eplb.workload.tracefile.convert import _counts, _numeric_array

KIND_EXPERT_COUNTS = "expert_counts_by_domain"
KIND_TOKEN_ROUTING = "token_routing_sequence"
ROUTING_KINDS = (KIND_EXPERT_COUNTS, KIND_TOKEN_ROUTING)


@dataclass(frozen=True)
class DomainCounts:
    """Expert popularity per domain, from an ``expert_counts_by_domain`` file.

    Attributes:
        counts: ``{domain: float64 [K, E]}``, tokens (top-k assignments) routed to expert e of
            sampled layer k over that domain's text.
        layers: ``[K]`` the model's layer index of each sampled layer.
        num_layers: the model's MoE layer count if the file says, else ``max(layers) + 1``.
        num_experts, top_k, model: as in the file.
    """

    counts: dict[str, np.ndarray]
    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    model: str
    num_layers: int

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.counts)

    def popularity(self, domain: str) -> np.ndarray:
        """``[K, E]`` share of each expert in each sampled layer (rows sum to 1)."""
        c = self.counts[domain]
        return c / c.sum(axis=1, keepdims=True)

    def depth(self) -> np.ndarray:
        """``[K]`` relative depth of each sampled layer in [0, 1]."""
        return np.asarray(self.layers, dtype=np.float64) / max(self.num_layers - 1, 1)


@dataclass(frozen=True)
class TokenRouting:
    """The experts chosen for each generated token, in order, from a ``token_routing_sequence``
    file.

    Attributes:
        choices: int64 ``[N, L, k]``, expert ids chosen for token n at layer l; -1 where the file
            has no choice recorded (some tokens have empty entries in some layers).
        sequence_id: int64 ``[N]``, the request (problem) each token belongs to.
        num_experts, top_k, model: as in the file.
    """

    choices: np.ndarray
    sequence_id: np.ndarray
    num_experts: int
    top_k: int
    model: str

    @property
    def num_layers(self) -> int:
        return int(self.choices.shape[1])

    def onehot(self) -> np.ndarray:
        """float64 ``[N, L, E]``, 1 for each chosen expert (0 where nothing was recorded)."""
        n, nl, _ = self.choices.shape
        out = np.zeros((n, nl, self.num_experts), dtype=np.float64)
        tok, lay, slot = np.nonzero(self.choices >= 0)
        np.add.at(out, (tok, lay, self.choices[tok, lay, slot]), 1.0)
        return out

    def to_trace(self, tokens_per_bucket: int = 1) -> LoadTrace:
        """A trace with one bucket per ``tokens_per_bucket`` generated tokens (batch size 1, so one
        engine step per token); a last partial bucket is dropped."""
        if tokens_per_bucket <= 0:
            raise TraceError(f"tokens_per_bucket: must be > 0, got {tokens_per_bucket}")
        hot = self.onehot()
        t = hot.shape[0] // tokens_per_bucket
        if t == 0:
            raise TraceError(
                f"tokens_per_bucket: {tokens_per_bucket} is more than the {hot.shape[0]} tokens in the file"
            )
        load = hot[: t * tokens_per_bucket].reshape(t, tokens_per_bucket, hot.shape[1], hot.shape[2]).sum(axis=1)
        return LoadTrace(
            load=load,
            bucket_steps=np.full(t, tokens_per_bucket, dtype=np.int64),
            top_k=self.top_k,
            model=self.model,
        )


#: Bounds of the routing files' scalars: the CRD's (spec.model.moe numExperts 2..4096, topK 1..64)
#: and at most 1024 MoE layers.
ROUTING_RANGES = {"num_experts": (2, 4096), "top_k": (1, 64), "num_layers": (1, 1024)}
#: Most bytes a routing data file may have (the shipped ones are under 1 MB).
MAX_ROUTING_FILE_BYTES = 256 * 2**20


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise TraceError(f"{where}: key {key!r} is missing")
    return d[key]


def _routing_int(d: Mapping[str, Any], key: str, where: str, required: bool = True) -> int | None:
    if not required and d.get(key) is None:
        return None
    lo, hi = ROUTING_RANGES[key]
    return bounded_read.whole_number(_require(d, key, where), f"{where}: {key}", lo, hi, error=TraceError)


def _model_name(d: Mapping[str, Any], where: str) -> str:
    model = d.get("model", "unknown")
    if not isinstance(model, str):
        raise TraceError(f"{where}: model: expected a string, got {type(model).__name__}")
    return model


def domain_counts_from_dict(d: Mapping[str, Any], where: str = "expert counts") -> DomainCounts:
    """Parse an ``expert_counts_by_domain`` dict (``counts[domain][i][e]`` over ``layers[i]``)."""
    num_experts = _routing_int(d, "num_experts", where)
    top_k = _routing_int(d, "top_k", where)
    if top_k > num_experts:
        raise TraceError(f"{where}: top_k: {top_k} is more than num_experts {num_experts}")
    layers = _require(d, "layers", where)
    if not isinstance(layers, list) or not layers or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < ROUTING_RANGES["num_layers"][1] for x in layers):
        raise TraceError(f"{where}: layers must be a non-empty list of layer indices 0..{ROUTING_RANGES['num_layers'][1] - 1}")
    raw = _require(d, "counts", where)
    if not isinstance(raw, Mapping) or not raw:
        raise TraceError(f"{where}: counts must be an object {{domain: [[count per expert] per layer]}}")
    counts: dict[str, np.ndarray] = {}
    for domain, rows in raw.items():
        arr = _numeric_array(rows, f"{where}: counts.{domain}").astype(np.float64)
        if arr.shape != (len(layers), num_experts):
            raise TraceError(f"{where}: counts.{domain}: shape {arr.shape}, expected ({len(layers)}, {num_experts})")
        _counts(arr, f"{where}: counts.{domain}", ("layer", "expert"))
        if np.any(arr.sum(axis=1) <= 0):
            raise TraceError(f"{where}: counts.{domain}: a layer has no tokens at all")
        counts[str(domain)] = arr
    num_layers = _routing_int(d, "num_layers", where, required=False) or max(layers) + 1
    if num_layers <= max(layers):
        raise TraceError(f"{where}: num_layers: {num_layers} but layers go up to {max(layers)}")
    return DomainCounts(
        counts=counts,
        layers=tuple(int(x) for x in layers),
        num_experts=num_experts,
        top_k=top_k,
        model=_model_name(d, where),
        num_layers=num_layers,
    )


def token_routing_from_dict(d: Mapping[str, Any], where: str = "token routing",
                            max_bytes: int = trace_format.MAX_TRACE_BYTES) -> TokenRouting:
    """Parse a ``token_routing_sequence`` dict (``experts[t][layer] = [top-k expert ids]``); its
    one-hot load (tokens x layers x experts, float64) must fit in ``max_bytes``."""
    num_experts = _routing_int(d, "num_experts", where)
    top_k = _routing_int(d, "top_k", where)
    if top_k > num_experts:
        raise TraceError(f"{where}: top_k: {top_k} is more than num_experts {num_experts}")
    experts = _require(d, "experts", where)
    if not isinstance(experts, list) or not experts:
        raise TraceError(f"{where}: experts must be a non-empty list of tokens")
    if not isinstance(experts[0], list):
        raise TraceError(f"{where}: experts[0] must be a list (one entry per layer)")
    num_layers = _routing_int(d, "num_layers", where, required=False) or len(experts[0])
    if num_layers > ROUTING_RANGES["num_layers"][1]:
        raise TraceError(f"{where}: experts[0] has {num_layers} layers, at most {ROUTING_RANGES['num_layers'][1]}")
    bounded_read.check_working_set(
        len(experts) * num_layers * max(num_experts, top_k) * 8.0, max_bytes, where,
        f"the load of {len(experts)} tokens x {num_layers} layers x {num_experts} experts", error=TraceError,
        fix="use fewer tokens")
    choices = np.full((len(experts), num_layers, top_k), -1, dtype=np.int64)
    for t, token in enumerate(experts):
        if not isinstance(token, list) or len(token) != num_layers:
            got = len(token) if isinstance(token, list) else "?"
            raise TraceError(f"{where}: experts[{t}] has {got} layers, expected {num_layers}")
        for layer, chosen in enumerate(token):
            if not chosen:
                continue  # not recorded for this token and layer
            if not isinstance(chosen, list) or len(chosen) != top_k or not all(
                    isinstance(e, int) and not isinstance(e, bool) and 0 <= e < num_experts for e in chosen):
                raise TraceError(f"{where}: experts[{t}][{layer}] = {str(chosen)[:60]} is not {top_k} expert ids "
                                 f"< {num_experts}")
            choices[t, layer] = chosen
    seq = d.get("problem_id", [0] * len(experts))
    if not isinstance(seq, list) or len(seq) != len(experts):
        raise TraceError(f"{where}: problem_id must list one request id for each of the {len(experts)} tokens")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= bounded_read.INT64_MAX for x in seq):
        raise TraceError(f"{where}: problem_id: request ids are integers in 0..2**63-1")
    return TokenRouting(
        choices=choices,
        sequence_id=np.asarray(seq, dtype=np.int64),
        num_experts=num_experts,
        top_k=top_k,
        model=_model_name(d, where),
    )


def read_routing_file(path: str | os.PathLike, *, max_bytes: int = MAX_ROUTING_FILE_BYTES) -> DomainCounts | TokenRouting:
    """Read a real routing data file (``kind`` ``expert_counts_by_domain`` or
    ``token_routing_sequence``; ``.gz`` gunzipped), bounded like a trace
    (:mod:`moe_eplb.contracts.bounded_read`: size, decompressed size, JSON values, depth, duplicate keys,
    non-finite numbers) and strict."""
    path = Path(path)
    raw = bounded_read.read_bytes(path, max_bytes=max_bytes, error=TraceError, what="routing data file",
                                  max_values=bounded_read.MAX_JSON_VALUES)
    d = bounded_read.parse_json(raw, str(path), error=TraceError)
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == KIND_EXPERT_COUNTS:
        return domain_counts_from_dict(d, str(path))
    if kind == KIND_TOKEN_ROUTING:
        return token_routing_from_dict(d, str(path))
    raise TraceError(f"{path}: kind is {str(kind)[:40]!r}; expected one of {', '.join(ROUTING_KINDS)}")
