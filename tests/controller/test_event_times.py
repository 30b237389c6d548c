"""When a LeaderWorkerSet ``RecreateGroupOnPodRestart`` Event counts against a rollout: its times
carry their precision (MicroTime exact, legacy timestamps whole seconds)."""

from datetime import UTC, datetime

from moe_eplb.controller.workload import event_span

SINCE = datetime(2026, 12, 4, 9, 0, 0, 600000, tzinfo=UTC).timestamp()  # 09:00:00.6


def test_exact_event_times_compare_exactly():
    # the emulated controller's Events (events.k8s.io eventTime): one 0.2 s before the rollback began
    # is a crash of the settings rolled back from, not of the restored ones
    first, last = event_span({"eventTime": "2026-12-04T09:00:00.400000Z"})
    assert first == last and not first.whole_seconds
    assert not last.at_or_after(SINCE)
    _, last = event_span({"eventTime": "2026-12-04T09:00:00.700000Z"})
    assert last.at_or_after(SINCE)


def test_whole_second_times_count_in_the_second_since_falls_in():
    # the legacy recorder (the real LWS controller) truncates to seconds: 09:00:00 may be 09:00:00.9
    first, last = event_span({"firstTimestamp": "2026-12-04T09:00:00Z", "lastTimestamp": "2026-12-04T09:00:03Z",
                              "count": 4})
    assert first.whole_seconds and last.whole_seconds
    assert first.at_or_after(SINCE) and last.at_or_after(SINCE)
    first, _ = event_span({"firstTimestamp": "2026-12-04T08:59:59Z"})
    assert not first.at_or_after(SINCE)


def test_a_series_ends_at_its_last_observed_time():
    first, last = event_span({"eventTime": "2026-12-04T08:59:00.000000Z",
                              "series": {"count": 3, "lastObservedTime": "2026-12-04T09:00:01.000000Z"}})
    assert not first.at_or_after(SINCE) and last.at_or_after(SINCE)
    assert event_span({}) == (None, None)
