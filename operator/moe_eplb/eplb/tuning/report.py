"""``--report DIR`` for ``moe-eplb simulate`` and ``moe-eplb tune``: plots and a markdown summary.

Files written:

- ``expert_load.png``: expert-load heatmaps over time (x: time since the trace's start when the
  trace knows its bucket length, else bucket; y: logical expert; colour: the expert's share of the
  layer's tokens, relative to the mean) for up to 8 MoE layers spread over the model's depth;
- ``balancedness.png``: balancedness over time (per bucket, all layers) for no EPLB, vLLM's
  defaults, the recommendation and the other top candidates (tune) or the simulated config. Every
  line is in the legend; configurations that are the same (e.g. the recommendation is vLLM's
  defaults) are one line whose label names them all, so none hides under another;
- ``summary.md``: the tables, the decision and links to the plots.

matplotlib (Agg backend) is imported only here and only when a report is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_eplb.eplb.replay.simulator import SimResult
from moe_eplb.eplb.workload.trace import LoadTrace


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def time_axis(trace: LoadTrace) -> tuple[np.ndarray, str]:
    """``[T + 1]`` bucket edges on the x-axis and its label: hours (or minutes, for traces under two
    hours) since the trace's start when ``bucket_seconds`` is known, else bucket numbers."""
    edges = np.arange(trace.num_buckets + 1, dtype=np.float64)
    if not trace.bucket_seconds:
        return edges, "bucket"
    seconds = edges * float(trace.bucket_seconds)
    if seconds[-1] >= 2 * 3600:
        return seconds / 3600.0, "time since the trace's start (h)"
    return seconds / 60.0, "time since the trace's start (min)"


def plot_expert_load(trace: LoadTrace, path: Path, max_layers: int = 8) -> Path:
    """Heatmaps of ``load[t, l, e] / mean_e load[t, l, :]`` for up to ``max_layers`` layers."""
    plt = _plt()
    L = trace.num_layers
    layers = np.unique(np.linspace(0, L - 1, min(max_layers, L)).round().astype(int))
    cols = min(4, len(layers))
    rows = int(np.ceil(len(layers) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    edges, xlabel = time_axis(trace)
    for ax, layer in zip(axes.ravel(), layers):
        x = trace.load[:, layer, :]
        mean = x.mean(axis=1, keepdims=True)
        rel = np.divide(x, mean, out=np.zeros_like(x), where=mean > 0)
        im = ax.imshow(rel.T, aspect="auto", origin="lower", cmap="magma",
                       vmin=0, vmax=max(2.0, float(np.quantile(rel, 0.99))),
                       extent=(edges[0], edges[-1], 0, trace.num_experts), interpolation="nearest")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax, label="load / mean")
    for ax in axes.ravel()[len(layers):]:
        ax.axis("off")
    fig.suptitle("Expert load over time (share of the layer's tokens, relative to the mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def merge_series(series: list[tuple[str, SimResult]]) -> list[tuple[str, SimResult]]:
    """Series of the same configuration (same mode and knobs) as one, labelled with every name
    (``vLLM defaults 1000/3000/0 = recommended 1000/3000/0``), in first-seen order."""
    merged: dict[tuple, tuple[list[str], SimResult]] = {}
    for label, res in series:
        key = (res.mode, res.knobs)
        if key in merged:
            merged[key][0].append(label)
        else:
            merged[key] = ([label], res)
    return [(" = ".join(labels), res) for labels, res in merged.values()]


def plot_balancedness(series: list[tuple[str, SimResult]], path: Path, trace: LoadTrace | None = None) -> Path:
    """Write :func:`balancedness_figure` to ``path``."""
    plt = _plt()
    fig = balancedness_figure(series, trace)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def balancedness_figure(series: list[tuple[str, SimResult]], trace: LoadTrace | None = None):
    """One line per configuration (:func:`merge_series`): balancedness over time (per bucket, over
    all layers), against time when ``trace`` knows its bucket length. Every line is in the legend."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    edges, xlabel = time_axis(trace) if trace is not None else (None, "bucket")
    for label, res in merge_series(series):
        y = res.balancedness_over_time
        x = (edges[:-1] + edges[1:]) / 2 if edges is not None else np.arange(y.size)
        ax.plot(x, y, label=f"{label} ({res.balancedness:.3f})", lw=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("balancedness (mean / max GPU load)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Balancedness over time")
    fig.tight_layout()
    return fig


def _row(label: str, res: SimResult) -> str:
    t = res.throughput
    return (f"| {label} | {res.balancedness:.4f} | {t.relative:.4f} | {t.imbalance_factor:.4f} | "
            f"{t.overhead_factor:.4f} | {t.kv_factor:.4f} | {res.rearrangements} | "
            f"{res.experts_moved} |")


_HEADER = ("| config | balancedness | predicted throughput | imbalance | overhead | KV memory | "
           "rearrangements | experts moved |\n|---|---|---|---|---|---|---|---|")


def _trace_line(trace: LoadTrace) -> str:
    secs = f", {trace.bucket_seconds:g} s per bucket" if trace.bucket_seconds else ""
    return (f"Trace: {trace.num_buckets} buckets x {trace.num_layers} MoE layers x "
            f"{trace.num_experts} experts, {trace.total_steps} engine steps{secs}"
            f"{', model ' + trace.model if trace.model else ''}.")


def write_simulation_report(out_dir, trace: LoadTrace, eplb: SimResult, static: SimResult) -> Path:
    """Plots and ``summary.md`` for one simulated configuration; returns the summary's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_expert_load(trace, out / "expert_load.png")
    plot_balancedness([("no EPLB", static), (f"EPLB {eplb.knobs.label}", eplb)],
                      out / "balancedness.png", trace)
    lines = [
        "# EPLB simulation", "", _trace_line(trace), "",
        f"Topology: {eplb.topology.to_dict()}. Config W/I/R = {eplb.knobs.label}.", "",
        _HEADER, _row("no EPLB", static), _row(eplb.knobs.label, eplb), "",
        "![balancedness](balancedness.png)", "", "![expert load](expert_load.png)", "",
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_tune_report(out_dir, trace: LoadTrace, result, top: int = 5) -> Path:
    """Plots and ``summary.md`` for a :class:`~moe_eplb.eplb.tuning.tuner.TuneResult`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_expert_load(trace, out / "expert_load.png")
    series = [("no EPLB", result.no_eplb)]
    if result.defaults is not None:
        series.append((f"vLLM defaults {result.defaults.knobs.label}", result.defaults.result))
    series.append((f"recommended {result.chosen.knobs.label}", result.chosen.result))
    shown = {result.chosen.knobs} | ({result.defaults.knobs} if result.defaults else set())
    for c in result.candidates[:top]:
        if c.knobs not in shown:
            series.append((c.knobs.label, c.result))
            shown.add(c.knobs)
    plot_balancedness(series, out / "balancedness.png", trace)
    rec = result.to_dict()["recommendation"]
    lines = [
        "# EPLB tuning", "", _trace_line(trace), "",
        f"Topology: {result.topology.to_dict()}.", "",
        f"**Recommendation: window {rec['window_size']}, interval {rec['step_interval']}, "
        f"redundant {rec['num_redundant_experts']} — {rec['decision']}.** {rec['reason']}.", "",
        "Gain over no EPLB: " + (f"{rec['gain_vs_no_eplb']:+.2%}" if rec["gain_vs_no_eplb"] is not None else "n/a")
        + "; over vLLM defaults: "
        + (f"{rec['gain_vs_vllm_defaults']:+.2%}" if rec["gain_vs_vllm_defaults"] is not None else "n/a")
        + (f"; over current: {rec['gain_vs_current']:+.2%}" if rec["gain_vs_current"] is not None else "")
        + ".", "",
        _HEADER, _row("no EPLB", result.no_eplb),
    ]
    if result.defaults is not None:
        lines.append(_row(f"vLLM defaults {result.defaults.knobs.label}", result.defaults.result))
    if result.current is not None:
        lines.append(_row(f"current {result.current.knobs.label}", result.current.result))
    lines.append(_row(f"**recommended {result.chosen.knobs.label}**", result.chosen.result))
    lines += ["", f"Top candidates (of {len(result.candidates)}; score = mean of the worst half of "
              f"{len(result.segment_edges) - 1} time segments):", "",
              "| rank | W/I/R | score | predicted throughput | balancedness |", "|---|---|---|---|---|"]
    for i, c in enumerate(result.candidates[:10]):
        lines.append(f"| {i + 1} | {c.knobs.label} | {c.score:.4f} | {c.mean:.4f} | "
                     f"{c.result.balancedness:.4f} |")
    lines += ["", "![balancedness](balancedness.png)", "", "![expert load](expert_load.png)", ""]
    path = out / "summary.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
