"""The autotune loop's per-replica step on real parts: the load observer reads each replica's own load
from its scrape rounds (the reader's direct path, the operator's own scraper), the loop measures their
divergence (the operator's gauge) and, above the threshold, tunes each replica on its own load against
the shared pick (AutotuneLoop.per_replica; no cluster: the rounds stand for two engine pods' /metrics)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
import yaml
from prometheus_client import REGISTRY

from moe_eplb.api.spec import parse
from moe_eplb.controller.autotune import AutotuneLoop, run_tuner
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.eplb.workload.trace import LoadTrace
from tests.example_manifests import EXAMPLES
from tests.metrics.rounds import scrape_rounds

T, STEPS, B = 40, 250, 15.0


def test_per_replica_reads_each_replicas_load_and_tunes_it_on_its_own():
    doc = copy.deepcopy(yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-autotune.yaml").read_text()))
    doc["spec"]["replicas"] = 2
    doc["metadata"]["namespace"] = "per-replica"
    doc["spec"]["monitoring"] = {}  # no Prometheus: the operator's own scrapes of the pods
    inf = parse(doc)
    L, E = inf.moe_shape.num_moe_layers, inf.moe_shape.num_experts
    rng = np.random.default_rng(1)
    hot = rng.dirichlet(np.full(E, 0.08), size=L)  # a tenant on few experts
    even = np.full((L, E), 1.0 / E)  # broad traffic
    tokens = STEPS * 64 * 8
    loads = {"p0": rng.poisson(hot[None] * tokens, (T, L, E)).astype(float),
             "p1": rng.poisson(even[None] * tokens, (T, L, E)).astype(float)}
    loop = AutotuneLoop(host=None, settings=AutotuneSettings())
    t0 = 1_800_000_000.0
    loop.load_observer.direct(inf).scraper.rounds = scrape_rounds(loads, T, steps=STEPS, t0=t0, bucket_seconds=B)
    pods = [{"metadata": {"name": n}} for n in loads]
    end = t0 + B * T
    pooled = LoadTrace(load=(loads["p0"] + loads["p1"]) / 2, bucket_steps=np.full(T, STEPS), bucket_seconds=B, top_k=8)
    shared = run_tuner(pooled, inf, inf.effective.knobs, dataclasses.replace(loop.settings.search, min_steps=1))
    per = asyncio.run(loop.per_replica(inf, end - B * T, end, pods, shared))
    assert per is not None and per.divergence > per.threshold and per.tuned
    assert {p.replica for p in per.picks} == {"p0", "p1"} and per.gain >= 0.0
    labels = {"namespace": "per-replica", "name": inf.name}
    assert REGISTRY.get_sample_value("moe_eplb_replica_load_divergence_bits", labels) == per.divergence
    # one replica only: no divergence, and the gauge is removed
    loop.load_observer.direct(inf).scraper.rounds = scrape_rounds({"p0": loads["p0"]}, T, steps=STEPS, t0=t0, bucket_seconds=B)
    assert asyncio.run(loop.per_replica(inf, end - B * T, end, pods[:1], shared)) is None
    assert REGISTRY.get_sample_value("moe_eplb_replica_load_divergence_bits", labels) is None
