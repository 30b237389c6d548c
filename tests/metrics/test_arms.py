"""An experiment's arm buckets from the pods' metrics (``moe_eplb.metrics.arms``): vLLM's series
where the pod serves them, the exporter's step histograms otherwise; saturation; TTFT."""

from __future__ import annotations

import pytest

from moe_eplb.api.knobs import Knobs
from moe_eplb.metrics import arms as A


def _body(*, step_sum, steps, tokens, waiting=0.0, kv=0.5, ttft=None, itl=None):
    lines = [
        f'moe_eplb_step_duration_seconds_sum{{model_name="m",rank="0"}} {step_sum}',
        f'moe_eplb_step_duration_seconds_count{{model_name="m",rank="0"}} {steps}',
        f'moe_eplb_step_duration_seconds_sum{{model_name="m",rank="1"}} {step_sum}',
        f'moe_eplb_step_duration_seconds_count{{model_name="m",rank="1"}} {steps}',
        f'moe_eplb_step_tokens_sum{{model_name="m",rank="0"}} {tokens}',
        f'moe_eplb_step_tokens_count{{model_name="m",rank="0"}} {steps}',
        f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}',
        f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}',
        "# HELP something else",
        'moe_eplb_expert_tokens_total{model_name="m",layer="0",expert="0"} 5',
    ]
    if ttft is not None:
        lines += [f'vllm:time_to_first_token_seconds_sum{{model_name="m",engine="0"}} {ttft[0]}',
                  f'vllm:time_to_first_token_seconds_count{{model_name="m",engine="0"}} {ttft[1]}']
    if itl is not None:
        lines += [f'vllm:inter_token_latency_seconds_sum{{model_name="m",engine="0"}} {itl[0]}',
                  f'vllm:inter_token_latency_seconds_count{{model_name="m",engine="0"}} {itl[1]}']
    return "\n".join(lines) + "\n"


def test_counters_sum_over_ranks_and_keep_gauges():
    c = A.counters_from_exposition(_body(step_sum=2.0, steps=100, tokens=6400, waiting=3))
    assert c["moe_eplb_step_duration_seconds_sum"] == 4.0 and c["moe_eplb_step_duration_seconds_count"] == 200
    assert c["vllm:num_requests_waiting"] == 3 and "moe_eplb_expert_tokens_total" not in c


def test_arm_bucket_from_the_exporters_histograms():
    prev = {"p": A.counters_from_exposition(_body(step_sum=1.0, steps=100, tokens=6400))}
    cur = {"p": A.counters_from_exposition(_body(step_sum=3.0, steps=200, tokens=12800, ttft=(2.0, 4)))}
    b = A.arm_bucket(prev, cur, ["p"], gpus_per_replica=4)
    assert b.step_seconds == pytest.approx(0.02) and b.tokens_per_step == pytest.approx(64)
    assert b.tokens_per_second_per_gpu == pytest.approx(64 / 0.02 / 4)
    assert not b.saturated and b.ttft_seconds is None  # TTFT needs both rounds
    assert A.arm_bucket(prev, cur, ["other"], gpus_per_replica=4) is None


def test_vllms_inter_token_latency_wins_and_saturation():
    prev = {"p": A.counters_from_exposition(_body(step_sum=1.0, steps=100, tokens=6400, itl=(1.0, 100), ttft=(1, 1)))}
    cur = {"p": A.counters_from_exposition(_body(step_sum=3.0, steps=200, tokens=12800, itl=(4.0, 200), waiting=2,
                                                 ttft=(3, 3)))}
    b = A.arm_bucket(prev, cur, ["p"], gpus_per_replica=1)
    assert b.step_seconds == pytest.approx(0.03) and b.saturated and b.ttft_seconds == pytest.approx(1.0)


def test_tracker_pairs_rounds_and_builds_observations():
    t = A.ArmTracker(started_at=0.0)
    r0 = {n: A.counters_from_exposition(_body(step_sum=1.0, steps=100, tokens=6400)) for n in ("t", "c")}
    r1 = {"t": A.counters_from_exposition(_body(step_sum=2.8, steps=200, tokens=12800)),
          "c": A.counters_from_exposition(_body(step_sum=3.0, steps=200, tokens=12800))}
    assert t.bucket(0.0, r0, ["t"], ["c"], gpus_per_replica=1) is None  # the first round
    trial, control = t.bucket(60.0, r1, ["t"], ["c"], gpus_per_replica=1)
    assert trial.step_seconds < control.step_seconds
    obs = A.observation(Knobs(1, 2, 0), t.trial, pods=1, seconds=60.0)
    assert obs.step_seconds == pytest.approx(trial.step_seconds) and obs.knobs == Knobs(1, 2, 0)


def _ranks(tokens: dict[tuple[int, int], float]) -> str:
    return "".join(f'moe_eplb_rank_tokens_total{{model_name="m",layer="{lay}",rank="{r}"}} {v}\n'
                   for (lay, r), v in tokens.items())


def test_served_balancedness_is_vllms_mean_over_max_per_layer_over_the_bucket():
    """Per layer mean/max of the tokens each EP rank took in the bucket, averaged over the layers; a
    counter that went back (a restart) gives none; the arm's observation carries the mean."""
    before = A.counters_from_exposition(_ranks({(0, 0): 100, (0, 1): 100, (1, 0): 50, (1, 1): 50}))
    after = A.counters_from_exposition(_ranks({(0, 0): 140, (0, 1): 120, (1, 0): 80, (1, 1): 80}))
    assert before["rank_tokens/0/1"] == 100
    # layer 0: deltas 40, 20 -> 30/40 = 0.75; layer 1: 30, 30 -> 1.0
    assert A.served_balancedness(before, after) == pytest.approx((0.75 + 1.0) / 2)
    # the cost model's served imbalance: busiest ranks over mean ranks, summed over the layers
    # ((40 + 30) / (30 + 30)), more than 1 / balancedness (1 / 0.875)
    assert A.served_imbalance(before, after) == pytest.approx(70 / 60)
    assert A.served_imbalance(before, after) > 1 / A.served_balancedness(before, after)
    restarted = A.counters_from_exposition(_ranks({(0, 0): 10, (0, 1): 10, (1, 0): 5, (1, 1): 5}))
    assert A.served_balancedness(after, restarted) is None
    assert A.served_imbalance(after, restarted) is None and A.served_imbalance({}, after) is None
    assert A.served_balancedness({}, after) is None
    prev = {"p": A.counters_from_exposition(_body(step_sum=1.0, steps=100, tokens=6400) + _ranks({(0, 0): 0, (0, 1): 0}))}
    cur = {"p": A.counters_from_exposition(_body(step_sum=2.0, steps=200, tokens=12800) + _ranks({(0, 0): 60, (0, 1): 20}))}
    b = A.arm_bucket(prev, cur, ["p"], gpus_per_replica=2)
    assert b is not None and b.balancedness == pytest.approx(40 / 60) and b.imbalance == pytest.approx(60 / 40)
    obs = A.observation(Knobs(100, 1000, 0), [b, b], pods=1, seconds=60.0)
    assert obs.balancedness == pytest.approx(40 / 60) and obs.imbalance == pytest.approx(60 / 40)
