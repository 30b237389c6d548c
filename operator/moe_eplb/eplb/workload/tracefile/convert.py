"""A trace file's mapping <-> ``LoadTrace``, validated strictly into a ``TraceError`` naming the key."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from moe_eplb.api.knobs import Knobs, KnobsError
from moe_eplb.contracts import bounded_read, trace_format
from moe_eplb.eplb.workload.trace import (
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
