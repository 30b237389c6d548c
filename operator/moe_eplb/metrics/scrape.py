"""Scrape the exporter of each pod directly (when no Prometheus URL is configured).

:func:`targets_from_pods` (pure) picks the pods of one MoEInference and their ``eplb-metrics``
port from pod objects the caller listed (label ``eplb.ai/name=<name>``); :func:`parse_exposition`
(pure) reads one ``/metrics`` body; :class:`PodScraper` fetches all targets (threads, timeout) and
keeps the last rounds so that successive scrapes can be differenced into buckets
(:func:`moe_eplb.metrics.reader.trace_from_rounds`).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from moe_eplb import k8s_names, metric_names, vllm_facts
from moe_eplb.metrics.errors import NO_TARGETS, SCRAPE_FAILED, LoadReadError


@dataclass(frozen=True)
class Target:
    pod: str  # pod name (identity across scrapes; a restarted pod keeps it, its start time changes)
    url: str  # http://<podIP>:<port>/metrics


def targets_from_pods(pods: Iterable[dict], name: str | None = None) -> list[Target]:
    """Running pods (dicts as the Kubernetes API returns them) -> scrape targets.

    Keeps pods labelled ``eplb.ai/name=<name>`` (when ``name`` is given) that are Running, have a
    ``status.podIP`` and a container port named ``eplb-metrics``.
    """
    out = []
    for pod in pods:
        meta = pod.get("metadata", {}) or {}
        if name is not None and (meta.get("labels") or {}).get(k8s_names.NAME_LABEL) != name:
            continue
        status = pod.get("status", {}) or {}
        if status.get("phase") != "Running" or not status.get("podIP") or meta.get("deletionTimestamp"):
            continue
        port = None
        for c in (pod.get("spec", {}) or {}).get("containers", []) or []:
            for p in c.get("ports", []) or []:
                if p.get("name") == k8s_names.EXPORTER_PORT_NAME:
                    port = p.get("containerPort")
        if port is None:
            continue
        ip = status["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        out.append(Target(pod=meta.get("name", ip), url=f"http://{host}:{port}{k8s_names.EXPORTER_PATH}"))
    return out


@dataclass
class PodSample:
    """One pod's counters at one scrape, per model."""

    start_time: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    #: (sample name, labels, value) of the telemetry sources the target serves
    #: (:data:`TELEMETRY_SAMPLES`; vLLM's own series only where the target serves them too)
    telemetry: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


#: Sample names kept for the calibration's telemetry (moe_eplb.metrics.telemetry.SAMPLE_NAMES).
TELEMETRY_SAMPLES = frozenset({
    metric_names.STEP_SECONDS + "_sum", metric_names.STEP_SECONDS + "_count", metric_names.RANK_TOKENS,
    metric_names.REARRANGEMENT_SECONDS + "_sum", metric_names.REARRANGEMENT_SECONDS + "_count",
    metric_names.CONFIG_INFO, metric_names.KV_CACHE_BYTES, vllm_facts.KV_CACHE_USAGE, vllm_facts.PREEMPTIONS,
    vllm_facts.REQUESTS_WAITING, vllm_facts.PREFIX_CACHE_QUERIES, vllm_facts.PREFIX_CACHE_HITS,
    vllm_facts.PREFIX_CACHE_QUERIES_OLD, vllm_facts.PREFIX_CACHE_HITS_OLD, vllm_facts.CACHE_CONFIG_INFO,
})


def parse_exposition(text: str) -> PodSample:
    """The exporter's counters from one ``/metrics`` body (classic text format)."""
    sample = PodSample()
    expert_family = metric_names.EXPERT_TOKENS.removesuffix("_total")
    steps_family = metric_names.ENGINE_STEPS.removesuffix("_total")
    for fam in text_string_to_metric_families(text):
        if fam.name == expert_family:
            for s in fam.samples:
                if s.name != metric_names.EXPERT_TOKENS:
                    continue
                lab = s.labels
                key = (int(lab[metric_names.LABEL_LAYER]), int(lab[metric_names.LABEL_EXPERT]))
                sample.tokens.setdefault(lab[metric_names.LABEL_MODEL], {})[key] = float(s.value)
        elif fam.name == steps_family:
            for s in fam.samples:
                if s.name == metric_names.ENGINE_STEPS:
                    sample.steps[s.labels[metric_names.LABEL_MODEL]] = float(s.value)
        elif fam.name == metric_names.EXPORTER_START_TIME:
            for s in fam.samples:
                sample.start_time[s.labels[metric_names.LABEL_MODEL]] = float(s.value)
        else:
            sample.telemetry += [(s.name, dict(s.labels), float(s.value)) for s in fam.samples
                                 if s.name in TELEMETRY_SAMPLES]
    return sample


@dataclass
class Round:
    time: float  # unix seconds
    pods: dict[str, PodSample]


class PodScraper:
    """Scrapes targets and keeps up to ``keep`` rounds (one instance per MoEInference)."""

    def __init__(self, timeout: float = 5.0, keep: int = 1000, clock=time.time):
        self.timeout = timeout
        self.keep = keep
        self.clock = clock
        self.rounds: list[Round] = []

    def fetch(self, target: Target) -> str:
        req = urllib.request.Request(target.url, headers={"Accept": "text/plain;version=0.0.4"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return resp.read().decode("utf-8")

    def scrape(self, targets: list[Target]) -> Round:
        """Scrape every target; all or nothing (a failed pod fails the round, which is not kept)."""
        if not targets:
            raise LoadReadError(NO_TARGETS, "no running pod with a container port named "
                                f"{k8s_names.EXPORTER_PORT_NAME!r}; is the exporter enabled in the engine image?")
        now = self.clock()

        def one(t: Target):
            try:
                return t, parse_exposition(self.fetch(t)), None
            except Exception as exc:  # noqa: BLE001
                return t, None, exc

        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            results = list(pool.map(one, targets))
        failed = [(t, e) for t, _, e in results if e is not None]
        if failed:
            t, e = failed[0]
            raise LoadReadError(SCRAPE_FAILED, f"{len(failed)} of {len(targets)} pod(s) could not be scraped, "
                                f"e.g. {t.pod} at {t.url}: {type(e).__name__}: {e}")
        rnd = Round(time=now, pods={t.pod: s for t, s, _ in results})
        self.rounds.append(rnd)
        del self.rounds[: max(0, len(self.rounds) - self.keep)]
        return rnd

