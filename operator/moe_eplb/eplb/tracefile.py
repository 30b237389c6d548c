"""Reading and writing load traces, and the real routing data files (``expert_counts_by_domain``
and ``token_routing_sequence`` JSON).

The file format itself (keys, types, suffixes, the bounded raw reader and the atomic writer) is the
contract :mod:`moe_eplb.contracts.trace_format`; here the raw mapping is validated strictly into a
:class:`~moe_eplb.eplb.trace.LoadTrace` (:func:`trace_from_dict`) and back (:func:`trace_to_dict`).
Everything except :func:`load_trace` / :func:`save_trace` / :func:`read_routing_file` is a pure
function. Every problem raises :class:`~moe_eplb.eplb.trace.TraceError` whose message starts with
the key (or file) at fault and says how to fix it.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_eplb.api.knobs import Knobs, KnobsError
from moe_eplb.contracts import bounded_read, trace_format
from moe_eplb.eplb.trace import (
    TRACE_KEYS_OPTIONAL,
    TRACE_KEYS_REQUIRED,
    TRACE_KEYS_TELEMETRY,
    LoadTrace,
    Rearrangement,
    RecordedConfig,
    Telemetry,
    TraceError,
    physical_checks,
)

TRACE_SUFFIXES = trace_format.SUFFIXES


# --------------------------------------------------------------------------------------------------
# dict <-> LoadTrace
# --------------------------------------------------------------------------------------------------


def _positive_int(d: Mapping[str, Any], key: str) -> int:
    value = d[key]
    if isinstance(value, np.ndarray) and value.ndim != 0:
        raise TraceError(f"{key}: expected one integer, got an array of shape {value.shape}")
    return bounded_read.whole_number(value, key, 1, error=TraceError)


def _counts(arr: np.ndarray, key: str, axes: tuple[str, ...]) -> np.ndarray:
    """``arr`` of counts: finite, >= 0 and at most :data:`~moe_eplb.contracts.bounded_read.MAX_COUNT` each
    (so float64 sums and int64 casts stay exact); the first bad value named by its place."""
    bad = ~np.isfinite(arr) if arr.dtype.kind == "f" else np.zeros(arr.shape, bool)
    what, above = "NaN or infinite value", ""
    if not bad.any():
        bad, what = arr < 0, "negative value"
    if not bad.any():
        bad, what, above = arr > bounded_read.MAX_COUNT, "value", " above 2**53"
    if bad.any():
        idx = np.argwhere(bad)[0]
        at = ", ".join(f"{a} {int(i)}" for a, i in zip(axes, idx))
        raise TraceError(f"{key}: {what} {float(arr[tuple(idx)])!r}{above} at {at}; counts are finite, >= 0 and at "
                         "most 2**53 (exact in float64)")
    return arr


def _numeric_array(value: Any, key: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise TraceError(f"{key}: not a rectangular array of numbers ({exc})") from None
    if arr.dtype == object:
        raise TraceError(f"{key}: not a rectangular array of numbers (ragged lists or non-numbers)")
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise TraceError(f"{key}: expected numbers, got values of type {arr.dtype}")
    return arr


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _nullable_numbers(value: Any, key: str) -> np.ndarray:
    """A 1-D list of numbers in which JSON ``null`` (None) stands for NaN (``step_seconds`` of a
    bucket without steps); arrays pass through :func:`_numeric_array`."""
    if isinstance(value, (list, tuple)) and any(v is None for v in value):
        out = []
        for i, v in enumerate(value):
            if v is None:
                out.append(math.nan)
            elif isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TraceError(f"{key}: expected numbers or null, got {v!r} at bucket {i}")
            else:
                out.append(float(v))
        return np.asarray(out, dtype=np.float64)
    return _numeric_array(value, key)


def _whole_field(value: Any, key: str, minimum: int, maximum: int = bounded_read.INT64_MAX) -> int:
    return bounded_read.whole_number(value, key, minimum, maximum, error=TraceError)


def _rearrangements(value: Any) -> tuple[Rearrangement, ...]:
    if not isinstance(value, (list, tuple)):
        raise TraceError(f'rearrangements: expected a list of {{"bucket": int, "seconds": number}}, '
                         f"got {type(value).__name__}")
    out = []
    for i, ev in enumerate(value):
        where = f"rearrangements[{i}]"
        if not isinstance(ev, Mapping):
            raise TraceError(f'{where}: expected {{"bucket": int, "seconds": number}}, got {ev!r}')
        unknown = sorted(set(ev) - {"bucket", "seconds"})
        if unknown:
            raise TraceError(f"{where}.{unknown[0]}: unknown key (allowed: bucket, seconds)")
        for k in ("bucket", "seconds"):
            if k not in ev:
                raise TraceError(f"{where}.{k}: required key is missing")
        secs = ev["seconds"]
        if isinstance(secs, bool) or not isinstance(secs, numbers.Real) or not math.isfinite(secs) or secs < 0:
            raise TraceError(f"{where}.seconds: expected a duration >= 0 (seconds), got {secs!r}")
        out.append(Rearrangement(_whole_field(ev["bucket"], f"{where}.bucket", 0), float(secs)))
    return tuple(out)


def _config(value: Any) -> RecordedConfig:
    from moe_eplb.contracts.trace_format import CONFIG_KEYS

    if not isinstance(value, Mapping):
        raise TraceError(f"config: expected an object with keys {', '.join(CONFIG_KEYS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(CONFIG_KEYS))
    if unknown:
        raise TraceError(f"config.{unknown[0]}: unknown key (allowed: {', '.join(CONFIG_KEYS)})")
    knob_keys = ("window_size", "step_interval", "num_redundant_experts")
    for k in knob_keys:
        if value.get(k) is None:
            raise TraceError(f"config.{k}: required key is missing")
    ranges = trace_format.CONFIG_RANGES
    try:
        knobs = Knobs(*(_whole_field(value[k], f"config.{k}", *ranges[k]) for k in knob_keys))
    except KnobsError as exc:
        raise TraceError(f"config.{exc}") from None
    ep = value.get("ep_size")
    ep = None if ep is None else _whole_field(ep, "config.ep_size", *ranges["ep_size"])
    use_async = _scalar(value.get("use_async"))
    if use_async is not None and not isinstance(use_async, (bool, np.bool_)):
        raise TraceError(f"config.use_async: expected true, false or null, got {use_async!r}")
    return RecordedConfig(knobs, ep, None if use_async is None else bool(use_async))


def telemetry_from_dict(d: Mapping[str, Any]) -> Telemetry | None:
    """The telemetry keys of a file-format dict as a :class:`Telemetry` (None when there are none).
    Types are checked here; shapes and ranges against the trace in :meth:`Telemetry.check`."""
    present = [k for k in TRACE_KEYS_TELEMETRY if d.get(k) is not None]
    if not present:
        return None
    kw: dict[str, Any] = {}
    for key in ("step_seconds", "kv_cache_usage", "requests_waiting",  # null: no measurement (no steps)
                "prefix_cache_hit_rate"):  # null: nothing queried
        if key in present:
            kw[key] = _nullable_numbers(d[key], key)
    for key in ("rank_load", "preemptions", "prefix_cache_queries"):
        if key in present:
            kw[key] = _numeric_array(d[key], key)
            with np.errstate(invalid="ignore"):
                big = kw[key] > bounded_read.MAX_COUNT  # NaN and negatives: Telemetry.check names them
            if big.any():
                at = ", ".join(f"{a} {int(i)}" for a, i in zip(("bucket", "layer", "rank"), np.argwhere(big)[0]))
                raise TraceError(f"{key}: value {float(kw[key][big][0])!r} above 2**53 at {at}; counts are at most "
                                 "2**53 (exact in float64)")
    if "rearrangements" in present:
        kw["rearrangements"] = _rearrangements(d["rearrangements"])
    if "config" in present:
        kw["config"] = _config(d["config"])
    if "kv_cache_bytes_per_gpu" in present:
        kv = _scalar(d["kv_cache_bytes_per_gpu"])
        if isinstance(kv, bool) or not isinstance(kv, numbers.Real) or not math.isfinite(kv) or kv <= 0:
            raise TraceError(f"kv_cache_bytes_per_gpu: expected a number > 0 (bytes), got {kv!r}")
        kw["kv_cache_bytes_per_gpu"] = float(kv)
    for key in ("kv_cache_blocks", "kv_block_size"):
        if key in present:
            kw[key] = _whole_field(d[key], key, 1)
    return Telemetry(**kw)


def trace_from_dict(d: Mapping[str, Any]) -> LoadTrace:
    """Build a :class:`LoadTrace` from the file-format dict (keys in the module docstring).

    Strict: unknown or missing keys, ``num_layers`` / ``num_experts`` that disagree with ``load``'s
    shape, a ``bucket_steps`` whose length is not T, empty, negative, NaN or infinite values, and
    telemetry keys of the wrong shape or range all raise :class:`TraceError` naming the key.
    """
    if not isinstance(d, Mapping):
        raise TraceError(f"trace: expected a JSON object with keys {list(TRACE_KEYS_REQUIRED)}, got {type(d).__name__}")
    allowed = set(TRACE_KEYS_REQUIRED) | set(TRACE_KEYS_OPTIONAL) | set(TRACE_KEYS_TELEMETRY)
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise TraceError(
            f"{unknown[0]}: unknown key (allowed keys: "
            f"{', '.join(TRACE_KEYS_REQUIRED + TRACE_KEYS_OPTIONAL + TRACE_KEYS_TELEMETRY)})"
        )
    missing = [k for k in TRACE_KEYS_REQUIRED if k not in d]
    if missing:
        raise TraceError(f"{missing[0]}: required key is missing")
    num_layers = _positive_int(d, "num_layers")
    num_experts = _positive_int(d, "num_experts")
    load = _numeric_array(d["load"], "load")
    if load.ndim == 3:
        _counts(load, "load", ("bucket", "layer", "expert"))
    if load.size == 0 and load.ndim >= 1 and load.shape[0] == 0:
        raise TraceError("load: the trace is empty (0 buckets); record at least one bucket")
    if load.ndim != 3:
        raise TraceError(f"load: expected a T x L x E array, got {load.ndim} dimension(s) with shape {load.shape}")
    if load.shape[1] != num_layers:
        raise TraceError(f"num_layers: is {num_layers} but load has {load.shape[1]} layers (shape {load.shape})")
    if load.shape[2] != num_experts:
        raise TraceError(f"num_experts: is {num_experts} but load has {load.shape[2]} experts (shape {load.shape})")
    steps = _numeric_array(d["bucket_steps"], "bucket_steps")
    if steps.ndim != 1:
        raise TraceError(f"bucket_steps: expected a list of T integers, got shape {steps.shape}")
    if steps.shape[0] != load.shape[0]:
        raise TraceError(f"bucket_steps: length {steps.shape[0]} does not match the {load.shape[0]} buckets of load")
    _counts(steps, "bucket_steps", ("bucket",))
    if np.any(steps != np.round(steps)):
        t = int(np.argmax(steps != np.round(steps)))
        raise TraceError(f"bucket_steps: {float(steps[t])!r} at bucket {t}: must be whole numbers of engine steps")
    if float(steps.astype(np.float64).sum()) > bounded_read.MAX_COUNT:
        raise TraceError(f"bucket_steps: {float(steps.astype(np.float64).sum()):.3g} engine steps in all, more than "
                         "2**53; a trace counts real engine steps")
    kwargs: dict[str, Any] = {}
    if d.get("bucket_seconds") is not None:
        kwargs["bucket_seconds"] = bounded_read.finite_number(d["bucket_seconds"], "bucket_seconds", 0.0, 86400.0 * 366,
                                                              strict_lo=True, error=TraceError)
    if d.get("top_k") is not None:
        kwargs["top_k"] = _positive_int(d, "top_k")
        if kwargs["top_k"] > num_experts:
            raise TraceError(f"top_k: {kwargs['top_k']} is more than num_experts {num_experts}")
    if d.get("model") is not None:
        model = d["model"]
        model = model.item() if isinstance(model, np.ndarray) and model.ndim == 0 else model
        if not isinstance(model, str):
            raise TraceError(f"model: expected a string, got {type(model).__name__}")
        kwargs["model"] = model
    telemetry = telemetry_from_dict(d)
    if telemetry is not None:
        kwargs["telemetry"] = telemetry
    trace = LoadTrace(load=load, bucket_steps=steps, **kwargs)
    refusals, warnings = physical_checks(trace)
    if refusals:
        raise TraceError(refusals[0])
    if warnings:
        trace.meta["warnings"] = warnings
    return trace


def telemetry_to_dict(tel: Telemetry, *, arrays: bool = False) -> dict[str, Any]:
    """The file-format keys of ``tel`` (arrays, or JSON-ready lists with null for NaN)."""
    d: dict[str, Any] = {}
    for key in ("step_seconds", "rank_load", "kv_cache_usage", "preemptions", "requests_waiting",
                "prefix_cache_queries", "prefix_cache_hit_rate"):
        value = getattr(tel, key)
        if value is None:
            continue
        if arrays:
            d[key] = value
        elif key in ("step_seconds", "kv_cache_usage", "requests_waiting", "prefix_cache_hit_rate"):
            d[key] = [None if math.isnan(v) else v for v in value.tolist()]
        else:
            d[key] = value.tolist()
    if tel.rearrangements is not None:
        d["rearrangements"] = [e.to_dict() for e in tel.rearrangements]
    if tel.config is not None:
        d["config"] = tel.config.to_dict()
    if tel.kv_cache_bytes_per_gpu is not None:
        d["kv_cache_bytes_per_gpu"] = float(tel.kv_cache_bytes_per_gpu)
    for key in ("kv_cache_blocks", "kv_block_size"):
        if getattr(tel, key) is not None:
            d[key] = int(getattr(tel, key))
    return d


def trace_to_dict(trace: LoadTrace, *, arrays: bool = False) -> dict[str, Any]:
    """The file-format dict of ``trace``: JSON-ready plain lists and numbers (whole-number loads
    as integers), or NumPy arrays with ``arrays=True`` (what :func:`save_trace` writes)."""
    load = trace.load
    d: dict[str, Any] = {
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "bucket_steps": trace.bucket_steps.astype(np.int64),
        "load": load,
    }
    if trace.bucket_seconds is not None:
        d["bucket_seconds"] = float(trace.bucket_seconds)
    if trace.top_k is not None:
        d["top_k"] = int(trace.top_k)
    if trace.model is not None:
        d["model"] = trace.model
    if trace.telemetry is not None:
        d.update(telemetry_to_dict(trace.telemetry, arrays=arrays))
    if arrays:
        return d
    whole = np.all(load == np.round(load)) and load.max() < 2**53
    d["load"] = load.astype(np.int64).tolist() if whole else load.tolist()
    d["bucket_steps"] = d["bucket_steps"].tolist()
    return d


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Real routing data (../shared/traces style JSON)
# --------------------------------------------------------------------------------------------------

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
