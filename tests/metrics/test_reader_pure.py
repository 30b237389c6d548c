"""The load reader's pure parts: exact increments, Prometheus bodies -> trace, scrape rounds -> trace."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb.metrics.assemble import (
    counters_from_rounds,
    trace_from_raw_counters,
)
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.grid import grid_for
from moe_eplb.metrics.increments import counter_increments
from moe_eplb.metrics.reader import selector, trace_from_scraped_rounds
from moe_eplb.metrics.scrape import (
    PodSample,
    Round,
    parse_exposition,
    pod_labels,
    targets_from_pods,
)
from moe_eplb.metrics.series import parse_matrix
from moe_eplb.metrics.telemetry_keys import series_from_rounds

GRID = np.array([100.0, 115.0, 130.0, 145.0])


def sample_increments(grid, ts, vs, start_times=None, max_gap=None):
    """Increments of one counter: the first row of :func:`counter_increments`."""
    return counter_increments(grid, ts, np.asarray(vs, np.float64)[None, :], start_times, max_gap=max_gap).values[0]


@pytest.mark.parametrize("ts,vs,starts,expected", [
    ([95, 104, 110, 120, 131], [0, 5, 7, 7, 9], None, [7, 0, 2]),  # plain; 95 is the baseline
    ([95, 110, 125, 140], [10, 12, 3, 4], None, [2, 3, 1]),  # value dropped: restart
    ([95, 110, 125, 140], [10, 12, 13, 15], [1, 1, 2, 2], [2, 13, 2]),  # restart seen by start time
    ([120, 140], [4, 6], [118, 118], [0, 4, 2]),  # pod joined at 118: counts from 0
    ([120, 140], [4, 6], [50, 50], [0, 0, 2]),  # first seen late but started long ago: baseline
    ([95, 110, 112], [1, 2, 9], None, [8, 0, 0]),  # pod left after 112: last samples still counted
    ([145, 150], [1, 2], None, [0, 0, 1]),  # 150 is after the last bucket: ignored
])
def test_sample_increments(ts, vs, starts, expected):
    out = sample_increments(GRID, np.array(ts, float), np.array(vs, float),
                            None if starts is None else np.array(starts, float))
    np.testing.assert_array_equal(out, expected)


def test_a_scrape_gap_is_spread_over_its_buckets_by_time():
    # 101 -> 140 (39 s > max_gap 20): the 5 tokens of the gap go 14 : 15 : 10 to the three buckets
    inc = counter_increments(GRID, np.array([96.0, 101, 140]), np.array([[1.0, 2, 7]]), max_gap=20)
    np.testing.assert_allclose(inc.values[0], [1 + 5 * 14 / 39, 5 * 15 / 39, 5 * 10 / 39], rtol=1e-12)
    np.testing.assert_allclose(inc.interpolated[0], [5 * 14 / 39, 5 * 15 / 39, 5 * 10 / 39], rtol=1e-12)
    assert inc.values.sum() == pytest.approx(6, rel=1e-12) and inc.gaps == ((101.0, 140.0),)
    # without max_gap the old exact rule: everything in the later sample's bucket
    np.testing.assert_array_equal(sample_increments(GRID, np.array([96.0, 101, 140]), np.array([1.0, 2, 7])),
                                  [1, 0, 5])
    # a gap that starts before the window: only its part inside the window counts (8 of 38 s)
    np.testing.assert_allclose(sample_increments(GRID, np.array([70.0, 108, 120]), np.array([0.0, 38, 50]),
                                                 max_gap=20), [8, 12, 0], rtol=1e-12)
    # a gap with no load in it changes nothing
    inc = counter_increments(GRID, np.array([96.0, 101, 140]), np.array([[1.0, 2, 2]]), max_gap=20)
    np.testing.assert_array_equal(inc.values[0], [1, 0, 0])
    assert not inc.interpolated.any()
    # a restart inside the gap keeps the restart rule (new value, later sample's bucket), per counter
    inc = counter_increments(GRID, np.array([96.0, 101, 140]), np.array([[5.0, 6, 3], [5.0, 6, 9]]),
                             np.array([1.0, 1, 2]), max_gap=20)
    np.testing.assert_array_equal(inc.values, [[1, 0, 3], [1, 0, 9]])
    assert not inc.interpolated.any()
    inc = counter_increments(GRID, np.array([96.0, 101, 140]), np.array([[5.0, 6, 3], [5.0, 6, 9]]), max_gap=20)
    np.testing.assert_allclose(inc.values, [[1, 0, 3], [1 + 3 * 14 / 39, 3 * 15 / 39, 3 * 10 / 39]], rtol=1e-12)


def _body(series):
    """The series of a Prometheus matrix answer holding ``series`` = [(labels, [(t, v), ...])]."""
    return parse_matrix({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": m, "values": [[t, str(v)] for t, v in pts if v is not None]} for m, pts in series]}}, "test")


TS = [98.0, 112.0, 127.0, 141.0]  # scrape times: one baseline, then one per bucket


def _pod(pod, model="m"):
    return {"__name__": "x", "namespace": "ns", metric_names.MOEINFERENCE_LABEL: "moe", "pod": pod, metric_names.LABEL_MODEL: model}


def _expert_series(pod, layer, expert, values, model="m", ts=TS):
    m = dict(_pod(pod, model), layer=str(layer), expert=str(expert))
    return m, list(zip(ts, values))


def test_raw_counters_to_trace_exact_with_restart_and_join():
    experts = []
    for l in range(2):  # pod a: restarts between t=127 and t=141 (start time 50 -> 135)
        for e in range(2):
            base = 10 * (l * 2 + e + 1)
            experts.append(_expert_series("a", l, e, [base, base + 1, base + 3, base + 5]))
    for l in range(2):  # pod b joins at 120
        for e in range(2):
            experts.append(_expert_series("b", l, e, [5, 6], ts=TS[2:]))
    steps = [(_pod("a"), list(zip(TS, [50, 60, 80, 4]))), (_pod("b"), list(zip(TS[2:], [20, 24])))]
    starts = [(_pod("a"), list(zip(TS, [50, 50, 50, 135]))), (_pod("b"), list(zip(TS[2:], [120, 120])))]
    tr = trace_from_raw_counters(_body(experts), _body(steps), GRID, start_times=_body(starts))
    np.testing.assert_array_equal(tr.load[:, 0, 0], [1, 2 + 5, 15 + 1])
    np.testing.assert_array_equal(tr.load[:, 1, 1], [1, 2 + 5, 45 + 1])
    np.testing.assert_array_equal(tr.bucket_steps, [10, 20 + 20, 4 + 4])
    assert tr.bucket_seconds == 15 and tr.model == "m"
    # one engine over two pods: steps counted once
    tr2 = trace_from_raw_counters(_body(experts), _body(steps), GRID, pods_per_engine=2, start_times=_body(starts))
    assert tr2.bucket_steps.tolist() == [5, 20, 4]


@pytest.mark.parametrize("experts,steps,reason,match", [
    ([], [], "NoData", "no moe_eplb_"),
    ([_expert_series("a", 0, 0, [1, 2, 3, 4])], [], "InconsistentSeries", "engine_steps"),
    ([_expert_series("a", 0, 0, [1, 2, 3, 4])], [(_pod("a"), [(90.0, 1)])], "InsufficientData", "no samples"),
    ([_expert_series("a", 0, 0, [1, 4], ts=[98.0, 141.0])],  # mostly missing: all load in one gap
     [(_pod("a"), [(98.0, 1), (141.0, 4)])], "ScrapeGaps",
     r"100% of the load .* fell in scrape gaps \(allowed: 10%\).*pod a: no samples between t=98.000 and "
     r"t=141.000 \(43.0s\)"),
    ([_expert_series("a", 0, 0, [1, 2, 3, 4]), _expert_series("a", 2, 0, [1, 2, 3, 4])],
     [(_pod("a"), list(zip(TS, [1, 2, 3, 4])))], "InconsistentSeries", "layer"),
    ([_expert_series("a", 0, 0, [1, 2, 3, 4]), _expert_series("a", 0, 1, [1, 2, 3, 4], model="mtp")],
     [(_pod("a"), list(zip(TS, [1, 2, 3, 4]))), (_pod("a", "mtp"), list(zip(TS, [1, 2, 3, 4])))],
     "InconsistentSeries", "2 models"),
    ([_expert_series("z", 0, 0, [1, 2, 3, 4])], [(_pod("a"), list(zip(TS, [1, 2, 3, 4])))],
     "InconsistentSeries", "no matching"),
])
def test_raw_counters_errors(experts, steps, reason, match):
    with pytest.raises(LoadReadError, match=match) as ei:
        trace_from_raw_counters(_body(experts), _body(steps), GRID)
    assert ei.value.reason == reason


def test_the_main_model_is_picked_next_to_an_mtp_drafter():
    experts = [_expert_series("a", l, e, [1, 2, 3, 4]) for l in range(2) for e in range(3)]
    experts.append(_expert_series("a", 0, 0, [5, 6, 7, 8], model="mtp"))
    steps = [(_pod("a"), list(zip(TS, [1, 2, 3, 4]))), (_pod("a", "mtp"), list(zip(TS, [1, 2, 3, 4])))]
    tr = trace_from_raw_counters(_body(experts), _body(steps), GRID, num_layers=2, num_experts=3)
    assert tr.model == "m" and tr.load.shape == (3, 2, 3) and tr.load.sum() == 6 * 3
    with pytest.raises(LoadReadError, match=r"m \(2x3\), mtp \(1x1\)"):
        trace_from_raw_counters(_body(experts), _body(steps), GRID)


def test_grid_and_selector():
    g = grid_for(1000.7, 60, 15)
    assert g.tolist() == [930, 945, 960, 975, 990]
    with pytest.raises(LoadReadError) as ei:
        grid_for(1000, 10, 15)
    assert ei.value.reason == "InsufficientData"
    assert selector("ns", 'a"b', "m") == '{namespace="ns", moeinference="a\\"b", model_name="m"}'


def _round(t, pods):
    return Round(time=t, pods={p: PodSample(start_time={"m": st}, steps={"m": steps},
                                            tokens={"m": {(l, e): float(v[l][e]) for l in range(len(v)) for e in range(len(v[0]))}})
                               for p, (st, steps, v) in pods.items()})


def test_rounds_to_trace_reset_join_leave():
    """The operator's direct read (:func:`trace_from_scraped_rounds`, what ``read_load_trace`` does
    with its scraper's rounds): a pod that restarted counts from 0, one that joined since the last
    round from 0, one first seen late that started long ago from its first value, one that left is
    no longer counted."""
    r0 = _round(100, {"a": (50, 10, [[1, 2]]), "old": (40, 5, [[9, 9]])})
    r1 = _round(110, {"a": (50, 20, [[3, 5]]), "new": (105, 4, [[1, 1]])})  # old left, new joined
    r2 = _round(120, {"a": (115, 2, [[1, 1]]), "new": (105, 8, [[2, 3]]), "seen_late": (60, 99, [[7, 7]])})
    tr = trace_from_scraped_rounds([r0, r1, r2], grid_for(120, 20, 10))
    np.testing.assert_array_equal(tr.load[:, 0, :], [[2 + 1, 3 + 1], [1 + 1, 1 + 2]])
    np.testing.assert_array_equal(tr.bucket_steps, [10 + 4, 2 + 4])
    assert tr.meta["start_time"] == 100 and tr.bucket_seconds == 10 and tr.meta["engines"] == [2.0, 2.0]
    assert tr.meta["read"] == "scraped the pods directly: 3 round(s), at most 10.0s apart"
    with pytest.raises(LoadReadError) as ei:  # nothing scraped inside the window yet
        trace_from_scraped_rounds([r0], grid_for(110, 10, 10))
    assert ei.value.reason == "InsufficientData"


def test_rounds_read_on_a_grid_like_prometheus_samples():
    """The operator's direct read: rounds as raw samples on a fixed grid (bucket k holds the rounds in
    (grid[k], grid[k+1]]), the same reset / join / leave rules as the old differencing."""
    r0 = _round(100, {"a": (50, 10, [[1, 2]]), "old": (40, 5, [[9, 9]])})
    r1 = _round(110, {"a": (50, 20, [[3, 5]]), "new": (105, 4, [[1, 1]])})  # old left, new joined
    r2 = _round(120, {"a": (115, 2, [[1, 1]]), "new": (105, 8, [[2, 3]]), "seen_late": (60, 99, [[7, 7]])})
    tokens, steps, starts = counters_from_rounds([r0, r1, r2])
    tr = trace_from_raw_counters(tokens, steps, np.array([100.0, 110.0, 120.0]), start_times=starts)
    np.testing.assert_array_equal(tr.load[:, 0, :], [[2 + 1, 3 + 1], [1 + 1, 1 + 2]])
    np.testing.assert_array_equal(tr.bucket_steps, [10 + 4, 2 + 4])
    # two rounds per bucket sum into it; the grid, not the rounds, sets the bucket length
    rs = [_round(t, {"a": (50, 10 + t - 100, [[t - 100, 0]])}) for t in (100, 105, 110, 115, 120)]
    tr = trace_from_raw_counters(*counters_from_rounds(rs)[:2], np.array([100.0, 110.0, 120.0]))
    assert tr.bucket_seconds == 10.0 and tr.bucket_steps.tolist() == [10, 10]
    # a late round of the operator's own: its load in its bucket, nothing spread or refused
    late = [_round(t, {"a": (50, v, [[v, 0]])}) for t, v in ((100, 0), (102, 2), (104, 4), (106, 6), (128, 30))]
    tr = trace_from_raw_counters(*counters_from_rounds(late)[:2], np.array([100.0, 110.0, 120.0, 130.0]),
                                 spread_gaps=False)
    assert tr.bucket_steps.tolist() == [6, 0, 24] and tr.meta["interpolated_fraction"] == 0.0
    with pytest.raises(LoadReadError) as ei:  # the same samples from Prometheus: a scrape gap
        trace_from_raw_counters(*counters_from_rounds(late)[:2], np.array([100.0, 110.0, 120.0, 130.0]))
    assert ei.value.reason == "ScrapeGaps"


def test_rounds_of_a_leaderworkerset_group_are_joined_and_an_absent_pod_refused():
    """The pods of a group carry the group labels a PodMonitor would copy (targets_from_pods): their
    load is summed, their steps counted once; a group whose worker never answered is refused."""
    group = {"leader": (("group_size", "2"), ("group_worker", "0"), ("replica_group", "0")),
             "worker": (("group_size", "2"), ("group_worker", "1"), ("replica_group", "0"))}

    def rnd(t, pods):
        r = _round(t, pods)
        r.labels.update({p: group[p] for p in pods})
        return r

    rounds = [rnd(100, {"leader": (50, 0, [[0, 0]]), "worker": (50, 0, [[0, 0]])}),
              rnd(110, {"leader": (50, 7, [[1, 2]]), "worker": (50, 7, [[3, 4]])})]
    tr = trace_from_raw_counters(*counters_from_rounds(rounds)[:2], np.array([100.0, 110.0]), pods_per_engine=2)
    np.testing.assert_array_equal(tr.load[0, 0], [4, 6])
    assert tr.bucket_steps.tolist() == [7]
    lonely = [rnd(100, {"leader": (50, 0, [[0, 0]])}), rnd(110, {"leader": (50, 7, [[1, 2]])})]
    with pytest.raises(LoadReadError) as ei:
        trace_from_raw_counters(*counters_from_rounds(lonely)[:2], np.array([100.0, 110.0]), pods_per_engine=2)
    assert ei.value.reason == "IncompleteGroup" and "worker 1" in ei.value.message


def test_parse_exposition_reads_only_what_it_needs_and_refuses_broken_lines():
    text = ("# HELP x y\n# TYPE moe_eplb_engine_steps counter\n"
            'moe_eplb_engine_steps_total{model_name="m\\"q"} 12 1700000000000\n'
            'moe_eplb_expert_replicas{model_name="m",layer="0",expert="0"} garbage and more\n'
            'moe_eplb_expert_tokens_total{model_name="m",layer="1",expert="2",} 3.5\n')
    s = parse_exposition(text)
    assert s.steps == {'m"q': 12.0} and s.tokens == {"m": {(1, 2): 3.5}}
    with pytest.raises(ValueError, match="line 2"):
        parse_exposition('moe_eplb_engine_steps_total{model_name="m"} 1\nmoe_eplb_engine_steps_total{model_name="m"}\n')


def test_targets_from_pods():
    def pod(name, ip, phase="Running", port_name=k8s_names.EXPORTER_PORT_NAME, label="moe"):
        return {"metadata": {"name": name, "labels": {k8s_names.NAME_LABEL: label}},
                "status": {"phase": phase, "podIP": ip},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000},
                                                   {"name": port_name, "containerPort": 9400}]}]}}

    pods = [pod("a", "10.0.0.1"), pod("b", "10.0.0.2", phase="Pending"), pod("c", "10.0.0.3", port_name="x"),
            pod("d", "10.0.0.4", label="other"), pod("e", "fd00::1")]
    ts = targets_from_pods(pods, "moe")
    assert [(t.pod, t.url) for t in ts] == [("a", "http://10.0.0.1:9400/metrics"), ("e", "http://[fd00::1]:9400/metrics")]
    assert ts[0].labels == (("moeinference", "moe"),)
    lws = {"metadata": {"labels": {k8s_names.NAME_LABEL: "ds", k8s_names.LWS_GROUP_INDEX_LABEL: "3",
                                   k8s_names.LWS_WORKER_INDEX_LABEL: "1"},
                        "annotations": {k8s_names.LWS_SIZE_ANNOTATION: "4"}}}
    assert dict(pod_labels(lws)) == {"moeinference": "ds", "replica_group": "3", "group_worker": "1", "group_size": "4"}


def test_parse_exposition_roundtrip_with_the_collector():
    from prometheus_client.exposition import generate_latest

    from moe_eplb.exporter import snapshot as snap
    from moe_eplb.exporter.collector import aggregate, families
    from moe_eplb.exporter.server import make_registry

    m = snap.ModelSnapshot(name="m", ep_rank=0, ep_size=1, expert_tokens=np.array([[1.0, 2.0], [3.0, 4.0]]),
                           rank_tokens=np.ones((2, 1)), replicas=np.ones((2, 2), np.int64), steps=7, start_time=12.5)
    pm = aggregate([snap.WorkerSnapshot(pid=1, time=0, models=[m])])

    class C:
        def collect(self):
            return families(pm)

    s = parse_exposition(generate_latest(make_registry(C())).decode())
    assert s.tokens["m"] == {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 3.0, (1, 1): 4.0}
    assert s.steps == {"m": 7.0} and s.start_time == {"m": 12.5}


GRID6 = np.arange(100.0, 191.0, 15.0)  # 6 buckets of 15 s


def test_a_dropped_scrape_is_spread_over_the_buckets_it_spans():
    """Known load, scraped every 5 s; pod a misses the scrapes at 115..140 (a 35 s gap over three
    buckets), pod b misses none. Totals stay exact; pod a's gap load is split 5 : 15 : 15 by time,
    steps and tokens alike; the share of spread load is reported, and refused above the threshold."""
    rng = np.random.default_rng(7)
    L_, E_ = 2, 3
    ts = np.arange(95.0, 191.0, 5.0)  # baseline at 95, then 19 scrapes
    n = ts.size - 1
    per_step = {"a": rng.integers(1, 5, size=(L_, E_)), "b": rng.integers(1, 5, size=(L_, E_))}
    steps = {"a": rng.integers(2, 9, size=n), "b": rng.integers(2, 9, size=n)}
    dropped = (ts > 112) & (ts < 143)  # samples at 115, 120, ..., 140 -> gap 110 -> 145
    in_gap = dropped[1:] | (ts[1:] == 145)  # the 7 scrape intervals in (110, 145]
    steps["a"][in_gap] = 10  # 70 steps in the gap: split 10 / 30 / 30
    experts, step_body = [], []
    expected_load = np.zeros((6, L_, E_))
    expected_steps = np.zeros(6)
    for p in ("a", "b"):
        keep = ~dropped if p == "a" else np.ones(ts.size, bool)
        cum_steps = np.concatenate([[100], 100 + np.cumsum(steps[p])])
        for l in range(L_):
            for e in range(E_):
                vals = 1000 + cum_steps * per_step[p][l, e]
                experts.append(_expert_series(p, l, e, vals[keep].tolist(), ts=ts[keep].tolist()))
        step_body.append((_pod(p), list(zip(ts[keep].tolist(), cum_steps[keep].tolist()))))
        b = np.searchsorted(GRID6, ts[1:], side="left") - 1  # bucket of each interval's end
        for i in np.flatnonzero(b >= 0):  # 95 -> 100 is before the window
            expected_steps[b[i]] += steps[p][i]
            expected_load[b[i]] += steps[p][i] * per_step[p]
    gap_steps = 70
    # what pod a did in (110, 145] goes 5/35, 15/35, 15/35 to buckets 0, 1, 2 instead of by scrape
    exact_a = np.zeros(6)
    for i in np.flatnonzero(in_gap):
        exact_a[np.searchsorted(GRID6, ts[i + 1]) - 1] += steps["a"][i]
    spread_a = np.array([10, 30, 30, 0, 0, 0])
    expected_steps += spread_a - exact_a
    expected_load += (spread_a - exact_a)[:, None, None] * per_step["a"][None]

    tr = trace_from_raw_counters(_body(experts), _body(step_body), GRID6, max_interpolated_fraction=0.5)
    np.testing.assert_allclose(tr.load, expected_load, rtol=1e-12)
    np.testing.assert_array_equal(tr.bucket_steps, expected_steps)
    assert tr.load.sum() == pytest.approx(sum(steps[p][1:].sum() * per_step[p].sum() for p in "ab"), rel=1e-12)
    assert tr.bucket_steps.sum() == steps["a"][1:].sum() + steps["b"][1:].sum()
    token_share = gap_steps * per_step["a"].sum() / tr.load.sum()
    step_share = gap_steps / tr.bucket_steps.sum()
    assert tr.meta["interpolated_fraction"] == pytest.approx(max(token_share, step_share), rel=1e-12)
    assert 0.1 < tr.meta["interpolated_fraction"] < 0.5
    # the default threshold (10 %) refuses the same window, naming the pod, the gap and the share
    with pytest.raises(LoadReadError, match=r"pod a: no samples between t=110.000 and t=145.000 \(35.0s\)") as ei:
        trace_from_raw_counters(_body(experts), _body(step_body), GRID6, what=" for ns/moe")
    assert ei.value.reason == "ScrapeGaps"
    assert f"{tr.meta['interpolated_fraction']:.0%} of the load in the last 90s for ns/moe" in ei.value.message
    # complete data: exact and nothing interpolated
    full = [(m, pts) for m, pts in experts if m["pod"] == "b"]
    tb = trace_from_raw_counters(_body(full), _body(step_body[1:]), GRID6)
    assert tb.meta["interpolated_fraction"] == 0.0 and tb.load.sum() == steps["b"][1:].sum() * per_step["b"].sum()
    with pytest.raises(ValueError, match="max_interpolated_fraction"):
        trace_from_raw_counters(_body(full), _body(step_body[1:]), GRID6, max_interpolated_fraction=10)


def _member(pod, worker, size=2, group="0"):
    return {**_pod(pod), metric_names.GROUP_LABEL: group, metric_names.GROUP_WORKER_LABEL: str(worker),
            metric_names.GROUP_SIZE_LABEL: str(size)}


def _group_series(pods):
    """Expert tokens (2 layers x 2 experts) and steps of LWS group pods ``[(name, worker)]``."""
    experts, steps = [], []
    for name, worker in pods:
        for l in range(2):
            for e in range(2):
                experts.append(({**_member(name, worker), "layer": str(l), "expert": str(e)},
                                list(zip(TS, [10 * worker + l, 10 * worker + l + 2, 10 * worker + l + 5, 10 * worker + l + 9]))))
        steps.append((_member(name, worker), list(zip(TS, [100, 110, 130, 160]))))
    return experts, steps


def test_a_replica_group_is_read_as_the_sum_of_its_pods():
    experts, steps = _group_series([("lws-0", 0), ("lws-0-1", 1)])
    tr = trace_from_raw_counters(_body(experts), _body(steps), GRID, pods_per_engine=2)
    np.testing.assert_array_equal(tr.load[:, 0, 0], [2 + 2, 3 + 3, 4 + 4])  # both pods' routers
    np.testing.assert_array_equal(tr.bucket_steps, [10, 20, 30])  # the engine's steps, once


@pytest.mark.parametrize("pods,missing", [
    ([("lws-0", 0)], "lws-0-1 (worker 1)"),
    ([("lws-0-1", 1)], "lws-0 (worker 0)"),
])
def test_a_replica_group_with_a_pod_missing_is_refused(pods, missing):
    experts, steps = _group_series(pods)
    with pytest.raises(LoadReadError) as ei:
        trace_from_raw_counters(_body(experts), _body(steps), GRID, pods_per_engine=2)
    assert ei.value.reason == "IncompleteGroup"
    assert "replica group 0 of ns/moe" in ei.value.message and missing in ei.value.message


def test_a_pod_with_one_counter_family_or_a_missing_layer_is_refused():
    experts, steps = _group_series([("lws-0", 0), ("lws-0-1", 1)])
    with pytest.raises(LoadReadError, match="lws-0-1 .*replica group 0.*no matching") as ei:
        trace_from_raw_counters(_body(experts), _body(steps[:1]), GRID, pods_per_engine=2)
    assert ei.value.reason == "IncompleteGroup"
    # a single-node pod that reports steps but no tokens (while another pod does) is refused too
    a = [_expert_series("a", 0, 0, [1, 2, 3, 4])]
    with pytest.raises(LoadReadError, match="pod b: moe_eplb_engine_steps_total series but no matching") as ei:
        trace_from_raw_counters(_body(a), _body([(_pod("a"), list(zip(TS, [1, 2, 3, 4]))),
                                                 (_pod("b"), list(zip(TS, [1, 2, 3, 4])))]), GRID)
    assert ei.value.reason == "InconsistentSeries"
    # a pod missing a layer another pod reports
    two = a + [_expert_series("a", 1, 0, [1, 2, 3, 4]), _expert_series("b", 0, 0, [1, 2, 3, 4])]
    with pytest.raises(LoadReadError, match=r"pod b: no moe_eplb_expert_tokens_total series for layer\(s\) \['1'\]"):
        trace_from_raw_counters(_body(two), _body([(_pod("a"), list(zip(TS, [1, 2, 3, 4]))),
                                                   (_pod("b"), list(zip(TS, [1, 2, 3, 4])))]), GRID)


def test_a_group_is_judged_on_the_sum_of_its_pods_rank_counts():
    from moe_eplb.metrics.measure import RankHistory, balancedness_of, engine_of_pod

    def pod(name, group=None):
        labels = {} if group is None else {k8s_names.LWS_NAME_LABEL: "lws", k8s_names.LWS_GROUP_INDEX_LABEL: group}
        return {"metadata": {"name": name, "labels": labels}}

    pods = [pod("lws-0", "0"), pod("lws-0-1", "0"), pod("single")]
    engines = {p["metadata"]["name"]: engine_of_pod(p) for p in pods}
    assert engines == {"lws-0": "lws/group 0", "lws-0-1": "lws/group 0", "single": "single"}
    # each pod's routers sent their tokens to the other pod's ranks: each looks unbalanced alone,
    # the engine (the sum) is perfectly balanced
    leader, worker = np.array([[10.0, 0.0]]), np.array([[0.0, 10.0]])
    hist = RankHistory()
    hist.remember(0.0, {"lws-0": 0 * leader, "lws-0-1": 0 * worker})
    got = hist.measure({"lws-0": leader, "lws-0-1": worker}, 0.0, 60.0, engines=engines)
    assert got.balancedness == 1.0 and got.pods == 2
    assert balancedness_of({"lws-0": leader, "lws-0-1": worker}) == 0.5  # per pod: wrong


def test_layers_are_packed_in_order_into_answers_of_bounded_size():
    from moe_eplb.metrics.reader import pack_layers

    per_layer = {"10": 40.0, "2": 100.0, "0": 100.0, "1": 75.0, "": 30.0}
    assert pack_layers(per_layer, max_samples=1000) is None  # 345 samples: one answer
    # numeric order (2 before 10), whole layers, the unlabelled series left to their own group
    assert pack_layers(per_layer, max_samples=200) == [["0", "1"], ["2", "10"]]
    assert pack_layers(per_layer, max_samples=60) == [["0"], ["1"], ["2"], ["10"]]  # a layer never splits


def test_the_judges_rank_counters_come_from_the_readers_round():
    from moe_eplb.metrics.measure import rank_counts_of_round

    rt = metric_names.RANK_TOKENS
    sample = PodSample(telemetry=[(rt, {"model_name": "m", "layer": "0", "rank": "1"}, 5.0),
                                  (rt, {"model_name": "m", "layer": "1", "rank": "0"}, 2.0)])
    rnd = Round(time=1.0, pods={"p": sample, "q": sample})

    def pod(name, ready):
        return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}

    got = rank_counts_of_round(rnd, [pod("p", "True"), pod("q", "False")])
    assert set(got) == {"p"}
    np.testing.assert_array_equal(got["p"], [[0.0, 5.0], [2.0, 0.0]])


def test_a_pod_that_answers_late_is_read_at_its_answer():
    """Issue 19: on a loaded machine a pod answers a direct-scrape round seconds after the round
    started (of an accelerated clock: a good part of a bucket); its counters are of the moment it
    answered, so they are read at that time: stamped with the round's start, a sample claims a
    counter value before the counter reached it and puts load in the bucket before. Rounds started
    at 108 and 118 (grid 100, 110, 120; the counter rises 10 per second from 100); pod ``a``
    answered the first at 111 with the value it had then, 110 (at 108 it had 80)."""
    r0 = _round(100, {"a": (50, 0, [[0, 0]])})
    r1 = _round(108, {"a": (50, 110, [[11, 0]])})
    r2 = _round(118, {"a": (50, 190, [[19, 0]])})
    grid = np.array([100.0, 110.0, 120.0])
    late = trace_from_raw_counters(*counters_from_rounds([r0, r1, r2])[:2], grid)
    np.testing.assert_array_equal(late.bucket_steps, [110, 80])  # stamped at the round's start: wrong bucket
    r1.pods["a"].time, r2.pods["a"].time = 111.0, 119.0
    tokens, steps, starts = counters_from_rounds([r0, r2, r1])  # rounds that overlapped, kept by start time
    np.testing.assert_array_equal(steps[0].ts, [100.0, 111.0, 119.0])
    tr = trace_from_raw_counters(tokens, steps, grid, start_times=starts)
    np.testing.assert_array_equal(tr.bucket_steps, [0, 190])
    np.testing.assert_array_equal(tr.load[:, 0, 0], [0, 19])
    src, tel_starts = series_from_rounds([r0, r1, r2])
    np.testing.assert_array_equal(tel_starts[0].ts, [100.0, 111.0, 119.0])
