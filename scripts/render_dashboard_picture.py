#!/usr/bin/env python3
"""Render docs/img/expert-load-dashboard.png: what the "MoE expert load" dashboard shows, drawn
with matplotlib from SIMULATED data (not a Grafana screenshot).

The data: one hour of the synthetic "qwen3-vl-30b-a3b-chat-to-math" workload (the seed model's
shape: 48 MoE layers x 128 experts, top-8; the mix shifts from chat to math), replayed through the
project's model of vLLM's EPLB (``moe_eplb.sim.engine.SimulatedEplb``) on EP 4 — first with EPLB off
(vLLM's static placement), then, from minute 30, on fresh pods with EPLB on and 8 redundant experts. The panels are the dashboard's: tokens/s per expert (heatmap) of one layer, the
hottest experts, per-rank load, balancedness per layer, and replicas per expert.

    python scripts/render_dashboard_picture.py [--out docs/img/expert-load-dashboard.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb import synth
from moe_eplb.sim.engine import EngineSettings, SimulatedEplb, balancedness

ROOT = Path(__file__).resolve().parent.parent
EP, LAYER, SWITCH_MIN = 4, 20, 30.0


def simulate(seed: int = 0) -> dict[str, np.ndarray]:
    """Replay the trace; returns per-bucket arrays (T buckets, L layers, E experts, P ranks)."""
    trace = synth.generate("qwen3-vl-30b-a3b-chat-to-math", hours=1.0, bucket_seconds=15.0, seed=seed)
    T, L, E = trace.load.shape
    minutes = np.arange(T) * trace.bucket_seconds / 60.0
    switch = int(np.searchsorted(minutes, SWITCH_MIN))
    before = SimulatedEplb(L, E, EngineSettings(model="qwen3-vl", ep_size=EP, eplb_enabled=False))
    after = SimulatedEplb(L, E, EngineSettings(model="qwen3-vl", ep_size=EP, knobs=Knobs(1000, 3000, 8)))
    ranks = np.zeros((T, L, EP))
    replicas_after = None
    for t in range(T):
        engine = before if t < switch else after
        ranks[t] = engine.run(trace.load[t], int(trace.bucket_steps[t]))
        if t == T - 1:
            replicas_after = engine.logcnt.copy()
    per_s = trace.load / trace.bucket_seconds
    return {"minutes": minutes, "expert_rate": per_s, "rank_rate": ranks / trace.bucket_seconds,
            "balancedness": np.stack([balancedness(r) for r in ranks]), "replicas": replicas_after,
            "switch": np.array(SWITCH_MIN)}


def render(data: dict[str, np.ndarray], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bg, panel, fg, grid = "#111217", "#181b1f", "#ccccdc", "#2c3235"
    plt.rcParams.update({"figure.facecolor": bg, "axes.facecolor": panel, "axes.edgecolor": grid,
                         "axes.labelcolor": fg, "xtick.color": fg, "ytick.color": fg, "text.color": fg,
                         "axes.titlecolor": fg, "axes.titlesize": 10, "axes.titleweight": "bold",
                         "font.size": 8, "grid.color": grid, "axes.grid": True, "legend.frameon": False})
    m, sw = data["minutes"], float(data["switch"])
    fig = plt.figure(figsize=(16, 9.5))
    gs = fig.add_gridspec(3, 3, height_ratios=[1.25, 1, 1], hspace=0.45, wspace=0.22,
                          left=0.04, right=0.99, top=0.9, bottom=0.06)
    fig.suptitle("MoE expert load  —  namespace team-a · MoEInference qwen3-vl · layer 20 · EP 4"
                 "          (rendered from SIMULATED data)", x=0.04, ha="left", fontsize=12, color=fg)
    fig.text(0.04, 0.925, "Mean balancedness with EPLB off: %.2f   with EPLB on (window 1000, interval 3000, "
             "8 redundant experts): %.2f"
             % (data["balancedness"][m < sw].mean(), data["balancedness"][m > sw + 5].mean()),
             fontsize=10, color="#73bf69")

    def annotate(ax: plt.Axes) -> None:
        ax.axvline(sw, color="#73bf69", lw=1.5, ls="--")
        ax.text(sw, ax.get_ylim()[1], " EPLB on (new pods)", color="#73bf69", va="top", fontsize=8)

    ax = fig.add_subplot(gs[0, :2])
    rate = data["expert_rate"][:, LAYER, :].T  # [E, T]
    im = ax.imshow(rate, aspect="auto", origin="lower", cmap="inferno",
                   extent=(m[0], m[-1], -0.5, rate.shape[0] - 0.5), norm=matplotlib.colors.PowerNorm(0.5))
    ax.grid(False)
    ax.set_title("Layer 20: tokens/s per expert")
    ax.set_ylabel("expert")
    ax.set_xlabel("minutes")
    fig.colorbar(im, ax=ax, pad=0.01, label="tokens/s")
    annotate(ax)

    ax = fig.add_subplot(gs[0, 2])
    total = data["expert_rate"][-20:].mean(axis=0)  # [L, E], last 5 minutes
    flat = np.argsort(total, axis=None)[::-1][:12]
    ls, es = np.unravel_index(flat, total.shape)
    ax.barh(range(len(flat))[::-1], total[ls, es], color="#ff9830")
    ax.set_yticks(range(len(flat))[::-1], [f"layer {l} expert {e}" for l, e in zip(ls, es)])
    ax.set_title("Top 12 hot experts (tokens/s)")
    ax.grid(axis="y")

    ax = fig.add_subplot(gs[1, :2])
    rr = data["rank_rate"][:, LAYER, :]
    for r in range(EP):
        ax.plot(m, rr[:, r], lw=1.2, label=f"rank {r}")
    ax.plot(m, rr.mean(axis=1), color="white", lw=1, ls=":", label="mean")
    ax.set_title("Per-rank load, layer 20 (tokens/s)")
    ax.legend(ncol=5, loc="upper left")
    annotate(ax)

    ax = fig.add_subplot(gs[1, 2])
    rep = data["replicas"][LAYER]
    ax.bar(np.arange(rep.size), rep, color="#5794f2", width=1.0)
    ax.set_title("Replicas per expert, layer 20 (after)")
    ax.set_xlabel("expert")
    ax.set_ylim(0, rep.max() + 0.5)

    ax = fig.add_subplot(gs[2, :2])
    bal = data["balancedness"]
    for layer, color in ((0, "#b877d9"), (LAYER, "#ff9830"), (47, "#5794f2")):
        ax.plot(m, bal[:, layer], lw=1.2, color=color, label=f"layer {layer}")
    ax.plot(m, bal.mean(axis=1), lw=2, color="#73bf69", label="mean of layers")
    ax.set_ylim(0, 1.02)
    ax.set_title("Balancedness per layer (mean / max tokens per rank)")
    ax.set_xlabel("minutes")
    ax.legend(ncol=4, loc="lower right")
    annotate(ax)

    ax = fig.add_subplot(gs[2, 2])
    imb = (data["rank_rate"].max(axis=2) / np.maximum(data["rank_rate"].mean(axis=2), 1e-9)).mean(axis=1)
    ax.plot(m, imb, color="#f2495c", lw=1.5)
    ax.set_title("Max / mean rank load (mean of layers)")
    ax.set_xlabel("minutes")
    annotate(ax)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "expert-load-dashboard.png")
    args = ap.parse_args()
    render(simulate(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
