"""Regular pods read as sums at the bucket edges (``moe_eplb.metrics.edges``): the same trace as the
raw samples give, from far fewer numbers, and a fall back to raw samples whenever the sums could
differ. Pure tests on constructed series, then a real Prometheus 2.42 with backfilled pods that
restart, join, leave, miss scrapes or grow a counter mid-window."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moe_eplb.contracts import metric_names
from moe_eplb.metrics import edges
from moe_eplb.metrics.assemble import trace_from_raw_counters
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import pod_matcher, read_expert_tokens, read_load_trace, selector, with_baselines
from moe_eplb.metrics.series import Series
from tests.metrics.backfill import backfilled_prometheus, openmetrics_text

L, E, T = 3, 4, 8
B = 15.0  # bucket seconds
SCRAPE = 5.0
G0 = 1_800_000_000.0
GRID = G0 + B * np.arange(T + 1)


def _pod_labels(pod: str, name: str = "moe") -> dict:
    return {"namespace": "ns", "moeinference": name, "pod": pod, "model_name": "m"}


class FakePod:
    """One pod's counters at its scrape times: ``ts`` [n], expert counters [n, L, E] (NaN: that
    series does not exist yet), steps [n], exporter start time [n]."""

    def __init__(self, name, ts, tokens, steps, start, moe="moe"):
        self.name, self.ts, self.tokens, self.steps, self.start, self.moe = name, ts, tokens, steps, start, moe

    def labels(self):
        return _pod_labels(self.name, self.moe)

    def token_series(self, lo=-np.inf, hi=np.inf) -> list[Series]:
        keep = (self.ts > lo) & (self.ts <= hi)
        out = []
        for l in range(L):
            for e in range(E):
                v = self.tokens[keep, l, e]
                ok = ~np.isnan(v)
                if ok.any():
                    out.append(Series({**self.labels(), "__name__": metric_names.EXPERT_TOKENS, "layer": str(l),
                                       "expert": str(e)}, self.ts[keep][ok], v[ok]))
        return out

    first_rank = 0  # this pod's EP ranks: first_rank, first_rank + 1 (experts 0-1 and 2-3)

    def rank_tokens(self) -> np.ndarray:
        """``[n, L, 2]`` tokens each of the pod's two ranks processed (its experts' counters summed)."""
        return np.nan_to_num(self.tokens).reshape(self.ts.size, L, 2, E // 2).sum(axis=3)

    def rank_series(self, hi=np.inf) -> list[Series]:
        keep = self.ts <= hi
        rt = self.rank_tokens()
        return [Series({**self.labels(), "__name__": metric_names.RANK_TOKENS, "layer": str(l),
                        "rank": str(self.first_rank + j)}, self.ts[keep], rt[keep, l, j])
                for l in range(L) for j in range(2)]

    def step_series(self) -> Series:
        return Series({**self.labels(), "__name__": metric_names.ENGINE_STEPS}, self.ts, self.steps)

    def start_series(self) -> Series:
        return Series({**self.labels(), "__name__": metric_names.EXPORTER_START_TIME}, self.ts, self.start)

    def at(self, t: float, lookback: float = edges.LOOKBACK_SECONDS) -> int | None:
        """Index of the newest sample at or before ``t`` within the lookback (Prometheus' instant
        evaluation), or None."""
        i = int(np.searchsorted(self.ts, t, side="right")) - 1
        return i if i >= 0 and self.ts[i] > t - lookback else None


def make_pod(name, rng, *, first=G0 - 30, last=GRID[-1], gap=None, restart_at=None, moe="moe", late_series_at=None):
    ts = np.arange(first, last + 1e-9, SCRAPE)
    if gap is not None:
        ts = ts[(ts <= gap[0]) | (ts >= gap[1])]
    inc = rng.integers(0, 9, size=(ts.size, L, E)).astype(float)
    inc_steps = rng.integers(1, 20, size=ts.size).astype(float)
    start = np.full(ts.size, first - 3600.0 if first < G0 else first - 2.0)
    tokens = np.cumsum(inc, axis=0) + (1000.0 if first < G0 else 0.0)
    steps = np.cumsum(inc_steps) + (500.0 if first < G0 else 0.0)
    if restart_at is not None:  # a new exporter process from restart_at: start time moves, counters from zero
        after = ts >= restart_at
        k = int(np.argmax(after))
        tokens[after] -= tokens[k - 1]
        steps[after] -= steps[k - 1]
        start[after] = restart_at - 1.0
    if late_series_at is not None:  # expert (0, 1)'s counter is created at late_series_at
        tokens[ts < late_series_at, 0, 1] = np.nan
        tokens[ts >= late_series_at, 0, 1] -= np.nanmin(tokens[ts >= late_series_at, 0, 1]) - 7.0
    return FakePod(name, ts, tokens, steps, start, moe)


def edge_answers(pods: list[FakePod]) -> tuple[list[Series], list[Series], list[Series]]:
    """What Prometheus answers to the three range queries over ``pods`` (sum of the expert counters
    by (model, layer, expert), sum of the step counters, expert series per pod and layer), evaluated
    at the grid edges with the default lookback."""
    sums = np.zeros((T + 1, L, E))
    present = np.zeros((T + 1, L, E), bool)  # a sum exists where any pod has the series
    step_sum = np.full(T + 1, np.nan)
    counts = {}
    for k, g in enumerate(GRID):
        for p in pods:
            i = p.at(g)
            if i is None:
                continue
            v = p.tokens[i]
            sums[k] += np.nan_to_num(v)
            present[k] |= ~np.isnan(v)
            step_sum[k] = (0.0 if np.isnan(step_sum[k]) else step_sum[k]) + p.steps[i]
            for l in range(L):
                counts.setdefault((p.name, l), np.full(T + 1, np.nan))[k] = float((~np.isnan(v[l])).sum())
    sum_series = []
    for l in range(L):
        for e in range(E):
            ok = present[:, l, e]
            sum_series.append(Series({"model_name": "m", "layer": str(l), "expert": str(e)}, GRID[ok], sums[ok, l, e]))
    ok = ~np.isnan(step_sum)
    count_series = [Series({**_pod_labels(pod), "layer": str(l)}, GRID[~np.isnan(c)], c[~np.isnan(c)])
                    for (pod, l), c in counts.items()]
    return sum_series, [Series({}, GRID[ok], step_sum[ok])], count_series


def _raw_inputs(pods: list[FakePod], only=None):
    tokens = [s for p in pods if only is None or p.name in only for s in p.token_series(hi=GRID[-1])]
    # the raw reader's view: samples in (grid[0], grid[-1]] plus the last one at or before grid[0]
    def clip(s: Series) -> Series:
        keep = s.ts > GRID[0]
        base = np.flatnonzero(~keep)
        if base.size:
            keep[base[-1]] = True
        return Series(s.labels, s.ts[keep], s.vs[keep])
    return ([clip(s) for s in tokens], [clip(p.step_series()) for p in pods], [clip(p.start_series()) for p in pods])


@pytest.fixture
def mixed():
    rng = np.random.default_rng(7)
    pods = [
        make_pod("r1", rng), make_pod("r2", rng),
        make_pod("restart", rng, restart_at=G0 + 55),
        make_pod("joined", rng, first=G0 + 40),
        make_pod("left", rng, last=G0 + 70),
        make_pod("gappy", rng, gap=(G0 + 30, G0 + 75)),
    ]
    for i, p in enumerate(pods):
        p.first_rank = 2 * i  # EP 12 over the six pods
    return pods


def rank_edge_sums(pods: list[FakePod]) -> list[Series]:
    """Prometheus' answer to ``sum by (model_name, layer, rank) (moe_eplb_rank_tokens_total{pods})``
    at the grid edges."""
    out = []
    for p in pods:
        rt = p.rank_tokens()
        idx = [p.at(g) for g in GRID]
        out += [Series({"model_name": "m", "layer": str(l), "rank": str(p.first_rank + j)}, GRID,
                       np.array([rt[i, l, j] for i in idx])) for l in range(L) for j in range(2)]
    return out


def clip_to_window(s: Series) -> Series:
    """The raw reader's view of a series: samples in (grid[0], grid[-1]] plus its baseline."""
    keep = (s.ts > GRID[0]) & (s.ts <= GRID[-1])
    base = np.flatnonzero(s.ts <= GRID[0])
    if base.size:
        keep[base[-1]] = True
    return Series(s.labels, s.ts[keep], s.vs[keep])


def test_rank_tokens_summed_at_the_edges_give_the_raw_rank_load(mixed):
    from moe_eplb.metrics.telemetry_keys import TelemetrySeries, telemetry_from_series

    _, steps, starts = _raw_inputs(mixed)
    regular = edges.regular_pods(steps, starts, GRID)
    every = [clip_to_window(x) for p in mixed for x in p.rank_series()]
    rest = [clip_to_window(x) for p in mixed if p.name not in regular for x in p.rank_series()]
    bucket_steps = np.ones(T)
    raw = telemetry_from_series(TelemetrySeries(rank_tokens=every), GRID, bucket_steps, num_layers=L,
                                start_times=starts).telemetry.rank_load
    fast = telemetry_from_series(TelemetrySeries(rank_tokens=rest, rank_edge_sums=rank_edge_sums(
        [p for p in mixed if p.name in regular])), GRID, bucket_steps, num_layers=L, start_times=starts).telemetry.rank_load
    assert raw.shape == (T, L, 12) and raw[:, :, :4].sum() > 0
    np.testing.assert_allclose(fast, raw, rtol=1e-12, atol=1e-9)


def test_regular_pods_are_those_with_nothing_to_correct(mixed):
    _, steps, starts = _raw_inputs(mixed)
    assert edges.regular_pods(steps, starts, GRID) == {"r1", "r2"}
    why = edges.irregular(steps, starts, GRID)
    assert why["r1"] is None and why["restart"] == "restarted"
    assert why["joined"].startswith("no sample at or before the window's start")
    assert why["left"] == "no sample in the last 15s of the window (it left)"
    assert why["gappy"] == "missed scrapes (45s between two samples)"
    # a series without a pod label: pods cannot be selected by name, so none is regular
    unnamed = [Series({k: v for k, v in s.labels.items() if k != "pod"}, s.ts, s.vs) for s in steps[:1]]
    assert edges.regular_pods(unnamed + steps[1:], starts, GRID) == frozenset()
    # a pod with no exporter start time is not trusted to be regular
    assert edges.regular_pods(steps, [s for s in starts if s.labels["pod"] != "r1"], GRID) == {"r2"}


def test_edge_sums_give_the_raw_trace_exactly(mixed):
    tokens, steps, starts = _raw_inputs(mixed)
    raw = trace_from_raw_counters(tokens, steps, GRID, start_times=starts, num_layers=L, num_experts=E,
                                  max_interpolated_fraction=1.0)
    regular = edges.regular_pods(steps, starts, GRID)
    sums, step_sums, counts = edge_answers([p for p in mixed if p.name in regular])
    assert edges.check_edges(regular, steps, starts, step_sums, counts, GRID) is None
    assert edges.check_sums(sums, GRID) is None
    rest, _, _ = _raw_inputs(mixed, only={p.name for p in mixed} - regular)
    fast = trace_from_raw_counters(rest, steps, GRID, start_times=starts, edge_sums=sums, edge_counts=counts,
                                   num_layers=L, num_experts=E, max_interpolated_fraction=1.0)
    np.testing.assert_allclose(fast.load, raw.load, rtol=1e-12, atol=1e-9)
    np.testing.assert_array_equal(fast.bucket_steps, raw.bucket_steps)
    assert raw.load.sum() > 0 and raw.meta["interpolated_fraction"] > 0  # the gappy pod was spread
    assert fast.meta["interpolated_fraction"] == pytest.approx(raw.meta["interpolated_fraction"], rel=1e-12)
    assert (fast.meta["pods_at_edges"], fast.meta["pods_raw"]) == (2, 4)
    assert (raw.meta["pods_at_edges"], raw.meta["pods_raw"]) == (0, 6)


def test_sums_that_could_differ_from_the_raw_samples_are_refused(mixed):
    _, steps, starts = _raw_inputs(mixed)
    regular = frozenset({"r1", "r2"})
    sums, step_sums, counts = edge_answers([p for p in mixed if p.name in regular])
    # a pod stale at one edge: the summed step counter no longer rises by the raw increments
    short = Series({}, step_sums[0].ts, step_sums[0].vs - np.where(step_sums[0].ts == GRID[3], 100.0, 0.0))
    assert "bucket 2: the step counter summed at the edges rose by" in edges.check_edges(
        regular, steps, starts, [short], counts, GRID)
    missing = Series({}, step_sums[0].ts[1:], step_sums[0].vs[1:])
    assert "no value at 1 bucket edge" in edges.check_edges(regular, steps, starts, [missing], counts, GRID)
    # another pod answered (selected by mistake, or joined between the queries)
    _, _, more = edge_answers([p for p in mixed if p.name in regular | {"left"}])
    assert "expected ['r1', 'r2']" in edges.check_edges(regular, steps, starts, step_sums, more, GRID)
    # a counter created mid-window: the raw rule never counts its first value, a sum would
    rng = np.random.default_rng(3)
    late = make_pod("late", rng, late_series_at=G0 + 50)
    _, lsteps, lstarts = _raw_inputs([late])
    assert edges.regular_pods(lsteps, lstarts, GRID) == {"late"}
    lsums, lstep_sums, lcounts = edge_answers([late])
    assert "pod late layer 0: the number of expert series changed" in edges.check_edges(
        frozenset({"late"}), lsteps, lstarts, lstep_sums, lcounts, GRID)
    assert "has no value at" in edges.check_sums(lsums, GRID)
    dropping = Series({"layer": "0", "expert": "0"}, GRID, np.r_[GRID[:-1] * 0 + 5.0, 4.0])
    assert "drops between two bucket edges" in edges.check_sums([dropping], GRID)


def test_pod_matchers_select_exactly_the_named_pods():
    assert pod_matcher(["b-0", "a.1"]) == 'pod=~"a\\\\.1|b\\\\-0"'
    assert pod_matcher(["x"], negate=True) == 'pod!~"x"'


# --------------------------------------------------------------------------------------------------
# a real Prometheus
# --------------------------------------------------------------------------------------------------


def _openmetrics(pods: list[FakePod], shift: float) -> str:
    fams = {metric_names.EXPERT_TOKENS: [], metric_names.RANK_TOKENS: [], metric_names.ENGINE_STEPS: [],
            metric_names.EXPORTER_START_TIME: []}
    for p in pods:
        lab = ",".join(f'{k}="{v}"' for k, v in p.labels().items())
        for s in p.token_series():
            fams[metric_names.EXPERT_TOKENS] += [
                f'{metric_names.EXPERT_TOKENS}{{{lab},layer="{s.labels["layer"]}",expert="{s.labels["expert"]}"}} '
                f'{v:.1f} {t + shift:.3f}' for t, v in zip(s.ts, s.vs)]
        fams[metric_names.RANK_TOKENS] += [
            f'{metric_names.RANK_TOKENS}{{{lab},layer="{x.labels["layer"]}",rank="{x.labels["rank"]}"}} '
            f'{v:.1f} {t + shift:.3f}' for x in p.rank_series() for t, v in zip(x.ts, x.vs)]
        fams[metric_names.ENGINE_STEPS] += [f"{metric_names.ENGINE_STEPS}{{{lab}}} {v:.1f} {t + shift:.3f}"
                                            for t, v in zip(p.ts, p.steps)]
        fams[metric_names.EXPORTER_START_TIME] += [f"{metric_names.EXPORTER_START_TIME}{{{lab}}} {v + shift:.3f} "
                                                   f"{t + shift:.3f}" for t, v in zip(p.ts, p.start)]
    return openmetrics_text(fams)


@pytest.mark.integration
@pytest.mark.prometheus
def test_a_real_prometheus_gives_the_same_trace_either_way(tmp_path, mixed):
    shift = (int(time.time()) - 3 * 3600) // int(B) * B - G0  # three hours ago, on the bucket grid
    late = make_pod("late-0", np.random.default_rng(3), moe="late", late_series_at=G0 + 50)
    with backfilled_prometheus(tmp_path, _openmetrics(mixed + [late], shift)) as url:
        def read(name, **kw):
            return read_load_trace(prometheus_url=url, namespace="ns", name=name, window_seconds=T * B,
                                   bucket_seconds=B, now=GRID[-1] + shift + 1, num_layers=L, num_experts=E,
                                   max_interpolated_fraction=1.0, **kw)

        fast, raw = read("moe"), read("moe", at_edges=False)
        assert fast.meta["read"] == "edges" and (fast.meta["pods_at_edges"], fast.meta["pods_raw"]) == (2, 4)
        assert raw.meta["read"] == "raw: edge sums off" and raw.meta["pods_at_edges"] == 0
        np.testing.assert_allclose(fast.load, raw.load, rtol=1e-12, atol=1e-9)
        np.testing.assert_array_equal(fast.bucket_steps, raw.bucket_steps)
        # the rank tokens (telemetry) of the same regular pods are summed at the edges too
        assert fast.meta["read_rank_tokens"] == "edges" and "read_rank_tokens" not in raw.meta
        assert fast.telemetry.rank_load.shape == (T, L, 12) and fast.telemetry.rank_load.sum() > 0
        np.testing.assert_allclose(fast.telemetry.rank_load, raw.telemetry.rank_load, rtol=1e-12, atol=1e-9)
        # the pure reference over the same samples agrees with both
        tokens, steps, starts = _raw_inputs(mixed)
        ref = trace_from_raw_counters(tokens, steps, GRID, start_times=starts, num_layers=L, num_experts=E,
                                      max_interpolated_fraction=1.0)
        np.testing.assert_allclose(fast.load, ref.load, rtol=1e-12, atol=1e-9)

        # a counter created mid-window would be counted by a sum: caught, read raw, same trace
        got, want = read("late"), read("late", at_edges=False)
        assert got.meta["read"].startswith("raw: pod late-0 layer 0: the number of expert series changed")
        np.testing.assert_array_equal(got.load, want.load)
        assert got.load[:, 0, 1].sum() == late.tokens[-1, 0, 1] - 7.0  # its first value is history, not load

        # a long window's range queries come in time chunks: the same sums
        client = PrometheusClient(url)
        sel = selector("ns", "moe")
        g = GRID + shift

        def inputs(grid):
            return (with_baselines(client, f"{metric_names.ENGINE_STEPS}{sel}", grid[0], grid[-1]),
                    with_baselines(client, f"{metric_names.EXPORTER_START_TIME}{sel}", grid[0], grid[-1]))

        _, whole, how = read_expert_tokens(client, sel, g, *inputs(g))
        _, chunked, how3 = read_expert_tokens(client, sel, g, *inputs(g), max_points=3)
        assert how == how3 == "edges" and len(whole.sums) == L * E

        def by_labels(load):
            return {tuple(sorted(x.labels.items())): (x.ts.tolist(), x.vs.tolist()) for x in load.sums}

        assert by_labels(chunked) == by_labels(whole)
        # a range query Prometheus refuses (over 11 000 points per series): read raw, and say why
        fine = g[0] + 0.01 * np.arange(12_001)
        rest, none, why = read_expert_tokens(client, sel, fine, *inputs(fine), max_points=20_000)
        assert none is None and why.startswith("raw: a range query was refused") and "11,000" in why
        assert len(rest) == len(mixed) * L * E
