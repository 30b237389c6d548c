"""The demo's report as a person reads it: every line of the plot in its legend, reasons whole."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from moe_eplb_harness.demo.tuning import CHANGE_MARKERS, DemoRecord, _write_report, balancedness_figure, short  # noqa: E402

REASON = ("measured balancedness 0.912 vs 0.874 before the change (+4.3%, tolerance 2.0%): kept; the "
          "workload shifted to math | code at 1:30")


def _record() -> DemoRecord:
    rec = DemoRecord()
    rec.samples = [{"t_h": t / 10, "t0": t * 360.0, "t1": (t + 1) * 360.0, "balancedness": 0.8 + t / 100,
                    "untuned": 0.8, "num": 1.0, "den": 1.2, "window": 1000, "interval": 3000, "redundant": 0}
                   for t in range(20)]
    rec.history = [{"t_h": 0.5, "action": "Kept", "reason": REASON},
                   {"t_h": 1.2, "action": "RolledBack", "reason": "regressed"},
                   {"t_h": 1.6, "action": "Kept", "reason": "ok"}]
    rec.decisions = [{"t_h": 0.4, "decision": "Apply", "current": {"windowSize": 1000, "stepInterval": 3000,
                                                                     "numRedundantExperts": 0},
                      "recommended": {"windowSize": 2000, "stepInterval": 1000, "numRedundantExperts": 8},
                      "predictedGain": 0.04, "reason": REASON}]
    return rec


def test_every_line_drawn_is_in_the_legend():
    """(one resource's panel; the report draws one such panel per resource)"""
    fig = balancedness_figure(_record(), hours=2.0, ep=16)
    ax = fig.axes[0]
    legend = {(h.get_color(), h.get_linestyle()): t.get_text()
              for h, t in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}
    drawn = {(line.get_color(), line.get_linestyle()) for line in ax.lines}
    assert drawn <= set(legend), drawn - set(legend)
    labels = list(legend.values())
    assert [label for _, _, label in CHANGE_MARKERS] == [x for x in labels if x.startswith("change")]
    assert len(labels) == 5  # untuned, tuned, shift, kept (twice drawn, once listed), rolled back


def test_legend_lists_only_the_markers_drawn():
    rec = _record()
    rec.history = [h for h in rec.history if h["action"] == "Kept"]
    ax = balancedness_figure(rec, hours=2.0, ep=16).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "change rolled back" not in labels and "change applied, judged and kept" in labels


def test_reasons_are_never_cut_mid_word(tmp_path):
    result = {"name": "r", "kind": "Deployment", "mode": "Apply", "label": "a resource", "ep": 16, "final": {},
              "applied_changes": [], "evaluations": 1,
              "balancedness": dict.fromkeys(("tuned", "untuned", "after_shift_tuned", "after_shift_untuned"), 0.9)}
    _write_report(str(tmp_path), {"r": _record()}, {"r": result}, {"shift_at_s": 3600.0, "resources": []},
                  hours=2.0, wall=1.0, prometheus=True)
    report = (tmp_path / "report.md").read_text()
    assert REASON.replace("|", "\\|") in report  # whole, the table's separator escaped
    console = short(REASON, 110)
    assert len(console) <= 110 and console.endswith(" …")
    assert REASON.startswith(console[:-2])
    assert REASON[len(console) - 2] == " "  # the cut falls between two words
    assert short("a  b\nc", 20) == "a b c"
