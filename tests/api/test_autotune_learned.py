"""status.autotune.learned: the ranges experiments narrowed, kept across decisions (round trip,
replacement by parameter, a malformed entry dropped and noted), and the controller's conversion."""

from __future__ import annotations

from moe_eplb.api.autotune_status import (
    AutotuneStatus,
    LearnedParameter,
    autotune_status_to_crd,
    parse_autotune_status,
)
from moe_eplb.controller.autotune import learned_entries, learned_ranges
from moe_eplb.eplb.tuning.exploration import LearnedRange

SHARE = LearnedParameter("moe_time_share", 0.41, 0.52, 0.03, 0.6, "trial 100/1000/32 vs 100/1000/0")


def test_learned_round_trips_in_camel_case():
    st = AutotuneStatus().with_learned([SHARE])
    raw = autotune_status_to_crd(st)
    assert raw["learned"] == [{"parameter": "moe_time_share", "low": 0.41, "high": 0.52, "priorLow": 0.03,
                               "priorHigh": 0.6, "source": "trial 100/1000/32 vs 100/1000/0"}]
    back = parse_autotune_status(raw)
    assert back.learned == (SHARE,) and not back.notes
    assert "learned" not in autotune_status_to_crd(AutotuneStatus())  # empty: omitted


def test_a_later_experiment_replaces_the_same_parameter():
    ws = LearnedParameter("prefix_working_set", 0.2, 0.4, 0.05, 2.0, "trial B")
    newer = LearnedParameter("moe_time_share", 0.45, 0.5, 0.41, 0.52, "trial C")
    st = AutotuneStatus().with_learned([SHARE, ws]).with_learned([newer])
    assert st.learned == (ws, newer)


def test_a_malformed_entry_is_dropped_and_named():
    st = parse_autotune_status({"learned": [{"parameter": "moe_time_share"}]})
    assert st.learned == () and st.notes and st.notes[0].startswith("status.autotune.learned")


def test_the_controller_hands_learned_ranges_to_the_calibration():
    st = AutotuneStatus().with_learned([SHARE, LearnedParameter("prefix_working_set", 0.2, 0.4)])
    got = learned_ranges(st)
    assert got[0] == LearnedRange("moe_time_share", 0.41, 0.52, 0.03, 0.6, SHARE.source)
    assert got[1] == LearnedRange("prefix_working_set", 0.2, 0.4, 0.2, 0.4, "")  # no prior stored: its own range
    assert learned_entries(got[:1]) == (SHARE,) and learned_ranges(None) == []
