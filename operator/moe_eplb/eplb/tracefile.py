"""Reading and writing load traces: the trace file format, Prometheus range-query results, and the
real routing data files (``expert_counts_by_domain`` and ``token_routing_sequence`` JSON).

Everything here except :func:`load_trace` / :func:`save_trace` / :func:`read_routing_file` is a
pure function (dict in, object out). Every problem raises :class:`~moe_eplb.eplb.trace.TraceError`
whose message starts with the key (or file) at fault and says how to fix it.

Trace file format (JSON, gzip JSON ``.json.gz``, or NumPy ``.npz`` with the same keys):

=================  ========================  =============================================
key                type                      meaning
=================  ========================  =============================================
``num_layers``     int > 0                   MoE layers L
``num_experts``    int > 0                   logical experts per layer E
``bucket_steps``   list[int], length T       engine steps in each bucket (>= 0)
``load``           T x L x E numbers >= 0    tokens routed to each logical expert
                                             (one count per (token, top-k slot))
``bucket_seconds`` float > 0, optional       wall-clock length of one bucket
``top_k``          int > 0, optional         experts per token
``model``          str, optional             model name the load came from
=================  ========================  =============================================
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from moe_eplb.eplb.trace import TRACE_KEYS_OPTIONAL, TRACE_KEYS_REQUIRED, LoadTrace, TraceError
from moe_eplb.exporter import names

TRACE_SUFFIXES = (".json", ".json.gz", ".npz")


# --------------------------------------------------------------------------------------------------
# dict <-> LoadTrace
# --------------------------------------------------------------------------------------------------


def _positive_int(d: Mapping[str, Any], key: str) -> int:
    value = d[key]
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            raise TraceError(f"{key}: expected one integer, got an array of shape {value.shape}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != int(value) or value <= 0:
        raise TraceError(f"{key}: expected an integer > 0, got {value!r}")
    return int(value)


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


def trace_from_dict(d: Mapping[str, Any]) -> LoadTrace:
    """Build a :class:`LoadTrace` from the file-format dict (keys in the module docstring).

    Strict: unknown or missing keys, ``num_layers`` / ``num_experts`` that disagree with ``load``'s
    shape, a ``bucket_steps`` whose length is not T, empty, negative, NaN or infinite values all
    raise :class:`TraceError` naming the key.
    """
    if not isinstance(d, Mapping):
        raise TraceError(f"trace: expected a JSON object with keys {list(TRACE_KEYS_REQUIRED)}, got {type(d).__name__}")
    allowed = set(TRACE_KEYS_REQUIRED) | set(TRACE_KEYS_OPTIONAL)
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise TraceError(
            f"{unknown[0]}: unknown key (allowed keys: {', '.join(TRACE_KEYS_REQUIRED + TRACE_KEYS_OPTIONAL)})"
        )
    missing = [k for k in TRACE_KEYS_REQUIRED if k not in d]
    if missing:
        raise TraceError(f"{missing[0]}: required key is missing")
    num_layers = _positive_int(d, "num_layers")
    num_experts = _positive_int(d, "num_experts")
    load = _numeric_array(d["load"], "load")
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
    kwargs: dict[str, Any] = {}
    if d.get("bucket_seconds") is not None:
        bs = d["bucket_seconds"]
        bs = bs.item() if isinstance(bs, np.ndarray) and bs.ndim == 0 else bs
        if isinstance(bs, bool) or not isinstance(bs, numbers.Real) or not math.isfinite(bs) or bs <= 0:
            raise TraceError(f"bucket_seconds: expected a number > 0, got {bs!r}")
        kwargs["bucket_seconds"] = float(bs)
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
    return LoadTrace(load=load, bucket_steps=steps, **kwargs)


def trace_to_dict(trace: LoadTrace) -> dict[str, Any]:
    """The file-format dict of ``trace`` (plain Python lists and numbers, JSON-ready).

    Loads that are whole numbers are written as integers.
    """
    load = trace.load
    if np.all(load == np.round(load)) and load.max() < 2**53:
        load_list = load.astype(np.int64).tolist()
    else:
        load_list = load.tolist()
    d: dict[str, Any] = {
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "bucket_steps": trace.bucket_steps.astype(np.int64).tolist(),
        "load": load_list,
    }
    if trace.bucket_seconds is not None:
        d["bucket_seconds"] = float(trace.bucket_seconds)
    if trace.top_k is not None:
        d["top_k"] = int(trace.top_k)
    if trace.model is not None:
        d["model"] = trace.model
    return d


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def trace_suffix(path: str | os.PathLike) -> str:
    """The trace format ``path`` names (one of :data:`TRACE_SUFFIXES`); anything else raises."""
    path = Path(path)
    name = path.name.lower()
    for suffix in TRACE_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise TraceError(f"{path}: unknown trace file type; use one of {', '.join(TRACE_SUFFIXES)}")


def load_trace(path: str | os.PathLike) -> LoadTrace:
    """Read a trace file (``.json``, ``.json.gz`` or ``.npz``, chosen by suffix)."""
    path = Path(path)
    suffix = trace_suffix(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                d = {k: npz[k] for k in npz.files}
            return trace_from_dict(d)
        opener = gzip.open if suffix == ".json.gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            d = json.load(fh)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    except (json.JSONDecodeError, OSError, ValueError, EOFError) as exc:
        raise TraceError(f"{path}: cannot read as {suffix} ({exc})") from None
    if isinstance(d, dict) and d.get("kind") in ROUTING_KINDS:
        raise TraceError(
            f"{path}: is a routing data file (kind {d['kind']!r}), not a load trace; "
            "use read_routing_file() or `moe-eplb trace synth --from`"
        )
    try:
        return trace_from_dict(d)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def save_trace(trace: LoadTrace, path: str | os.PathLike) -> Path:
    """Write ``trace`` to ``path`` in the format its suffix names; returns the path.

    The file is written to a temporary name and renamed, so a failed write leaves nothing behind.
    """
    path = Path(path)
    suffix = trace_suffix(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if suffix == ".npz":
            load = trace.load
            if np.all(load == np.round(load)) and load.max() < 2**32:
                load = load.astype(np.uint32)  # whole counts: smaller and much faster to compress
            arrays: dict[str, Any] = {
                "num_layers": np.int64(trace.num_layers),
                "num_experts": np.int64(trace.num_experts),
                "bucket_steps": trace.bucket_steps.astype(np.int64),
                "load": load,
            }
            if trace.bucket_seconds is not None:
                arrays["bucket_seconds"] = np.float64(trace.bucket_seconds)
            if trace.top_k is not None:
                arrays["top_k"] = np.int64(trace.top_k)
            if trace.model is not None:
                arrays["model"] = np.str_(trace.model)
            # np.savez_compressed's layout (one .npy per key in a zip), with fast deflate level 1
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
                for key, value in arrays.items():
                    with zf.open(f"{key}.npy", "w", force_zip64=True) as fh:
                        np.lib.format.write_array(fh, np.asanyarray(value), allow_pickle=False)
        else:
            text = json.dumps(trace_to_dict(trace), separators=(",", ":"))
            if suffix == ".json.gz":
                with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as fh:
                    fh.write(text)
            else:
                tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# --------------------------------------------------------------------------------------------------
# Prometheus range queries
# --------------------------------------------------------------------------------------------------


def _matrix(body: Mapping[str, Any], what: str) -> list:
    """The ``result`` list of a range-query body (the full body or its ``data`` member)."""
    if not isinstance(body, Mapping):
        raise TraceError(f"{what}: expected the JSON body of /api/v1/query_range, got {type(body).__name__}")
    if "status" in body and body["status"] != "success":
        raise TraceError(f"{what}: query failed ({body.get('errorType', '?')}: {body.get('error', '?')})")
    data = body.get("data", body)
    if not isinstance(data, Mapping) or "result" not in data:
        raise TraceError(f"{what}: no data.result in the query_range body")
    if data.get("resultType", "matrix") != "matrix":
        raise TraceError(f"{what}: resultType is {data.get('resultType')!r}; use a range query (matrix)")
    result = data["result"]
    if not isinstance(result, list):
        raise TraceError(f"{what}: data.result is not a list")
    return result


def series_points(series: Mapping[str, Any], what: str) -> tuple[np.ndarray, np.ndarray]:
    """Times and values ``[n]`` of one Prometheus matrix series (``{"metric": ..., "values": [[t, "v"], ...]}``);
    :class:`TraceError` (message starting with ``what``) for malformed points, NaN, infinite or negative values."""
    values = series.get("values")
    if not isinstance(values, list):
        raise TraceError(f"{what}: series {series.get('metric')} has no 'values' list")
    try:
        # [[t, "v"], ...] -> [n, 2] in one call (numpy parses the value strings)
        arr = np.array(values, dtype=np.float64)
        if arr.size == 0:
            arr = arr.reshape(0, 2)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise ValueError(f"points must be [time, value] pairs, got shape {arr.shape}")
    except (TypeError, ValueError, IndexError) as exc:
        raise TraceError(f"{what}: series {series.get('metric')} has a malformed point ({exc})") from None
    ts, vs = arr[:, 0], arr[:, 1]
    if not (np.isfinite(vs).all() and (vs >= 0).all()):
        if not np.all(np.isfinite(vs)):
            raise TraceError(f"{what}: series {series.get('metric')} has NaN or infinite values")
        raise TraceError(f"{what}: series {series.get('metric')} has negative values (counters and their increase() never are; use increase(), not deriv())")
    return ts, vs


def _int_label(metric: Mapping[str, Any], label: str, what: str) -> int:
    raw = metric.get(label)
    try:
        value = int(str(raw))
    except ValueError:
        raise TraceError(f"{what}: label {label}={raw!r} is not an integer in series {dict(metric)}") from None
    if value < 0:
        raise TraceError(f"{what}: label {label}={raw!r} is negative in series {dict(metric)}")
    return value


def trace_from_prometheus(
    expert_tokens: Mapping[str, Any],
    engine_steps: Mapping[str, Any],
    *,
    num_layers: int | None = None,
    num_experts: int | None = None,
    bucket_seconds: float | None = None,
    top_k: int | None = None,
    model: str | None = None,
) -> LoadTrace:
    """Turn two Prometheus range-query results into a trace (pure; no HTTP).

    Args:
        expert_tokens: JSON body (or its ``data``) of ``/api/v1/query_range`` for e.g.
            ``sum by (layer, expert) (increase(moe_eplb_expert_tokens_total{...}[15s]))`` with
            ``step=15s``: one series per (layer, expert) with labels
            :data:`~moe_eplb.exporter.names.LABEL_LAYER` and ``LABEL_EXPERT``
            (:data:`moe_eplb.exporter.names.EXPERT_TOKENS`). Several series with the same
            (layer, expert) (e.g. one per pod) are added up.
        engine_steps: the same for ``increase(moe_eplb_engine_steps_total[15s])``
            (:data:`~moe_eplb.exporter.names.ENGINE_STEPS`). Engines of one deployment step in
            lockstep, so several series (one per pod) are combined by taking the largest value
            at each time.
        num_layers, num_experts: the model's shape; by default the largest label + 1. Given, a
            label outside the shape is an error.
        bucket_seconds: length of a bucket; by default the spacing of the timestamps.

    Returns:
        A trace whose buckets are the timestamps of ``engine_steps``; ``load[t, l, e]`` is the
        increase of expert (l, e)'s counter in bucket t, ``bucket_steps[t]`` the rounded increase
        of the step counter.

    Zero fill and errors: an expert of a present layer with no series, or a series without a point
    at some bucket, counts 0 there (the exporter's counters appear only once an expert has received
    tokens, and Prometheus returns no point for a counter that did not exist yet). A layer with no
    series at all, a bucket where some layers have load but another has none, a load point at a
    time with no engine-steps point, series from more than one ``model``, or timestamps that are not
    evenly spaced raise :class:`TraceError`, because the matrix would otherwise be silently wrong.
    """
    what_e, what_s = f"{names.EXPERT_TOKENS} result", f"{names.ENGINE_STEPS} result"
    expert_series = _matrix(expert_tokens, what_e)
    step_series = _matrix(engine_steps, what_s)
    if not step_series:
        raise TraceError(f"{what_s}: no series; is the exporter scraped (metric {names.ENGINE_STEPS})?")
    if not expert_series:
        raise TraceError(f"{what_e}: no series; is the exporter scraped (metric {names.EXPERT_TOKENS})?")

    models = {s.get("metric", {}).get(names.LABEL_MODEL) for s in list(expert_series) + list(step_series)} - {None}
    if len(models) > 1:
        raise TraceError(
            f"model: the results mix {len(models)} models ({', '.join(sorted(models))}); "
            "filter the queries with {model=\"...\"}"
        )
    if model is None and models:
        model = models.pop()

    # Time grid from the engine-steps series.
    step_points = [series_points(s, what_s) for s in step_series]
    grid = np.unique(np.concatenate([ts for ts, _ in step_points]))
    if grid.size == 0:
        raise TraceError(f"{what_s}: the series have no points; widen the query range")
    steps = np.zeros(grid.size, dtype=np.float64)
    for ts, vs in step_points:
        idx = np.searchsorted(grid, ts)
        np.maximum.at(steps, idx, vs)
    if grid.size > 1:
        gaps = np.diff(grid)
        if not np.allclose(gaps, gaps[0], rtol=1e-6, atol=1e-3):
            raise TraceError(
                f"{what_s}: timestamps are not evenly spaced (gaps {sorted(set(np.round(gaps, 3).tolist()))[:5]} s); "
                "query with a fixed step"
            )
        spacing = float(gaps[0])
        if bucket_seconds is None:
            bucket_seconds = spacing
    elif bucket_seconds is None:
        raise TraceError("bucket_seconds: only one bucket in the result; pass the query step as bucket_seconds")

    # Load matrix.
    keyed: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    for s in expert_series:
        metric = s.get("metric", {})
        layer = _int_label(metric, names.LABEL_LAYER, what_e)
        expert = _int_label(metric, names.LABEL_EXPERT, what_e)
        ts, vs = series_points(s, what_e)
        keyed.append((layer, expert, ts, vs))
    max_layer = max(k[0] for k in keyed)
    max_expert = max(k[1] for k in keyed)
    if num_layers is None:
        num_layers = max_layer + 1
    elif max_layer >= num_layers:
        raise TraceError(f"num_layers: is {num_layers} but the result has a series for layer {max_layer}")
    if num_experts is None:
        num_experts = max_expert + 1
    elif max_expert >= num_experts:
        raise TraceError(f"num_experts: is {num_experts} but the result has a series for expert {max_expert}")

    load = np.zeros((grid.size, num_layers, num_experts), dtype=np.float64)
    has_point = np.zeros((grid.size, num_layers), dtype=bool)
    for layer, expert, ts, vs in keyed:
        idx = np.searchsorted(grid, ts)
        # a point matches the grid within 1 ms (idx == grid.size: after the last step point)
        ok = (idx < grid.size) & (np.abs(grid[np.minimum(idx, grid.size - 1)] - ts) <= 1e-3)
        if not ok.all():
            bad = ts[~ok][0]
            raise TraceError(
                f"{what_s}: no engine-steps point at time {bad} where layer {layer} expert {expert} has load; "
                "query both with the same start, end and step"
            )
        np.add.at(load[:, layer, expert], idx, vs)
        has_point[idx, layer] = True

    seen_layers = np.any(has_point, axis=0)
    if not np.all(seen_layers):
        missing = np.flatnonzero(~seen_layers).tolist()
        raise TraceError(
            f"layer: no series at all for layer(s) {missing[:10]} of {num_layers}; the exporter is not "
            "reporting them (or num_layers is wrong), so their load cannot be filled with zeros"
        )
    partial = np.any(has_point, axis=1) & ~np.all(has_point, axis=1)
    if np.any(partial):
        t = int(np.flatnonzero(partial)[0])
        missing = np.flatnonzero(~has_point[t]).tolist()
        raise TraceError(
            f"layer: at time {grid[t]} layer(s) {missing[:10]} have no points while other layers do; "
            "the scrape is incomplete there -- shorten the range or fix the exporter"
        )
    return LoadTrace(
        load=load,
        bucket_steps=np.round(steps).astype(np.int64),
        bucket_seconds=bucket_seconds,
        top_k=top_k,
        model=model,
        meta={"start_time": float(grid[0])},
    )


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


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise TraceError(f"{where}: key {key!r} is missing")
    return d[key]


def domain_counts_from_dict(d: Mapping[str, Any], where: str = "expert counts") -> DomainCounts:
    """Parse an ``expert_counts_by_domain`` dict (``counts[domain][i][e]`` over ``layers[i]``)."""
    num_experts = int(_require(d, "num_experts", where))
    top_k = int(_require(d, "top_k", where))
    layers = _require(d, "layers", where)
    if not isinstance(layers, list) or not layers or not all(isinstance(x, int) and x >= 0 for x in layers):
        raise TraceError(f"{where}: layers must be a non-empty list of layer indices")
    raw = _require(d, "counts", where)
    if not isinstance(raw, Mapping) or not raw:
        raise TraceError(f"{where}: counts must be an object {{domain: [[count per expert] per layer]}}")
    counts: dict[str, np.ndarray] = {}
    for domain, rows in raw.items():
        arr = _numeric_array(rows, f"counts.{domain}").astype(np.float64)
        if arr.shape != (len(layers), num_experts):
            raise TraceError(f"counts.{domain}: shape {arr.shape}, expected ({len(layers)}, {num_experts})")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise TraceError(f"counts.{domain}: counts must be finite and >= 0")
        if np.any(arr.sum(axis=1) <= 0):
            raise TraceError(f"counts.{domain}: a layer has no tokens at all")
        counts[str(domain)] = arr
    num_layers = int(d.get("num_layers") or max(layers) + 1)
    return DomainCounts(
        counts=counts,
        layers=tuple(int(x) for x in layers),
        num_experts=num_experts,
        top_k=top_k,
        model=str(d.get("model", "unknown")),
        num_layers=num_layers,
    )


def token_routing_from_dict(d: Mapping[str, Any], where: str = "token routing") -> TokenRouting:
    """Parse a ``token_routing_sequence`` dict (``experts[t][layer] = [top-k expert ids]``)."""
    num_experts = int(_require(d, "num_experts", where))
    top_k = int(_require(d, "top_k", where))
    experts = _require(d, "experts", where)
    if not isinstance(experts, list) or not experts:
        raise TraceError(f"{where}: experts must be a non-empty list of tokens")
    num_layers = int(d.get("num_layers") or len(experts[0]))
    choices = np.full((len(experts), num_layers, top_k), -1, dtype=np.int64)
    for t, token in enumerate(experts):
        if not isinstance(token, list) or len(token) != num_layers:
            raise TraceError(f"{where}: experts[{t}] has {len(token) if isinstance(token, list) else '?'} layers, expected {num_layers}")
        for layer, chosen in enumerate(token):
            if not chosen:
                continue  # not recorded for this token and layer
            if len(chosen) != top_k or not all(isinstance(e, int) and 0 <= e < num_experts for e in chosen):
                raise TraceError(f"{where}: experts[{t}][{layer}] = {chosen!r} is not {top_k} expert ids < {num_experts}")
            choices[t, layer] = chosen
    seq = d.get("problem_id", [0] * len(experts))
    if len(seq) != len(experts):
        raise TraceError(f"{where}: problem_id has {len(seq)} entries for {len(experts)} tokens")
    return TokenRouting(
        choices=choices,
        sequence_id=np.asarray(seq, dtype=np.int64),
        num_experts=num_experts,
        top_k=top_k,
        model=str(d.get("model", "unknown")),
    )


def read_routing_file(path: str | os.PathLike) -> DomainCounts | TokenRouting:
    """Read a real routing data file (``kind`` ``expert_counts_by_domain`` or
    ``token_routing_sequence``)."""
    path = Path(path)
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: cannot read as JSON ({exc})") from None
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == KIND_EXPERT_COUNTS:
        return domain_counts_from_dict(d, str(path))
    if kind == KIND_TOKEN_ROUTING:
        return token_routing_from_dict(d, str(path))
    raise TraceError(f"{path}: kind is {kind!r}; expected one of {', '.join(ROUTING_KINDS)}")
