"""An experiment's arms as their pods' metrics show them: one bucket of the objective per arm.

Each tick of a running experiment scrapes every ready engine pod once (:func:`scrape_arm_counters`)
and keeps the counters (:class:`ArmTracker`); the difference with the previous round, summed over
an arm's pods, is that arm's :class:`moe_eplb.eplb.tuning.experiment.ArmBucket` (:func:`arm_bucket`):

* step time: vLLM's inter-token latency (``vllm:inter_token_latency_seconds``, its mean over the
  bucket), else the exporter's engine step histogram (``moe_eplb_step_duration_seconds``);
* batch size: vLLM's tokens per engine step (``vllm:iteration_tokens_total``), else the exporter's
  ``moe_eplb_step_tokens``;
* throughput per GPU: the tokens the arm processed per second its engines were busy (the step
  histogram's sum: an engine that is saturated is busy all the time, so this is its throughput),
  per GPU; without step times, vLLM's prompt + generated tokens per wall second;
* saturated: requests waiting (``vllm:num_requests_waiting`` > 0) or the KV cache full (>= 0.95);
* TTFT: vLLM's ``vllm:time_to_first_token_seconds`` mean (the guard);
* served balancedness: from the exporter's tokens per EP rank and layer
  (``moe_eplb_rank_tokens_total``): per layer the mean over the ranks over the max, averaged over the
  layers and the arm's pods (vLLM's own definition, over the bucket), reported; and the served
  imbalance as the cost model has it (the sum over layers of the busiest rank's tokens over the mean
  rank's): what the learning step (:func:`moe_eplb.eplb.tuning.learn.learn`) weighs the arms' step
  times by.

Blocking HTTP in :func:`scrape_arm_counters` (call it with ``asyncio.to_thread``); the rest is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from moe_eplb.api.knobs import Knobs
from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.eplb.tuning.experiment import ArmBucket
from moe_eplb.eplb.tuning.exploration import ArmObservation
from moe_eplb.metrics.measure import scrape_ready_pods
from moe_eplb.metrics.scrape import exposition_samples

#: KV-cache usage from which an engine counts as saturated
KV_FULL = 0.95

_SUMS = {f"{n}_{part}" for n in (vllm_facts.ITL_SECONDS, vllm_facts.ITERATION_TOKENS, vllm_facts.TTFT_SECONDS,
                                  metric_names.STEP_SECONDS, metric_names.STEP_TOKENS) for part in ("sum", "count")}
_COUNTERS = {vllm_facts.GENERATION_TOKENS, vllm_facts.PROMPT_TOKENS}
_GAUGES = {vllm_facts.REQUESTS_WAITING, vllm_facts.KV_CACHE_USAGE, vllm_facts.KV_CACHE_USAGE_OLD}
SAMPLES = frozenset(_SUMS | _COUNTERS | _GAUGES | {metric_names.RANK_TOKENS})

#: a sample name summed over label sets, or ``RANK_KEY/<layer>/<rank>`` for one rank's tokens in one layer
Counters = dict[str, float]
RANK_KEY = "rank_tokens"


def counters_from_exposition(text: str) -> Counters:
    """The samples an arm bucket needs from one ``/metrics`` body, summed over their label sets
    (ranks, engines); gauges take the largest value; the tokens per EP rank and layer kept apart
    (``RANK_KEY/<layer>/<rank>``)."""
    out: Counters = {}
    for name, labels, value in exposition_samples(text, SAMPLES):
        if name == metric_names.RANK_TOKENS:
            key = f"{RANK_KEY}/{labels.get(metric_names.LABEL_LAYER, '')}/{labels.get(metric_names.LABEL_RANK, '')}"
            out[key] = out.get(key, 0.0) + value
        else:
            out[name] = max(out.get(name, value), value) if name in _GAUGES else out.get(name, 0.0) + value
    return out


def _layer_deltas(prev: Counters, cur: Counters) -> list[list[float]] | None:
    """Per MoE layer, the tokens each EP rank took between two rounds of one pod (layers with at
    least two ranks and some tokens); None on a reset (a counter went back: a restart)."""
    layers: dict[str, list[float]] = {}
    for key, value in cur.items():
        if not key.startswith(RANK_KEY + "/") or key not in prev:
            continue
        if value < prev[key]:
            return None  # a counter went back: a restart, no bucket from this pod
        layers.setdefault(key.split("/")[1], []).append(value - prev[key])
    return [v for v in layers.values() if len(v) > 1 and max(v) > 0]


def _balancedness(layers: list[list[float]] | None) -> float | None:
    ratios = [sum(v) / len(v) / max(v) for v in layers or ()]
    return sum(ratios) / len(ratios) if ratios else None


def _imbalance(layers: list[list[float]] | None) -> float | None:
    return sum(max(v) for v in layers) / sum(sum(v) / len(v) for v in layers) if layers else None


def served_balancedness(prev: Counters, cur: Counters) -> float | None:
    """Mean over layers of (mean tokens over the EP ranks / max) between two rounds of one pod;
    None without rank counters, on a reset, or a bucket with no tokens."""
    return _balancedness(_layer_deltas(prev, cur))


def served_imbalance(prev: Counters, cur: Counters) -> float | None:
    """The cost model's served imbalance between two rounds of one pod: the sum over layers of the
    busiest rank's tokens over the sum of the mean rank's (each layer waits for its busiest rank;
    :func:`moe_eplb.eplb.workload.trace.served_imbalance`). Not 1 / :func:`served_balancedness`, which
    understates it where layers differ. None as for :func:`served_balancedness`."""
    return _imbalance(_layer_deltas(prev, cur))


def scrape_arm_counters(pods: Iterable[Mapping], timeout: float) -> dict[str, Counters]:
    """One round over the ready engine pods: ``{pod name: counters}`` (pods that do not answer left out)."""
    return scrape_ready_pods(pods, timeout, counters_from_exposition)


def _delta(prev: Counters, cur: Counters, name: str) -> float | None:
    if name not in cur or name not in prev:
        return None
    d = cur[name] - prev[name]
    return d if d >= 0 else None  # a reset (restart): no bucket from this pod


def _mean(prev: Counters, cur: Counters, family: str) -> tuple[float, float] | None:
    s, c = _delta(prev, cur, f"{family}_sum"), _delta(prev, cur, f"{family}_count")
    return (s, c) if s is not None and c is not None and c > 0 else None


@dataclass
class _Sums:
    step: list[float] = field(default_factory=lambda: [0.0, 0.0])  # seconds, steps
    batch: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, steps
    ttft: list[float] = field(default_factory=lambda: [0.0, 0.0])
    balance: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum of pods' balancedness, pods
    imbalance: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sum of pods' served imbalance, pods
    served: float = 0.0
    saturated: bool = False
    pods: int = 0

    def add(self, prev: Counters, cur: Counters) -> None:
        itl = _mean(prev, cur, vllm_facts.ITL_SECONDS) or _mean(prev, cur, metric_names.STEP_SECONDS)
        batch = _mean(prev, cur, vllm_facts.ITERATION_TOKENS) or _mean(prev, cur, metric_names.STEP_TOKENS)
        busy = _mean(prev, cur, metric_names.STEP_SECONDS) or itl
        if itl is None or batch is None:
            return
        self.pods += 1
        self.step[0] += itl[0] / itl[1]
        self.step[1] += 1
        self.batch[0] += batch[0] / batch[1]
        self.batch[1] += 1
        # tokens per busy second: the batch's tokens over the steps' time (per engine step)
        if busy is not None and busy[0] > 0:
            self.served += batch[0] / busy[0] * (busy[1] / batch[1])
        if (ttft := _mean(prev, cur, vllm_facts.TTFT_SECONDS)) is not None:
            self.ttft[0] += ttft[0] / ttft[1]
            self.ttft[1] += 1
        layers = _layer_deltas(prev, cur)  # once for both
        if (bal := _balancedness(layers)) is not None:
            self.balance[0] += bal
            self.balance[1] += 1
        if (imb := _imbalance(layers)) is not None:
            self.imbalance[0] += imb
            self.imbalance[1] += 1
        waiting = cur.get(vllm_facts.REQUESTS_WAITING, 0.0)
        kv = max(cur.get(vllm_facts.KV_CACHE_USAGE, 0.0), cur.get(vllm_facts.KV_CACHE_USAGE_OLD, 0.0))
        self.saturated = self.saturated or waiting > 0 or kv >= KV_FULL


def arm_bucket(prev: Mapping[str, Counters], cur: Mapping[str, Counters], pods: Iterable[str], *,
               gpus_per_replica: int) -> ArmBucket | None:
    """The bucket of one arm (``pods``: its engine pods, one per replica or the leader of each
    group) between two rounds; None when none of its pods has both rounds."""
    sums = _Sums()
    for pod in pods:
        if pod in prev and pod in cur:
            sums.add(prev[pod], cur[pod])
    if sums.pods == 0:
        return None
    tput = sums.served / sums.pods / max(1, gpus_per_replica) if sums.served > 0 else None
    return ArmBucket(step_seconds=sums.step[0] / sums.step[1], tokens_per_step=sums.batch[0] / sums.batch[1],
                     tokens_per_second_per_gpu=tput, saturated=sums.saturated,
                     ttft_seconds=sums.ttft[0] / sums.ttft[1] if sums.ttft[1] else None,
                     balancedness=sums.balance[0] / sums.balance[1] if sums.balance[1] else None,
                     imbalance=sums.imbalance[0] / sums.imbalance[1] if sums.imbalance[1] else None)


@dataclass
class ArmTracker:
    """The previous round of one experiment's pods (in memory: an operator restart costs a bucket)."""

    started_at: float | None = None  # the experiment's start (a new experiment starts afresh)
    previous: dict[str, Counters] = field(default_factory=dict)
    previous_time: float | None = None
    trial: list[ArmBucket] = field(default_factory=list)  # every paired bucket so far, per arm
    control: list[ArmBucket] = field(default_factory=list)

    def bucket(self, now: float, cur: dict[str, Counters], trial: list[str], control: list[str], *,
               gpus_per_replica: int) -> tuple[ArmBucket, ArmBucket] | None:
        """``(trial, control)`` between the previous round and ``cur`` (then ``cur`` is kept);
        None on the first round or when an arm has no pod with both rounds."""
        prev, self.previous, self.previous_time = self.previous, dict(cur), now
        if not prev:
            return None
        t = arm_bucket(prev, cur, trial, gpus_per_replica=gpus_per_replica)
        c = arm_bucket(prev, cur, control, gpus_per_replica=gpus_per_replica)
        if t is None or c is None:
            return None
        self.trial.append(t)
        self.control.append(c)
        return t, c


    def each_against_rest(self, now: float, cur: dict[str, Counters], pods: list[str], *,
                          gpus_per_replica: int) -> dict[str, tuple[ArmBucket, ArmBucket]]:
        """``{pod: (its bucket, the other pods' together)}`` between the previous round and ``cur``
        (then ``cur`` is kept): a cross-pod experiment's pre-period, where every pod runs the same
        settings and each one's own difference from the rest is measured. Empty on the first round."""
        prev, self.previous, self.previous_time = self.previous, dict(cur), now
        out = {}
        for pod in pods:
            rest = [p for p in pods if p != pod]
            own = arm_bucket(prev, cur, [pod], gpus_per_replica=gpus_per_replica) if prev else None
            others = arm_bucket(prev, cur, rest, gpus_per_replica=gpus_per_replica) if prev and rest else None
            if own is not None and others is not None:
                out[pod] = (own, others)
        return out


def _avg(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def observation(knobs: Knobs, buckets: list[ArmBucket], *, pods: int, seconds: float) -> ArmObservation:
    """One arm over the experiment (:class:`moe_eplb.eplb.tuning.exploration.ArmObservation`): the means
    of its buckets (None where no bucket had the value)."""
    return ArmObservation(knobs=knobs, pods=pods, seconds=seconds,
                          step_seconds=_avg([b.step_seconds for b in buckets]),
                          tokens_per_step=_avg([b.tokens_per_step for b in buckets]),
                          tokens_per_second_per_gpu=_avg([b.tokens_per_second_per_gpu for b in buckets]),
                          balancedness=_avg([b.balancedness for b in buckets]),
                          imbalance=_avg([b.imbalance for b in buckets]))
