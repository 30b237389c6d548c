"""The load reader gives the same trace from one L x E copy per replica group (the leader's merged
counter, :mod:`moe_eplb.exporter.group`) as from every pod's own copy, for the same load: by the
pods' scrape route (``trace_from_scraped_rounds``) and from the raw samples Prometheus would hold
(``trace_from_raw_counters``), through a worker's restart and a restart of the whole group (the
leader with it). Both layouts are the real collectors' ``/metrics`` bodies, parsed as the reader
parses them."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.group import GroupMerge, GroupRole, WorkerTotals, decode
from moe_eplb.exporter.server import make_registry
from moe_eplb.metrics.assemble import counters_from_rounds, group_pods_from_rounds, trace_from_raw_counters
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.reader import trace_from_scraped_rounds
from moe_eplb.metrics.scrape import PodSample, Round, parse_exposition

L, E, EP, PODS = 3, 4, 8, 4
RANKS = EP // PODS


class Pod:
    """One pod's workers (two EP ranks), writing snapshot files as the recorder does."""

    def __init__(self, root, w: int, start: float):
        self.dir = root / f"pod{w}"
        self.dir.mkdir(exist_ok=True)
        self.w = w
        self.restart(start)

    def restart(self, start: float) -> None:
        self.start = start
        self.tokens = np.zeros((RANKS, L, E))
        self.ranks = np.zeros((RANKS, L, EP))
        self.steps = 0
        for f in self.dir.iterdir():
            f.unlink()

    def run(self, load: np.ndarray, steps: int) -> None:  # load [RANKS, L, E]
        self.tokens += load
        self.ranks[:, :, :] += load.sum(axis=2, keepdims=True) / EP
        self.steps += steps
        for i in range(RANKS):
            r = self.w * RANKS + i
            snap.write(str(self.dir), snap.WorkerSnapshot(pid=10_000 * (self.w + 1) + i, time=0.0, models=[
                snap.ModelSnapshot(name="m", ep_rank=r, ep_size=EP, expert_tokens=self.tokens[i].copy(),
                                   rank_tokens=self.ranks[i].copy(), replicas=np.ones((L, E), np.int64),
                                   steps=self.steps, rearrangements=0, duration_sum=0.0, window_size=10,
                                   step_interval=30, num_redundant_experts=0, use_async=False,
                                   start_time=self.start)]))


def _labels(w: int) -> tuple:
    return tuple(sorted({metric_names.MOEINFERENCE_LABEL: "ds", metric_names.GROUP_LABEL: "0",
                         metric_names.GROUP_WORKER_LABEL: str(w), metric_names.GROUP_SIZE_LABEL: str(PODS)}.items()))


def _round(t: float, bodies: dict[str, bytes]) -> Round:
    pods: dict[str, PodSample] = {n: parse_exposition(b.decode()) for n, b in bodies.items()}
    rnd = Round(t, pods, {n: _labels(int(n.rsplit("-", 1)[1])) for n in bodies})
    rnd.bodies = bodies  # the /metrics bodies themselves (the real-Prometheus test backfills them)
    return rnd


def simulate(tmp_path, *, worker_restart: int | None = 6, leader_restart: int | None = 9,
             group_restart: int | None = 12, rounds: int = 20):
    """Both layouts' scrape rounds (every 5 s) of one group of 4 pods under the same random load: a
    worker restarts alone, the leader restarts alone (vLLM fault tolerance keeps the workers
    serving), then LeaderWorkerSet recreates the whole group."""
    rng = np.random.default_rng(7)
    pods = [Pod(tmp_path, w, start=1000.0 - w) for w in range(PODS)]  # workers' counters start first
    answer = {p.w: WorkerTotals(PodCollector(str(p.dir), "full").own) for p in pods[1:]}
    merge = GroupMerge(start_time=pods[0].start)
    old, new = [], []
    for k in range(rounds):
        t = 1000.0 + 5.0 * (k + 1)
        if k == worker_restart:  # a new worker process: new counters, a new answerer
            pods[2].restart(t - 1.0)
            answer[2] = WorkerTotals(PodCollector(str(pods[2].dir), "full").own)
        if k == leader_restart:
            pods[0].restart(t - 1.0)
            merge = GroupMerge(start_time=pods[0].start)
        fresh_group = k == group_restart
        if fresh_group:  # every pod's counters start again
            for p in pods:
                p.restart(t - 2.0 + (0.5 if p.w == 0 else 0.0))  # the leader's process starts last
            answer = {p.w: WorkerTotals(PodCollector(str(p.dir), "full").own) for p in pods[1:]}
            merge = GroupMerge(start_time=pods[0].start)
        for p in pods:
            p.run(rng.integers(0, 50, (RANKS, L, E)).astype(float), 3)
        roles = [GroupRole("leader", 0, PODS, ("-",) * (PODS - 1))] + [GroupRole("worker", w, PODS)
                                                                         for w in range(1, PODS)]
        for p in pods[1:]:  # the leader's fetch of each worker's totals (its PeerPoller)
            merge.update(p.w, decode(answer[p.w].answer(merge.leader_id)))
        collectors = [PodCollector(str(p.dir), "full", role=roles[p.w], merge=merge if p.w == 0 else None)
                      for p in pods]
        new.append(_round(t, {f"ds-0-{p.w}": generate_latest(make_registry(collectors[p.w])) for p in pods}))
        old.append(_round(t, {f"ds-0-{p.w}": generate_latest(make_registry(PodCollector(str(p.dir), "full")))
                              for p in pods}))
    return old, new


@pytest.mark.parametrize("restarts", [{}, {"worker_restart": None, "leader_restart": None, "group_restart": None}])
def test_same_trace_from_the_group_layout_as_from_every_pods_copy(tmp_path, restarts):
    old, new = simulate(tmp_path, **restarts)
    grid = np.arange(1000.0, 1101.0, 10.0)
    a = trace_from_scraped_rounds(old, grid, pods_per_engine=PODS)
    b = trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
    np.testing.assert_array_equal(a.load, b.load)
    np.testing.assert_array_equal(a.bucket_steps, b.bucket_steps)
    assert a.load.sum() > 0 and a.load.shape == (10, L, E)
    assert a.telemetry is not None and b.telemetry is not None
    np.testing.assert_array_equal(a.telemetry.rank_load, b.telemetry.rank_load)
    # the raw samples Prometheus would hold, with its scrape-gap rule
    (ta, sa, st_a), (tb, sb, st_b) = counters_from_rounds(old), counters_from_rounds(new)
    assert len(tb) == len(ta) // PODS, "one L x E copy per group"
    ra = trace_from_raw_counters(ta, sa, grid, start_times=st_a, pods_per_engine=PODS)
    rb = trace_from_raw_counters(tb, sb, grid, start_times=st_b, pods_per_engine=PODS,
                                 group_pods=group_pods_from_rounds(new))
    np.testing.assert_array_equal(ra.load, rb.load)
    np.testing.assert_array_equal(ra.bucket_steps, rb.bucket_steps)
    np.testing.assert_array_equal(ra.load, a.load)


def test_the_total_is_the_load_routed_once_through_restarts(tmp_path):
    old, new = simulate(tmp_path)
    grid = np.arange(1005.0, 1106.0, 10.0)  # the first round (t=1005) is the baseline
    b = trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
    rng = np.random.default_rng(7)  # the load simulate() routed, drawn again in the same order
    per_round = [sum(rng.integers(0, 50, (RANKS, L, E)).sum() for _ in range(PODS)) for k in range(20)]
    total = sum(per_round[1:])
    assert b.load.sum() == total, "every token once: no gap, no double count across the restarts"


def test_a_group_without_its_leaders_series_is_refused(tmp_path):
    _, new = simulate(tmp_path, rounds=4, worker_restart=None, leader_restart=None, group_restart=None)
    for r in new:
        del r.pods["ds-0-0"]
    grid = np.arange(1000.0, 1021.0, 10.0)
    with pytest.raises(LoadReadError) as exc:
        trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
    assert exc.value.reason == "IncompleteGroup"


def test_a_leader_that_does_not_hold_every_pod_is_refused(tmp_path):
    _, new = simulate(tmp_path, rounds=4, worker_restart=None, leader_restart=None, group_restart=None)
    grid = np.arange(1000.0, 1021.0, 10.0)
    assert trace_from_scraped_rounds(new, grid, pods_per_engine=PODS).load.sum() > 0
    new[-1].pods["ds-0-0"].group_pods["m"] = PODS - 1.0  # the leader cannot reach a worker
    with pytest.raises(LoadReadError, match="for 3 of its 4 pods") as exc:
        trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
    assert exc.value.reason == "IncompleteGroup"
    for r in new:  # a leader without the group gauge (grouping off on that pod)
        r.pods["ds-0-0"].group_pods.clear()
    with pytest.raises(LoadReadError, match="for 0 of its 4 pods"):
        trace_from_scraped_rounds(new, grid, pods_per_engine=PODS)
