"""Scrape the exporter of each pod directly (when no Prometheus URL is configured).

:func:`targets_from_pods` (pure) picks the pods of one MoEInference and their ``eplb-metrics``
port from pod objects the caller listed (label ``eplb.ai/name=<name>``); :func:`parse_exposition`
(pure, :func:`exposition_samples`: only the lines it needs) reads one ``/metrics`` body;
:class:`PodScraper` fetches all targets (threads, timeout) and keeps the rounds that the reader
reads as the raw samples Prometheus would hold (:func:`moe_eplb.metrics.assemble.counters_from_rounds`,
with the labels a PodMonitor copies from the pod: :func:`pod_labels`).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from moe_eplb.contracts import k8s_names, metric_names, vllm_facts
from moe_eplb.metrics.errors import NO_TARGETS, SCRAPE_FAILED, LoadReadError


@dataclass(frozen=True)
class Target:
    pod: str  # pod name (identity across scrapes; a restarted pod keeps it, its start time changes)
    url: str  # http://<podIP>:<port>/metrics
    #: the labels a PodMonitor would add from the pod (:func:`pod_labels`), as sorted pairs
    labels: tuple[tuple[str, str], ...] = ()


def pod_labels(pod: dict) -> tuple[tuple[str, str], ...]:
    """The labels the operator's PodMonitor copies from a pod onto its series (render/objects.py):
    ``moeinference``, and for a pod of a LeaderWorkerSet group ``replica_group``, ``group_worker``
    and ``group_size`` -- so that the load reader joins the pods of a group (and refuses an
    incomplete one) the same way whether Prometheus or the operator scraped them."""
    meta = pod.get("metadata", {}) or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    out = {}
    if k8s_names.NAME_LABEL in labels:
        out[metric_names.MOEINFERENCE_LABEL] = labels[k8s_names.NAME_LABEL]
    if labels.get(k8s_names.LWS_GROUP_INDEX_LABEL) is not None:
        out[metric_names.GROUP_LABEL] = str(labels[k8s_names.LWS_GROUP_INDEX_LABEL])
        out[metric_names.GROUP_WORKER_LABEL] = str(labels.get(k8s_names.LWS_WORKER_INDEX_LABEL, ""))
        out[metric_names.GROUP_SIZE_LABEL] = str(notes.get(k8s_names.LWS_SIZE_ANNOTATION, ""))
    return tuple(sorted(out.items()))


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
        out.append(Target(pod=meta.get("name", ip), url=f"http://{host}:{port}{k8s_names.EXPORTER_PATH}",
                          labels=pod_labels(pod)))
    return out


@dataclass
class PodSample:
    """One pod's counters at one scrape, per model."""

    #: clock time the pod's answer came back (None: the round's time). The counters are of the moment
    #: the pod answered, which on a busy node or operator is seconds after the round started.
    time: float | None = None
    start_time: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    #: ``moe_eplb_exporter_group_pods`` per model (a pod of a replica group; 0: its expert counts
    #: are in its group leader's counter)
    group_pods: dict[str, float] = field(default_factory=dict)
    #: (sample name, labels, value) of the telemetry sources the target serves
    #: (:data:`TELEMETRY_SAMPLES`; vLLM's own series only where the target serves them too)
    telemetry: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


#: Sample names kept for the calibration's telemetry (moe_eplb.metrics.telemetry_keys.SAMPLE_NAMES).
TELEMETRY_SAMPLES = frozenset({
    metric_names.STEP_SECONDS + "_sum", metric_names.STEP_SECONDS + "_count", metric_names.RANK_TOKENS,
    metric_names.REARRANGEMENT_SECONDS + "_sum", metric_names.REARRANGEMENT_SECONDS + "_count",
    metric_names.CONFIG_INFO, metric_names.KV_CACHE_BYTES, vllm_facts.KV_CACHE_USAGE, vllm_facts.PREEMPTIONS,
    vllm_facts.REQUESTS_WAITING, vllm_facts.PREFIX_CACHE_QUERIES, vllm_facts.PREFIX_CACHE_HITS,
    vllm_facts.PREFIX_CACHE_QUERIES_OLD, vllm_facts.PREFIX_CACHE_HITS_OLD, vllm_facts.CACHE_CONFIG_INFO,
})


_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")


#: label sets read so far (the text between the braces -> labels): a pod serves the same series at
#: every scrape, so each is parsed once; cleared when it grows past _LABEL_CACHE_SIZE
_LABEL_CACHE: dict[str, dict[str, str]] = {}
_LABEL_CACHE_SIZE = 200_000


def _labels(body: str, line_no: int) -> dict[str, str]:
    """``{name: value}`` of one sample's label set (the text between the braces; callers must not
    change the dict, it is shared)."""
    out = _LABEL_CACHE.get(body)
    if out is not None:
        return out
    out = _read_labels(body, line_no)
    if len(_LABEL_CACHE) >= _LABEL_CACHE_SIZE:
        _LABEL_CACHE.clear()
    _LABEL_CACHE[body] = out
    return out


def _read_labels(body: str, line_no: int) -> dict[str, str]:
    out: dict[str, str] = {}
    pos, n = 0, len(body)
    while pos < n:
        m = _LABEL_PAIR.match(body, pos)
        if m is None or m.end() == pos:
            if body[pos:].strip() == "":
                break
            raise ValueError(f"/metrics line {line_no}: cannot read the labels {{{body}}}")
        value = m.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda x: "\n" if x.group(1) == "n" else x.group(1), value)
        out[m.group(1)] = value
        pos = m.end()
    return out


def exposition_samples(text: str, names: Container[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(sample name, labels, value)`` of the samples named in ``names`` in one ``/metrics`` body
    (the classic text format, version 0.0.4); the lines of other samples are skipped unparsed.

    prometheus_client's parser reads every line into objects; a DeepSeek-V3 pod serves ~30k
    series of which a direct scrape needs about half, and parsing them all took ~1 s of CPU per pod
    (4 s per scrape of a LeaderWorkerSet group, in the operator's process). Raises ValueError on a
    line it cannot read (a sample without a value, an unbalanced label set, a value that is not a
    number)."""
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace].strip()
            if name not in names:
                continue
            close = line.rfind("}")
            if close < brace:
                raise ValueError(f"/metrics line {line_no}: unbalanced braces in {line[:200]!r}")
            labels, rest = _labels(line[brace + 1:close], line_no), line[close + 1:].split()
        else:
            parts = line.split()
            name, labels, rest = parts[0], {}, parts[1:]
            if name not in names:
                continue
        if not rest or len(rest) > 2:
            raise ValueError(f"/metrics line {line_no}: expected a value (and a timestamp) after the labels "
                             f"in {line[:200]!r}")
        yield name, labels, float(rest[0])


#: Sample names :func:`parse_exposition` reads (the load's counters and the telemetry's sources).
_COUNTERS = frozenset({metric_names.EXPERT_TOKENS, metric_names.ENGINE_STEPS, metric_names.EXPORTER_START_TIME,
                       metric_names.EXPORTER_GROUP_PODS})


def parse_exposition(text: str) -> PodSample:
    """The exporter's counters from one ``/metrics`` body (classic text format)."""
    sample = PodSample()
    layer, expert, model = metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT, metric_names.LABEL_MODEL
    for name, lab, value in exposition_samples(text, _COUNTERS | TELEMETRY_SAMPLES):
        if name == metric_names.EXPERT_TOKENS:
            sample.tokens.setdefault(lab[model], {})[(int(lab[layer]), int(lab[expert]))] = value
        elif name == metric_names.ENGINE_STEPS:
            sample.steps[lab[model]] = value
        elif name == metric_names.EXPORTER_START_TIME:
            sample.start_time[lab[model]] = value
        elif name == metric_names.EXPORTER_GROUP_PODS:
            sample.group_pods[lab[model]] = value
        else:
            sample.telemetry.append((name, lab, value))
    return sample


@dataclass
class Round:
    time: float  # unix seconds
    pods: dict[str, PodSample]
    labels: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # pod -> Target.labels


class PodScraper:
    """Scrapes targets and keeps up to ``keep`` rounds (one instance per MoEInference)."""

    def __init__(self, timeout: float = 5.0, keep: int = 1000, clock=time.time):
        self.timeout = timeout
        self.keep = keep
        self.clock = clock
        self.rounds: list[Round] = []  # in time order
        self._lock = threading.Lock()  # a scrape loop and a read may scrape at once
        self.failed: list[tuple[str, str]] = []  # (pod, error) of the last round's pods that did not answer

    def fetch(self, target: Target) -> str:
        req = urllib.request.Request(target.url, headers={"Accept": "text/plain;version=0.0.4"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return resp.read().decode("utf-8")

    def scrape(self, targets: list[Target]) -> Round:
        """Scrape every target into one round, kept with the pods that answered: like a Prometheus
        target, a pod that does not answer (it is being replaced, or slow) only misses this sample,
        which the reader treats as a scrape gap, instead of failing every pod's sample (which made
        gaps of every rollout). ``self.failed``: ``(pod, error)`` of this round's failures. Raises
        ``ScrapeFailed`` when no pod answered (nothing kept)."""
        if not targets:
            raise LoadReadError(NO_TARGETS, "no running pod with a container port named "
                                f"{k8s_names.EXPORTER_PORT_NAME!r}; is the exporter enabled in the engine image?")
        now = self.clock()

        def one(t: Target):
            try:
                text = self.fetch(t)
                answered = self.clock()
                sample = parse_exposition(text)
                sample.time = answered
                return t, sample, None
            except Exception as exc:  # noqa: BLE001
                return t, None, exc

        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            results = list(pool.map(one, targets))
        failed = [(t, e) for t, _, e in results if e is not None]
        self.failed = [(t.pod, f"{type(e).__name__}: {e}") for t, e in failed]
        if len(failed) == len(targets):
            t, e = failed[0]
            raise LoadReadError(SCRAPE_FAILED, f"{len(failed)} of {len(targets)} pod(s) could not be scraped, "
                                f"e.g. {t.pod} at {t.url}: {type(e).__name__}: {e}")
        rnd = Round(time=now, pods={t.pod: s for t, s, e in results if e is None},
                    labels={t.pod: t.labels for t, _, e in results if e is None})
        with self._lock:  # in time order, also when a slower scrape that started earlier ends later
            at = len(self.rounds)
            while at > 0 and self.rounds[at - 1].time > now:
                at -= 1
            self.rounds.insert(at, rnd)
            del self.rounds[: max(0, len(self.rounds) - self.keep)]
        return rnd

    def since(self, t: float) -> list[Round]:
        """The rounds after ``t``, preceded by the last one at or before it (the baseline of a read
        whose first bucket starts at ``t``); older rounds are forgotten (a read's window only
        moves forward)."""
        with self._lock:
            first = 0
            for i, r in enumerate(self.rounds):
                if r.time <= t:
                    first = i
            del self.rounds[:first]
            return list(self.rounds)


def sample_time(rnd: Round, sample: PodSample) -> float:
    """When a pod's sample of a direct-scrape round was taken: when the pod answered (its counters
    are of that moment), else the round's start. Under load the two differ by seconds -- of an
    accelerated clock, a good part of a bucket -- and stamping every pod with the round's start put
    load in the wrong buckets."""
    return rnd.time if sample.time is None else sample.time
