"""Measure the running pods' balancedness over a window: the judge of a tuner change.

From Prometheus, ``increase`` of ``moe_eplb_rank_tokens_total`` per pod, layer and rank over the
window; without Prometheus, by scraping each pod's exporter and differencing against the counters
seen at an earlier round (:class:`RankHistory`). Balancedness is :func:`moe_eplb.contracts.vllm_facts.balancedness`
(``sum mean_rank / sum max_rank`` over engines and layers). An engine is a pod, or a multi-node
replica group (a LeaderWorkerSet group): each of its pods counts the tokens its own ranks' routers
dispatched to every EP rank, so the group's rank load is the sum over its pods (series label
``replica_group`` from Prometheus; the pods' LWS group labels when scraping). Blocking (HTTP); call
with ``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from moe_eplb.api.autotune_status import Measurement
from moe_eplb.contracts import k8s_names, metric_names, vllm_facts
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import selector
from moe_eplb.metrics.scrape import Round, exposition_samples
from moe_eplb.metrics.series import parse_vector

T = TypeVar("T")

RankCounts = dict[str, np.ndarray]  # pod (or engine) -> [L, EP] rank tokens


def engine_of_pod(pod: Mapping) -> str:
    """The engine a pod belongs to: its LeaderWorkerSet group (``<lws>/group <i>``), else itself."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    group = labels.get(k8s_names.LWS_GROUP_INDEX_LABEL)
    if group is not None and labels.get(k8s_names.LWS_NAME_LABEL):
        return f"{labels[k8s_names.LWS_NAME_LABEL]}/group {group}"
    return (pod.get("metadata") or {}).get("name", "")


def by_engine(per_pod: RankCounts, engines: Mapping[str, str] | None) -> RankCounts:
    """Per-pod counts summed per engine (``engines``: pod -> engine; a pod not in it is its own)."""
    if not engines:
        return per_pod
    out: RankCounts = {}
    for pod, counts in per_pod.items():
        key = engines.get(pod, pod)
        if key in out and out[key].shape == counts.shape:
            out[key] = out[key] + counts
        else:
            out[key] = counts
    return out


def balancedness_of(per_engine: RankCounts) -> float | None:
    """``sum_{engine,l} mean_rank / sum_{engine,l} max_rank`` of per-engine ``[L, EP]`` token counts."""
    terms = [vllm_facts.balancedness_terms(a) for a in per_engine.values()]
    num, den = sum(t[0] for t in terms), sum(t[1] for t in terms)
    return num / den if den > 0 else None


def _measurement(per_engine: RankCounts, seconds: float, source: str, pods: int) -> Measurement | None:
    b = balancedness_of(per_engine)
    if b is None:
        return None
    tokens = sum(float(a.sum()) for a in per_engine.values())
    return Measurement(balancedness=round(b, 6), tokens_per_second=round(tokens / max(seconds, 1e-9), 3),
                       pods=pods, source=source)


def _cells_to_array(cells: Mapping[tuple[int, int], float]) -> np.ndarray:
    a = np.zeros((1 + max(k[0] for k in cells), 1 + max(k[1] for k in cells)))
    for (l, r), v in cells.items():
        a[l, r] = v
    return a


def measure_prometheus(client: PrometheusClient, namespace: str, name: str, start: float, end: float) -> Measurement | None:
    """Balancedness over wall-clock ``[start, end]`` from Prometheus (None when there is no load)."""
    rng = max(1, int(math.ceil(end - start)))
    q = (f"sum by (pod, {metric_names.GROUP_LABEL}, {metric_names.GROUP_SIZE_LABEL}, {metric_names.LABEL_LAYER}, "
         f"{metric_names.LABEL_RANK}) (increase({metric_names.RANK_TOKENS}{selector(namespace, name)}[{rng}s]))")
    per_engine: dict[str, dict[tuple[int, int], float]] = {}
    members: dict[str, set[str]] = {}
    sizes: dict[str, int] = {}
    for s in parse_vector(client.query(q, time=end), "rank tokens"):
        if s.vs.size:
            cell = (s.int_label(metric_names.LABEL_LAYER, "rank tokens"), s.int_label(metric_names.LABEL_RANK, "rank tokens"))
            group = s.label(metric_names.GROUP_LABEL)
            engine = f"group {group}" if group else s.label("pod", "") or ""
            members.setdefault(engine, set()).add(s.label("pod", "") or engine)
            sizes[engine] = int(s.label(metric_names.GROUP_SIZE_LABEL) or 1) if group else 1
            cells = per_engine.setdefault(engine, {})
            cells[cell] = cells.get(cell, 0.0) + float(s.vs[0])
    # a group with a pod not (yet) in the window would be judged on part of its ranks' routers: left out
    whole = {e: c for e, c in per_engine.items() if len(members[e]) >= sizes[e]}
    return _measurement({e: _cells_to_array(c) for e, c in whole.items()}, end - start, "prometheus",
                        sum(len(members[e]) for e in whole))


def rank_counts_from_exposition(text: str) -> np.ndarray | None:
    """``[L, EP]`` counters of ``moe_eplb_rank_tokens_total`` in one ``/metrics`` body (all models)."""
    cells: dict[tuple[int, int], float] = {}
    for _, labels, value in exposition_samples(text, (metric_names.RANK_TOKENS,)):
        key = (int(labels[metric_names.LABEL_LAYER]), int(labels[metric_names.LABEL_RANK]))
        cells[key] = cells.get(key, 0.0) + value
    return _cells_to_array(cells) if cells else None


def rank_counts_of_round(rnd: Round, pods: Iterable[Mapping]) -> RankCounts:
    """:func:`scrape_rank_counts` from a round the reader's scraper already fetched (the rank
    counters are among the samples it keeps): the ready pods of ``pods`` that answered."""
    ready = {(p.get("metadata") or {}).get("name") for p in pods if _ready(p)}
    out: RankCounts = {}
    for pod, sample in rnd.pods.items():
        cells: dict[tuple[int, int], float] = {}
        for name, labels, value in sample.telemetry:
            if name == metric_names.RANK_TOKENS:
                key = (int(labels[metric_names.LABEL_LAYER]), int(labels[metric_names.LABEL_RANK]))
                cells[key] = cells.get(key, 0.0) + value
        if pod in ready and cells:
            out[pod] = _cells_to_array(cells)
    return out


def _exporter_url(pod: Mapping) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == k8s_names.EXPORTER_PORT_NAME and ip:
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{p.get('containerPort')}{k8s_names.EXPORTER_PATH}"
    return None


def _ready(pod: Mapping) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def scrape_ready_pods(pods: Iterable[Mapping], timeout: float, read: Callable[[str], T | None]) -> dict[str, T]:
    """One round over the exporters of every ready pod: ``{pod name: read(its /metrics body)}``; a pod
    that does not answer, or whose body ``read`` makes None of, is left out of this round."""
    out: dict[str, T] = {}
    for pod in pods:
        url = _exporter_url(pod)
        if not url or not _ready(pod):
            continue
        try:
            req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                value = read(resp.read().decode("utf-8"))
        except Exception:  # noqa: BLE001 - a pod that cannot be scraped is left out of this round
            continue
        if value is not None:
            out[pod["metadata"]["name"]] = value
    return out


def scrape_rank_counts(pods: Iterable[Mapping], timeout: float) -> RankCounts:
    """One round: ``[L, EP]`` rank counters of every ready pod that answers (others left out)."""
    return scrape_ready_pods(pods, timeout, rank_counts_from_exposition)


@dataclass
class RankHistory:
    """Rounds of scraped rank counters of one MoEInference (direct mode, no Prometheus)."""

    keep: int = 500
    rounds: list[tuple[float, RankCounts]] = field(default_factory=list)

    def remember(self, t: float, counts: RankCounts) -> None:
        if counts:
            self.rounds.append((t, counts))
            if len(self.rounds) > 1 and self.rounds[-2][0] > t:  # a scrape that started earlier ended later
                self.rounds.sort(key=lambda r: r[0])
        del self.rounds[: max(0, len(self.rounds) - self.keep)]

    def measure(self, now_counts: RankCounts, start: float, end: float,
                engines: Mapping[str, str] | None = None) -> Measurement | None:
        """Balancedness of ``now_counts`` minus the earliest remembered round at or after ``start``
        with the same pods (None without such a round), the pods' differences summed per engine
        (``engines``: pod -> engine, see :func:`engine_of_pod`); remembers ``now_counts`` at ``end``."""
        earlier = list(self.rounds)
        self.remember(end, now_counts)
        base = next(((t, c) for t, c in earlier if t >= start - 1e-6 and set(c) == set(now_counts) and t < end), None)
        if base is None or not now_counts:
            return None
        deltas = {p: np.maximum(now_counts[p] - base[1][p], 0.0) for p in now_counts
                  if now_counts[p].shape == base[1][p].shape}
        return _measurement(by_engine(deltas, engines), end - base[0], "pods", len(deltas))


__all__ = ["balancedness_of", "by_engine", "engine_of_pod", "measure_prometheus", "rank_counts_from_exposition",
           "rank_counts_of_round", "scrape_rank_counts", "RankHistory"]
