"""Prometheus answers parsed once into typed series (pure, no I/O).

Every Prometheus body the load reader receives goes through :func:`parse_matrix` (range vectors:
raw samples) or :func:`parse_vector` (instant vectors) exactly once; everything downstream works on
:class:`Series`. Problems raise :class:`~moe_eplb.metrics.errors.LoadReadError` with reason
``InconsistentSeries`` naming the query (``what``) and the series.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_eplb.metrics.errors import INCONSISTENT_SERIES, LoadReadError

#: Labels that tell series of one counter family apart within a pod (not part of a pod's identity).
SERIES_LABELS = ("__name__", "layer", "expert", "rank", "le")


@dataclass(frozen=True)
class Series:
    """One series: its labels and its samples sorted by time (``ts``, ``vs``: float64 ``[n]``)."""

    labels: Mapping[str, str]
    ts: np.ndarray
    vs: np.ndarray

    def label(self, name: str, default: str | None = None) -> str | None:
        return self.labels.get(name, default)

    def int_label(self, name: str, what: str) -> int:
        """A label that must be a whole number >= 0 (``layer``, ``expert``, ``rank``)."""
        raw = self.labels.get(name)
        try:
            value = int(str(raw))
        except ValueError:
            raise LoadReadError(INCONSISTENT_SERIES,
                                f"{what}: label {name}={raw!r} is not an integer in series {dict(self.labels)}") from None
        if value < 0:
            raise LoadReadError(INCONSISTENT_SERIES, f"{what}: label {name}={raw!r} is negative in series "
                                f"{dict(self.labels)}")
        return value

    @property
    def pod(self) -> tuple:
        """The series' identity without its per-series labels: one pod (or one scrape target).
        Computed once per series (a DeepSeek-V3 read over 4 pods asks for ~60 000 of them)."""
        cache = self.__dict__
        key = cache.get("_pod")
        if key is None:
            key = cache["_pod"] = pod_key(self.labels)
        return key


_SERIES_LABEL_SET = frozenset(SERIES_LABELS)


def pod_key(labels: Mapping[str, str]) -> tuple:
    """Sorted ``(label, value)`` pairs of ``labels`` without :data:`SERIES_LABELS`.

    The thousands of series of one pod share these pairs (usually in the same order, as Prometheus
    sorts labels), so the sorted key is computed once per distinct ordering (:func:`_sorted_pairs`)."""
    return _sorted_pairs(tuple([kv for kv in labels.items() if kv[0] not in _SERIES_LABEL_SET]))


@functools.lru_cache(maxsize=4096)
def _sorted_pairs(pairs: tuple) -> tuple:
    return tuple(sorted(pairs))


def pod_name(pod: tuple) -> str:
    """A pod key as a person reads it: the ``pod`` label, else every label."""
    labels = dict(pod)
    return labels.get("pod") or ", ".join(f"{k}={v}" for k, v in pod)


def _data(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: expected a Prometheus JSON answer, got {type(body).__name__}")
    data = body.get("data")
    if not isinstance(data, Mapping) or not isinstance(data.get("result"), list):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: the answer has no data.result list")
    return data


def _points(values: Any, labels: Mapping[str, str], what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        # [[t, "v"], ...] -> [n, 2] in one call (numpy parses the value strings)
        arr = np.array(values, dtype=np.float64) if values else np.zeros((0, 2))
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise ValueError(f"points must be [time, value] pairs, got shape {arr.shape}")
    except (TypeError, ValueError, IndexError) as exc:
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: series {dict(labels)} has a malformed point ({exc})") from None
    ts, vs = arr[:, 0], arr[:, 1]
    if not np.all(np.isfinite(vs)):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: series {dict(labels)} has NaN or infinite values")
    if np.any(vs < 0):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: series {dict(labels)} has negative values "
                            "(counters and the gauges read here never are)")
    order = np.argsort(ts, kind="stable")
    return ts[order], vs[order]


_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def parse_matrix(body: Any, what: str) -> list[Series]:
    """The series of a matrix answer (``{"data": {"resultType": "matrix", "result": [...]}}``).

    All points of the answer are converted in one pass (a DeepSeek-V3 replica group over four
    pods answers ~60 000 series); a series whose points are malformed is then parsed alone, so the
    error names it."""
    data = _data(body, what)
    if data.get("resultType", "matrix") != "matrix":
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: expected a matrix (raw samples), got "
                            f"{data.get('resultType')!r}")
    items = data["result"]
    try:
        labels = [item.get("metric") or {} for item in items]
        values = [item["values"] or [] for item in items]
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        points = list(itertools.chain.from_iterable(values))
        if set(map(len, points)) - {2}:
            raise ValueError("points must be [time, value] pairs")
        ts_all = np.fromiter(map(_first, points), np.float64, len(points))  # numbers in Prometheus' JSON
        vs_all = np.fromiter(map(float, map(_second, points)), np.float64, len(points))  # "NaN", "+Inf" too
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        out = []
        for item in items:
            lab = dict(item.get("metric") or {}) if isinstance(item, Mapping) else {}
            out.append(Series(lab, *_points(item.get("values") if isinstance(item, Mapping) else item, lab, what)))
        return out
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # per series: any NaN/infinite/negative value, any time going back (both checked in one pass)
    suspect = np.zeros(len(items), bool)
    bad = np.flatnonzero(~np.isfinite(vs_all) | (vs_all < 0))
    if bad.size:
        suspect[np.searchsorted(ends, bad, side="right")] = True
    if ts_all.size > 1:
        back = np.flatnonzero(np.diff(ts_all) < 0) + 1  # positions where time goes back
        if back.size:
            owner = np.searchsorted(ends, back, side="right")
            suspect[owner[back != starts[owner]]] = True  # not at a series' first point
    out = []
    for i, (lab, a, b, odd) in enumerate(zip(labels, starts.tolist(), ends.tolist(), suspect.tolist())):
        if odd:
            out.append(Series(dict(lab), *_points(values[i], lab, what)))  # sorts, or names the bad point
        else:
            out.append(Series(lab, ts_all[a:b], vs_all[a:b]))
    return out


def parse_vector(body: Any, what: str) -> list[Series]:
    """The samples of an instant-vector answer, one single-point :class:`Series` each (converted in
    one pass; a malformed sample is then parsed alone, so the error names its series)."""
    data = _data(body, what)
    if data["result"] and data.get("resultType") != "vector":
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: expected an instant vector, got {data.get('resultType')!r}")
    items = data["result"]
    try:
        values = [item.get("value") for item in items]
        if any(v is None or len(v) != 2 for v in values):
            raise ValueError("a sample is not a [time, value] pair")
        ts_all = np.fromiter(map(float, map(_first, values)), np.float64, len(values))
        vs_all = np.fromiter(map(float, map(_second, values)), np.float64, len(values))
        if not (np.all(np.isfinite(vs_all)) and np.all(vs_all >= 0)):
            raise ValueError("NaN, infinite or negative values")
    except (TypeError, ValueError, AttributeError):
        out = []
        for item in items:
            labels = dict(item.get("metric") or {})
            value = item.get("value")
            ts, vs = _points([value] if value is not None else [], labels, what)
            out.append(Series(labels, ts, vs))
        return out
    return [Series(dict(item.get("metric") or {}), ts_all[i:i + 1], vs_all[i:i + 1]) for i, item in enumerate(items)]


def merge(parts: Iterable[Series]) -> list[Series]:
    """Series with the same labels joined into one (samples de-duplicated by time, sorted).

    A series seen once is kept as it is, and parts that follow each other in time (a baseline
    before the window, chunks of a long window) are joined without sorting."""
    by_labels: dict[tuple, list[Series]] = {}
    keys: dict[tuple, tuple] = {}  # labels as given -> sorted (answers list them alike: sorted once)
    for s in parts:
        given = tuple(s.labels.items())
        key = keys.get(given)
        if key is None:
            key = keys[given] = tuple(sorted(given))
        by_labels.setdefault(key, []).append(s)
    out = []
    for group in by_labels.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        group.sort(key=lambda s: s.ts[0] if s.ts.size else -np.inf)
        ts = np.concatenate([s.ts for s in group])
        vs = np.concatenate([s.vs for s in group])
        if ts.size > 1 and not np.all(np.diff(ts) > 0):
            ts, idx = np.unique(ts, return_index=True)
            vs = vs[idx]
        out.append(Series(group[0].labels, ts, vs))
    return out
