"""A judge the tuner does not share: hidden true engine costs on real DeepSeek-V3 statistics.

    python bench/bench_judge.py [--hours 1] [--seed 0] [--only CASE] [--json OUT.json] [--traces DIR]

The workload is DeepSeek-V3 (58 MoE layers x 256 experts, 8 groups, top-8) at EP 32 on 4 nodes,
generated from the REAL per-layer expert statistics in ``DIR/deepseek_v3_expert_counts.json``
(SGLang's recorder; default ``../shared/traces``) with a chat -> code -> math mix. Each case is a
deployment with TRUE costs (:class:`moe_eplb_harness.engines.physics.TrueCost`) that the tuner never sees,
already running a configuration (vLLM's defaults 1000/3000/0, the seed's setting 3000/1000/32, or a
tuned 5000/2000/64):

1. the first half is served by the running configuration and recorded with the telemetry a real
   deployment exports (step times, rank load, rearrangement durations, KV usage, preemptions,
   queue, prefix-cache queries and hits, the cache's size) under the true costs;
2. the tuner calibrates on it (:func:`moe_eplb.eplb.tuning.calibrate.calibrate`) and decides robustly
   over the parameter ranges (:meth:`~moe_eplb.eplb.tuning.calibrate.Calibration.robustness`), as
   ``moe-eplb tune`` does, with the running configuration as current;
3. the judge scores every configuration of the tuner's grid (plus the running one and vLLM's
   defaults) on the second half with the TRUTH: the replay's imbalance and rearrangements priced
   with the true MoE share and stall / copy cost, times the true memory factor
   (:meth:`TrueCost.memory_factor`: a batch capped by ``min(1, 0.97 c / demand) ** elasticity``, a
   prefix cache following a power law ``reuse * min(1, (free / working_set) ** 0.7)`` and prompt
   tokens costing ``prefill_cost_ratio`` times an average token) -- functional forms and
   parameters the tuner's cost model does not have.

Where the tuner proposes a trial (``TuneResult.explore``: the choice hinges on a prior range and
the regret at stake beats the trial cost, with ``REPLICAS`` replicas), the judge plays it from its
truth on the first half of the judged half: the trial arm (the candidate, one replica) and the
control arm (the running setting, the others) on the same traffic, each an
:class:`~moe_eplb.eplb.tuning.exploration.ArmObservation` (served balancedness from the replay, step time
from the true step cost, KV usage and prefix hit rate from the true memory model, with measurement
noise); :func:`moe_eplb.eplb.tuning.learn.learn` narrows the ranges, the calibration keeps them
(``calibrate(..., learned=)``) and the tuner decides again; that final decision is scored. Cases
marked "no step times" drop the recorded step times, so only an experiment can tell the MoE share;
"demo's hot experts" is the demo's DeepSeek-V3 shift, running 100/1000/0.

Is EPLB worth it: EPLB off is scored too (the static replay under the truth), and the cases
``nvlink-ep8-off``, ``deepep-ll-overlap``, ``deepep-ll-measured``, ``deepep-v2-control`` (DeepSeek-V3 with
nearly even traffic, DeepEP low latency costing the shared-expert overlap: ``TrueCost.overlap_loss``) and
``cache-affine`` (two replicas with different loads: each tuned on its own load against one shared
setting, :func:`run_replica_case`) ask it; their line in the "is EPLB worth it" block gives the mode
and what would change the answer.

Printed per case: the truth, the running configuration, the pick, the best of the grid under the
truth, the pick as a share of the best, of the running configuration and of vLLM's defaults, the
running configuration's share of the best, and for comparison the previous tuner's pick (the
calibrated point estimate with the KV elasticity rule, no ranges) and its share of the best.
Then which cases explored, what the trial was, what was learned and the decision before and after.
Exit 1 if any pick is below 97 % of the best, or below the running configuration or the defaults, or
where per-replica settings do not beat every single shared setting (``cache-affine``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs  # noqa: E402
from moe_eplb.eplb.replay.costmodel import CostModel  # noqa: E402
from moe_eplb.eplb.replay.simulator import Replay, SimError, Topology  # noqa: E402
from moe_eplb.eplb.tuning.calibrate import calibrate  # noqa: E402
from moe_eplb.eplb.tuning.exploration import ArmObservation  # noqa: E402
from moe_eplb.eplb.tuning.learn import learn  # noqa: E402
from moe_eplb.eplb.tuning.overlap import EPLB_OFF, context_for  # noqa: E402
from moe_eplb.eplb.tuning.replicas import replay_score, tune_per_replica  # noqa: E402
from moe_eplb.eplb.tuning.robust import scenario_segments, terms_of  # noqa: E402
from moe_eplb.eplb.tuning.tuner import TuneOptions, tune  # noqa: E402
from moe_eplb.eplb.workload import synth  # noqa: E402
from moe_eplb_harness.engines.physics import FULL_USAGE, TrueCost, tokens_per_step  # noqa: E402
from moe_eplb_harness.engines.recording import record  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces")
REAL_FILE = "deepseek_v3_expert_counts.json"
PROFILE = "deepseek-v3-chat-code-math"
TOPOLOGY = dict(ep_size=32, num_nodes=4, num_groups=8)
SEED_32 = Knobs(3000, 1000, 32)  # the seed's window / interval with 32 redundant experts (valid at EP 32)
TUNED = Knobs(5000, 2000, 64)  # what an earlier tuner picked where redundancy was free
RUNNING = {"defaults": VLLM_DEFAULTS, "seed": SEED_32, "tuned": TUNED}
DEMO_RUNNING = Knobs(100, 1000, 0)  # the demo's DeepSeek-V3 resource after the workload shift
RUNNING["demo"] = DEMO_RUNNING
#: Replicas sharing the traffic: a trial runs on one, the control on the others.
REPLICAS = 4
#: A trial's share of the judged half (the rest is served by the final decision as well).
TRIAL_SHARE = 0.5
#: The judge's measurement noise: relative sd of one pod's 15 s mean step time / prefix hit rate.
MEASURE_NOISE = 0.03


@dataclass(frozen=True)
class Case:
    what: str
    running: str
    true: TrueCost
    hot: bool = False  # the demo's shift: a few experts of every layer draw several times their share
    no_steps: bool = False  # the recorded telemetry has no step times: the MoE share stays a prior
    topology: dict | None = None  # the deployment (default TOPOLOGY: EP 32 on 4 nodes)
    profile: str | None = None  # its own workload profile (default PROFILE on the real statistics)
    real: bool = True  # the profile fitted on the real DeepSeek-V3 statistics (False: the generator's own fit)
    backend: str | None = None  # the all2all backend: vLLM 0.34's shared-expert overlap rule for DeepSeek-V3
    off_period: bool = False  # an EPLB-off period was measured (vLLM's step time before EPLB was enabled)


#: The share of the shared experts' time DeepEP's dispatch/combine overlap hides in the overlap cases'
#: truth: EPLB on DeepEP low latency costs every step ``f x 1/8 x`` this (DeepSeek-V3: 1 shared expert
#: against 8 routed).
OVERLAP_HIDDEN_TRUE = 0.8


def _overlap(share: float) -> float:
    return share / 8 * OVERLAP_HIDDEN_TRUE


def _t(**kw) -> TrueCost:
    return TrueCost(**kw)


#: MoE share 0.03-0.6; sync stalls 0.3-2 s or async copies; KV cache idle, prefix-heavy between
#: idle and full, or saturated; engines on vLLM's defaults, the seed's 3000/1000/32 or a tuned setting.
CASES = {
    "moe-idle-def": Case("share 0.6, async, KV idle", "defaults", _t(moe_time_share=0.6, kv_demand=0.3)),
    "moe-idle-seed": Case("share 0.6, async, KV idle", "seed", _t(moe_time_share=0.6, kv_demand=0.3)),
    "moe-idle-tuned": Case("share 0.45, sync 0.3 s, KV idle", "tuned",
                           _t(moe_time_share=0.45, use_async=False, sync_stall_s=0.3, kv_demand=0.3)),
    "mid-prefix-def": Case("share 0.35, sync 0.91 s, KV 70 %, prefix reuse 0.7", "defaults",
                           _t(moe_time_share=0.35, use_async=False, kv_demand=0.7, prefix_reuse=0.7,
                              prefix_working_set=0.3)),
    "mid-prefix-seed": Case("share 0.35, async, KV 65 %, prefix reuse 0.6", "seed",
                            _t(moe_time_share=0.35, kv_demand=0.65, prefix_reuse=0.6, prefix_working_set=0.4)),
    "h800-prefix-seed": Case("share 0.03, async, KV 70 %, prefix reuse 0.7", "seed",
                             _t(moe_time_share=0.03, kv_demand=0.7, prefix_reuse=0.7, prefix_working_set=0.3)),
    "h800-prefix-def": Case("share 0.05, sync 2 s, KV 75 %, prefix reuse 0.7", "defaults",
                            _t(moe_time_share=0.05, use_async=False, sync_stall_s=2.0, kv_demand=0.75,
                               prefix_reuse=0.7, prefix_working_set=0.5)),
    "mid-prefix-tuned": Case("share 0.2, async, KV 75 %, reuse 0.5, prompt 1.5x", "tuned",
                             _t(moe_time_share=0.2, kv_demand=0.75, prefix_reuse=0.5, prefix_working_set=0.6,
                                prefill_cost_ratio=1.5)),
    "mid-noreuse-tuned": Case("share 0.6, sync 0.5 s, KV 75 %, no prefix reuse", "tuned",
                              _t(moe_time_share=0.6, use_async=False, sync_stall_s=0.5, kv_demand=0.75)),
    "near-full-seed": Case("share 0.3, sync 1.2 s, KV 85 %, reuse 0.4", "seed",
                           _t(moe_time_share=0.3, use_async=False, sync_stall_s=1.2, kv_demand=0.85,
                              prefix_reuse=0.4, prefix_working_set=1.0)),
    "full-def": Case("share 0.05, sync 1.5 s, KV saturated", "defaults",
                     _t(moe_time_share=0.05, use_async=False, sync_stall_s=1.5, kv_demand=1.5,
                        kv_throughput_elasticity=1.0)),
    "full-seed": Case("share 0.05, async, KV saturated", "seed",
                      _t(moe_time_share=0.05, kv_demand=1.5, kv_throughput_elasticity=1.0)),
    "full-tuned": Case("share 0.6, async, KV saturated (elasticity 0.6)", "tuned",
                       _t(moe_time_share=0.6, kv_demand=1.2, kv_throughput_elasticity=0.6)),
    "light-prefix-def": Case("share 0.45, async, KV 50 %, reuse 0.3, large working set", "defaults",
                             _t(moe_time_share=0.45, kv_demand=0.5, prefix_reuse=0.3, prefix_working_set=1.5)),
    # the demo's DeepSeek-V3 resource after the workload shift: running 100/1000/0 (sync, short window)
    "demo-shift": Case("demo's hot experts, share 0.35, sync 0.91 s, KV 50 %", "demo",
                       _t(moe_time_share=0.35, use_async=False, kv_demand=0.5), hot=True),
    # only an experiment can tell: no step times recorded, so the MoE share stays its prior range
    "nosteps-moe-def": Case("share 0.55, async, KV 80 %, reuse 0.5, no step times", "defaults",
                            _t(moe_time_share=0.55, kv_demand=0.8, prefix_reuse=0.5, prefix_working_set=0.5),
                            no_steps=True),
    "nosteps-h800-def": Case("share 0.04, async, KV 80 %, reuse 0.5, no step times", "defaults",
                             _t(moe_time_share=0.04, kv_demand=0.8, prefix_reuse=0.5, prefix_working_set=0.5),
                             no_steps=True),
    "nosteps-hot-def": Case("hot experts, share 0.5, sync, KV 85 %, no step times", "defaults",
                            _t(moe_time_share=0.5, use_async=False, kv_demand=0.85, prefix_reuse=0.5,
                               prefix_working_set=0.4), hot=True, no_steps=True),
    "nosteps-hot-h800": Case("hot experts, share 0.04, sync, KV 85 %, no step times", "defaults",
                             _t(moe_time_share=0.04, use_async=False, kv_demand=0.85, prefix_reuse=0.5,
                                prefix_working_set=0.4), hot=True, no_steps=True),
    # is EPLB worth it. On DeepSeek-V3's real expert statistics balancing gains far more than
    # the overlap can cost (at most f/8 of a step), so EPLB off can only win where the traffic spreads
    # nearly evenly over the experts: the generator's flat control (Mixtral's popularity on the shape)
    "nvlink-ep8-off": Case("EP 8 one NVLink node, DeepEP LL, even traffic, share 0.3, overlap 80 % hidden, async",
                           "defaults", _t(moe_time_share=0.3, overlap_loss=_overlap(0.3), kv_demand=0.3),
                           topology=dict(ep_size=8, num_nodes=1, num_groups=8), profile="deepseek-v3-flat",
                           real=False, backend="deepep_low_latency"),
    "deepep-ll-overlap": Case("EP 32, DeepEP LL, even traffic, share 0.35, overlap 80 % hidden, async", "defaults",
                              _t(moe_time_share=0.35, overlap_loss=_overlap(0.35), kv_demand=0.3),
                              profile="deepseek-v3-flat", real=False, backend="deepep_low_latency"),
    "deepep-ll-measured": Case("as deepep-ll-overlap, with an EPLB-off period measured", "defaults",
                               _t(moe_time_share=0.35, overlap_loss=_overlap(0.35), kv_demand=0.3),
                               profile="deepseek-v3-flat", real=False, backend="deepep_low_latency", off_period=True),
    "deepep-v2-control": Case("as deepep-ll-overlap on DeepEP v2 (overlap kept)", "defaults",
                              _t(moe_time_share=0.35, kv_demand=0.3), profile="deepseek-v3-flat", real=False,
                              backend="deepep_v2"),
}


#: Two replicas behind a cache-affine router: replica ``a`` serves a chat tenant whose prompts
#: draw 6x on 4 experts of every layer (DeepSeek-V3's real statistics), replica ``b`` broad traffic that
#: spreads nearly evenly; EP 32, share 0.3, async, KV cache 75 % used with prefix reuse 0.5 (redundancy
#: costs prefix hits). One shared setting tuned on the pooled load against each replica tuned on its own.
REPLICA_CASES = {
    "cache-affine": Case("2 replicas, cache-affine: hot chat tenant vs even traffic; share 0.3, KV 75 %, reuse 0.5",
                         "defaults", _t(moe_time_share=0.3, kv_demand=0.75, prefix_reuse=0.5, prefix_working_set=0.4)),
}


def true_scorer(future, true: TrueCost, topology: dict = TOPOLOGY):
    """``score(knobs) -> true relative throughput`` on ``future`` (None where vLLM refuses it); ``EPLB_OFF``
    is vLLM's static placement (no rearrangement, no redundancy, no shared-expert overlap lost)."""
    truth = replace(true.cost_model(future), kv_throughput_elasticity=0.0)  # memory: TrueCost.memory_factor
    replay = Replay(future, Topology(**topology), truth)
    edges = np.array([0, future.num_buckets])
    L, E = future.num_layers, future.num_experts
    bpe = truth.resolve_bytes_per_expert(L, E) or 0.0
    cache: dict = {}

    def score(knobs) -> float | None:
        if knobs not in cache:
            try:
                res = replay.run_static() if knobs is EPLB_OFF else replay.run(knobs)
            except SimError:
                cache[knobs] = None
                return None
            seg = scenario_segments(terms_of(res, future.bucket_steps, edges), truth, topology["ep_size"], L, E)
            red = L * bpe * knobs.num_redundant_experts / topology["ep_size"]
            cache[knobs] = float(seg[0]) * true.memory_factor(future, red)
        return cache[knobs]

    return score


def play_arm(knobs: Knobs, pods: int, part, true: TrueCost, rng: np.random.Generator,
             topology: dict = TOPOLOGY) -> ArmObservation:
    """One arm of an experiment on ``part`` (the traffic both arms serve) from the TRUTH: its served
    balancedness from the replay, its step time outside rearrangement stalls from the true balanced
    step time and MoE share, its KV usage and prefix hit rate from the true memory model, each mean
    with the judge's measurement noise over ``pods`` x the part's 15 s buckets."""
    truth = true.cost_model(part)
    res = Replay(part, Topology(**topology), truth).run(knobs)
    bal = float(res.balancedness)
    tok = tokens_per_step(part)
    n = part.bucket_steps.astype(np.float64)
    seconds = part.num_buckets * part.bucket_seconds
    noise = MEASURE_NOISE / np.sqrt(max(1.0, pods * part.num_buckets))
    L, E = part.num_layers, part.num_experts
    red = L * (truth.resolve_bytes_per_expert(L, E) or 0.0) * knobs.num_redundant_experts / topology["ep_size"]
    cap = true.kv_capacity(red)
    ref = float(np.median(tok[n > 0]))
    demand = true.kv_demand_share(tok, ref)
    usage = float(np.average(np.minimum(demand, FULL_USAGE * cap) / cap, weights=n))
    hit = float(np.average(true.prefix_hit_rate(demand, cap), weights=n)) if true.prefix_reuse > 0 else None
    tok_mean = float(np.average(tok, weights=n))
    step = true.balanced_step_s(tok_mean) * ((1 - true.moe_time_share) + true.moe_time_share / bal + true.overlap_loss)
    jitter = lambda v: None if v is None else float(v * np.exp(rng.normal(0.0, noise)))  # noqa: E731
    return ArmObservation(knobs, pods, float(seconds), step_seconds=jitter(step), tokens_per_step=jitter(tok_mean),
                          balancedness=bal, prefix_hit_rate=jitter(hit), kv_cache_usage=usage)


def experiment(res, cal, history, running: Knobs, future, true: TrueCost, seed: int, topology: dict = TOPOLOGY,
               overlap=None):
    """Play the tuner's exploration from the truth on the first ``TRIAL_SHARE`` of ``future`` (trial
    on 1 of ``REPLICAS``, control on the others), :func:`learn` from it, and re-decide with the learned
    ranges. Returns (the final tune result, the learned ranges)."""
    part = future.slice(0, max(2, int(future.num_buckets * TRIAL_SHARE)))
    rng = np.random.default_rng(seed + 7)
    trial = play_arm(res.explore.candidate, 1, part, true, rng, topology)
    control = play_arm(running, REPLICAS - 1, part, true, rng, topology)
    L, E = history.num_layers, history.num_experts
    bpe = true.cost_model(history).resolve_bytes_per_expert(L, E) or 0.0
    base = overlap.apply(CostModel()) if overlap is not None else CostModel()
    learned = learn(cal, cal.apply(base), trial, control, source=f"trial {trial.knobs.label} vs {running.label}",
                    bytes_per_redundant_expert=L * bpe / topology["ep_size"])
    cal2 = calibrate(history, cost=base, num_nodes=topology["num_nodes"], num_groups=topology["num_groups"],
                     learned=learned)
    options = TuneOptions(**topology, replicas=REPLICAS, trial_seconds=part.num_buckets * part.bucket_seconds,
                          overlap=overlap)
    res2 = tune(history, options, current=running, cost=cal2.apply(base), robust=cal2.robustness())
    return res2, learned


def play_off(pods: int, part, true: TrueCost, rng: np.random.Generator, topology: dict = TOPOLOGY) -> ArmObservation:
    """An EPLB-off period (or arm) on ``part`` from the TRUTH: vLLM's static placement, no overlap lost,
    its step time measured (vLLM's own metrics), its balancedness not (the exporter counts nothing
    without EPLB)."""
    res = Replay(part, Topology(**topology), true.cost_model(part)).run_static()
    tok = tokens_per_step(part)
    n = part.bucket_steps.astype(np.float64)
    tok_mean = float(np.average(tok, weights=n))
    step = true.balanced_step_s(tok_mean) * ((1 - true.moe_time_share) + true.moe_time_share / res.balancedness)
    noise = MEASURE_NOISE / np.sqrt(max(1.0, pods * part.num_buckets))
    return ArmObservation(VLLM_DEFAULTS, pods, float(part.num_buckets * part.bucket_seconds),
                          step_seconds=float(step * np.exp(rng.normal(0.0, noise))), tokens_per_step=tok_mean, eplb=False)


def measure_off(cal, history, running: Knobs, true: TrueCost, seed: int, topology: dict, overlap):
    """The deployment ran its first quarter-hour with EPLB off, then on (``running``), at comparable
    batches: the two periods' step times (played from the truth) teach the overlap's share hidden
    (:func:`learn`, the off side's imbalance from the tuner's own replay of vLLM's static placement);
    the calibration keeps it and the tuner decides again. Returns (the tune result, the learned ranges)."""
    part = history.slice(0, max(2, history.num_buckets // 4))
    rng = np.random.default_rng(seed + 11)
    on, off = play_arm(running, REPLICAS, part, true, rng, topology), play_off(REPLICAS, part, true, rng, topology)
    base = overlap.apply(CostModel())
    x_off = Replay(part, Topology(**topology), cal.apply(base)).run_static().balancedness  # the tuner's own replay
    learned = learn(cal, cal.apply(base), off, on, source="an EPLB-off period", off_balancedness=x_off)
    cal2 = calibrate(history, cost=base, num_nodes=topology["num_nodes"], num_groups=topology["num_groups"],
                     learned=learned)
    return tune(history, current=running, cost=cal2.apply(base), robust=cal2.robustness(), replicas=REPLICAS,
                overlap=overlap, **topology), learned


def _pick(res):
    """What the tuner recommends: its knobs, or ``EPLB_OFF``."""
    return res.recommendation if res.enabled else EPLB_OFF


def _context(case: Case, topology: dict):
    """The tuner's view of the deployment's shared-expert overlap (DeepSeek-V3 on vLLM 0.34, NVIDIA)."""
    return context_for("deepseek-ai/DeepSeek-V3", case.backend, (0, 34, 0), gpu_resource_name="nvidia.com/gpu",
                       nodes=topology["num_nodes"], data_parallel=topology["ep_size"])


def run_case(name: str, trace, seed: int) -> dict:
    case = CASES[name]
    running = RUNNING[case.running]
    topology = case.topology or TOPOLOGY
    if case.hot:
        from moe_eplb_harness.demo.tuning import hot_experts

        trace = hot_experts(trace, from_second=0.0)
    cut = trace.num_buckets // 2
    history = record(trace.slice(0, cut), running, topology["ep_size"], case.true, num_nodes=topology["num_nodes"],
                     num_groups=topology["num_groups"], seed=seed)
    if case.no_steps:
        history = replace(history, telemetry=replace(history.telemetry, step_seconds=None))
    future = trace.slice(cut, trace.num_buckets)
    trial_s = int(future.num_buckets * TRIAL_SHARE) * future.bucket_seconds
    overlap = _context(case, topology)
    base = overlap.apply(CostModel())
    t0 = time.perf_counter()
    cal = calibrate(history, cost=base, num_nodes=topology["num_nodes"], num_groups=topology["num_groups"])
    res = tune(history, TuneOptions(**topology, replicas=REPLICAS, trial_seconds=trial_s, overlap=overlap),
               current=running, cost=cal.apply(base), robust=cal.robustness())
    first, learned, explored = res, [], res.explore
    if case.off_period:
        res, learned = measure_off(cal, history, running, case.true, seed, topology, overlap)
        first, explored = res, None
    elif res.explore is not None:
        res, learned = experiment(res, cal, history, running, future, case.true, seed, topology, overlap)
    secs = time.perf_counter() - t0
    # the previous tuner: the calibrated point estimate, KV cost by the elasticity rule, no ranges, EPLB
    # always on and the shared-expert overlap not priced
    before = tune(history, TuneOptions(**topology, allow_off=False), current=running,
                  cost=replace(cal.apply(CostModel()), kv_demand=None))
    score = true_scorer(future, case.true, topology)
    pick, first_pick = _pick(res), _pick(first)
    grid = list(dict.fromkeys([c.knobs for c in res.candidates] + [running, VLLM_DEFAULTS, before.recommendation,
                                                                   first_pick, pick, EPLB_OFF]))
    scored = {k: v for k in grid if (v := score(k)) is not None}
    best = max(scored, key=scored.get)
    return {"case": name, "what": case.what, "running": running.label, "pick": pick.label, "decision": res.decision,
            "mode": res.mode, "best": best.label, "pick_vs_best": scored[pick] / scored[best],
            "pick_vs_running": scored[pick] / scored[running], "pick_vs_defaults": scored[pick] / scored[VLLM_DEFAULTS],
            "running_vs_best": scored[running] / scored[best], "defaults_vs_best": scored[VLLM_DEFAULTS] / scored[best],
            "point_pick": before.recommendation.label, "point_vs_best": scored[before.recommendation] / scored[best],
            "off_vs_best": scored[EPLB_OFF] / scored[best],
            "limiting_parameter": (res.robust or {}).get("limiting_parameter"), "reason": res.reason,
            "advice": res.advice, "max_regret": (res.robust or {}).get("max_regret"),
            "running_max_regret": (first.robust or {}).get("current_max_regret"),
            "explored": None if explored is None else {
                "candidate": explored.candidate.label, "parameter": explored.parameter,
                "regret_at_stake": explored.regret_at_stake, "trial_cost": explored.trial_cost,
                "before_pick": first_pick.label, "before_vs_best": scored[first_pick] / scored[best]},
            "learned": [asdict(x) for x in learned],
            "tune_seconds": secs, "true": asdict(case.true)}


def _replica_workloads(hours: float, seed: int, source: str) -> dict:
    """The cache-affine case's two replicas' loads over the same time (same length)."""
    from moe_eplb_harness.demo.tuning import hot_experts

    chat = replace(synth.get_profile("deepseek-v3-steady"), name="chat-tenant",
                   phases=({"chat": 0.9, "code": 0.05, "math": 0.05},))
    a = hot_experts(synth.generate(chat, hours=hours, seed=seed, source=source), from_second=0.0, experts=4, factor=6.0)
    b = synth.generate("deepseek-v3-flat", hours=hours, seed=seed)
    t = min(a.num_buckets, b.num_buckets)
    return {"a": a.slice(0, t), "b": b.slice(0, t)}


def run_replica_case(name: str, hours: float, seed: int, source: str) -> dict:
    """One shared setting (tuned on the pooled load, as the loop does below the divergence threshold)
    against each replica tuned on its own load (:func:`tune_per_replica`, with the pooled calibration's
    cost model, as the loop does above it), every choice scored with the truth on each replica's own
    second half and summed over the replicas (each serves its share)."""
    case, topology = REPLICA_CASES[name], TOPOLOGY
    running = RUNNING[case.running]
    loads = _replica_workloads(hours, seed, source)
    cut = next(iter(loads.values())).num_buckets // 2
    hist = {r: record(t.slice(0, cut), running, topology["ep_size"], case.true, num_nodes=topology["num_nodes"],
                      num_groups=topology["num_groups"], seed=seed + i) for i, (r, t) in enumerate(loads.items())}
    future = {r: t.slice(cut, t.num_buckets) for r, t in loads.items()}
    a, b = hist.values()
    pooled = record(replace(a, load=(a.load + b.load) / 2, bucket_steps=(a.bucket_steps + b.bucket_steps) // 2,
                            telemetry=None), running, topology["ep_size"], case.true, num_nodes=topology["num_nodes"],
                    num_groups=topology["num_groups"], seed=seed)
    t0 = time.perf_counter()
    cal = calibrate(pooled, num_nodes=topology["num_nodes"], num_groups=topology["num_groups"])
    cost = cal.apply(CostModel())
    shared = tune(pooled, current=running, cost=cost, robust=cal.robustness(), **topology)
    per = tune_per_replica(hist, shared.recommendation, lambda tr: tune(tr, current=running, cost=cost, **topology),
                           lambda tr, k: replay_score(tr, k, cost=cost, **topology))
    secs = time.perf_counter() - t0
    picks = {p.replica: (p.knobs if p.enabled else EPLB_OFF) for p in per.picks} or {r: _pick(shared) for r in hist}
    scorers = {r: true_scorer(future[r], case.true, topology) for r in future}
    grid = list(dict.fromkeys([c.knobs for c in shared.candidates] + [running, VLLM_DEFAULTS, EPLB_OFF,
                                                                      *picks.values()]))
    table = {k: {r: scorers[r](k) for r in future} for k in grid}
    table = {k: v for k, v in table.items() if None not in v.values()}
    total = {k: sum(v.values()) for k, v in table.items()}  # one setting for every replica
    best_shared = max(total, key=total.get)
    best_each = {r: max(table, key=lambda k, r=r: table[k][r]) for r in future}
    best = sum(table[best_each[r]][r] for r in future)
    got = sum(table[picks[r]][r] for r in future)
    label = lambda m: " ".join(f"{r}:{m[r].label}" for r in sorted(m))  # noqa: E731
    sp = _pick(shared)
    return {"case": name, "what": case.what, "running": running.label, "pick": label(picks), "decision": "per replica",
            "mode": "per-replica", "best": label(best_each), "pick_vs_best": got / best,
            "pick_vs_running": got / total[running], "pick_vs_defaults": got / total[VLLM_DEFAULTS],
            "running_vs_best": total[running] / best, "defaults_vs_best": total[VLLM_DEFAULTS] / best,
            "point_pick": f"shared {sp.label}", "point_vs_best": total[sp] / best,
            "best_shared": best_shared.label, "best_shared_vs_best": total[best_shared] / best,
            "pick_vs_best_shared": got / total[best_shared], "divergence_bits": per.divergence,
            "predicted_gain_vs_shared": per.gain, "limiting_parameter": None, "explored": None, "learned": [],
            "reason": f"divergence {per.divergence:.3f} bits; groups {per.groups}", "tune_seconds": secs,
            "true": asdict(case.true)}


def _print_experiments(rows: list[dict]) -> None:
    """Which cases explored, what the trial was, what was learned and where the final decision stands."""
    print(f"\nexperiments (a trial on 1 of {REPLICAS} replicas against the running setting, played from the truth):")
    for r in rows:
        e = r["explored"]
        if e is None:
            continue
        got = "; ".join(f"{x['parameter']} {x['prior_low']:.3g}-{x['prior_high']:.3g} -> {x['low']:.3g}-{x['high']:.3g}"
                        for x in r["learned"]) or "nothing (the arms could not tell)"
        print(f"  {r['case']:<18} trial {e['candidate']} on {e['parameter']} (at stake {e['regret_at_stake']:.2%}, "
              f"trial cost {e['trial_cost']:.2%}); learned: {got}; before {e['before_pick']} "
              f"({e['before_vs_best']:.2%} of best) -> after {r['pick']} ({r['pick_vs_best']:.2%})")
    if not any(r["explored"] for r in rows):
        print("  none")
    for r in rows:
        if r["learned"] and not r["explored"]:
            got = "; ".join(f"{x['parameter']} {x['prior_low']:.3g}-{x['prior_high']:.3g} -> {x['low']:.3g}-{x['high']:.3g}"
                            for x in r["learned"])
            print(f"  {r['case']:<18} measured ({r['learned'][0]['source']}): {got} -> {r['pick']} "
                  f"({r['pick_vs_best']:.2%} of best)")


def _print_worth(rows: list[dict]) -> None:
    """Is EPLB worth it: each case's mode, EPLB off against the best, and the per-replica case."""
    print("\nis EPLB worth it (mode of the pick; EPLB off scored with the truth; what would change the answer):")
    for r in rows:
        if r.get("mode") == "per-replica":
            print(f"  {r['case']:<18} divergence {r['divergence_bits']:.3f} bits: per replica {r['pick']} "
                  f"{r['pick_vs_best_shared']:.2%} of the best single setting {r['best_shared']} and "
                  f"{r['pick_vs_best']:.2%} of the best per replica; the shared pick ({r['point_pick']}) "
                  f"{r['point_vs_best']:.2%}")
            continue
        adv = r.get("advice") or {}
        words = "; ".join(adv.get("what_would_change") or ()) or "-"
        print(f"  {r['case']:<18} {r['mode']:<15} off/best {r['off_vs_best']:.2%}; {words}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=1.0, help="trace length (half recorded and tuned on, half judged)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=sorted(CASES) + sorted(REPLICA_CASES), action="append")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--traces", default=SHARED, help=f"folder with {REAL_FILE} (default {SHARED})")
    args = ap.parse_args()
    path = os.path.join(args.traces, REAL_FILE)
    if not os.path.exists(path):
        print(f"--traces: {path} is missing; point --traces at the folder with the real DeepSeek-V3 statistics")
        return 2
    trace = synth.generate(PROFILE, hours=args.hours, seed=args.seed, source=path)
    print(f"DeepSeek-V3 {PROFILE} from {REAL_FILE}, {trace.num_buckets} buckets of {trace.bucket_seconds:g} s, "
          f"EP {TOPOLOGY['ep_size']} on {TOPOLOGY['num_nodes']} nodes; tuned on the first half, judged on the second")
    header = (f"{'case':<18} {'truth':<56} {'running':<14} {'pick':<14} {'best':<14} {'pick/best':>9} "
              f"{'pick/run':>9} {'pick/def':>9} {'run/best':>9} {'point est.':<14} {'/best':>7}  limiting")
    print(header)
    print("-" * len(header))
    rows, failures = [], []
    workloads = {(PROFILE, True): trace}
    for name in args.only or [*CASES, *REPLICA_CASES]:
        if name in REPLICA_CASES:
            r = run_replica_case(name, args.hours, args.seed, path)
            if r["pick_vs_best_shared"] < 1.0 - 1e-9:
                failures.append(name)  # per-replica settings must beat every one shared setting
        else:
            case = CASES[name]
            key = (case.profile or PROFILE, case.real)
            if key not in workloads:
                workloads[key] = synth.generate(key[0], hours=args.hours, seed=args.seed, source=path if key[1] else None)
            r = run_case(name, workloads[key], args.seed)
        rows.append(r)
        print(f"{name:<18} {r['what']:<56} {r['running']:<14} {r['pick']:<14} {r['best']:<14} "
              f"{r['pick_vs_best']:>9.2%} {r['pick_vs_running']:>9.2%} {r['pick_vs_defaults']:>9.2%} "
              f"{r['running_vs_best']:>9.2%} {r['point_pick']:<14} {r['point_vs_best']:>7.2%}  "
              f"{r['limiting_parameter'] or '-'}", flush=True)
        if r["pick_vs_best"] < 0.97 or r["pick_vs_running"] < 1.0 - 1e-9 or r["pick_vs_defaults"] < 1.0 - 1e-9:
            failures.append(name)
    _print_experiments(rows)
    _print_worth(rows)
    worst = min(r["pick_vs_best"] for r in rows)
    print(f"\nworst pick/best {worst:.2%}; below the running setting: "
          f"{sum(r['pick_vs_running'] < 1 - 1e-9 for r in rows)}; below vLLM's defaults: "
          f"{sum(r['pick_vs_defaults'] < 1 - 1e-9 for r in rows)} of {len(rows)} cases")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1, default=str)
    if failures:
        print(f"FAIL: {', '.join(failures)}")
        return 1
    print("OK: every pick >= 97% of the best under the hidden truth, never below the running setting or vLLM's defaults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
