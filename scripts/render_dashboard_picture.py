#!/usr/bin/env python3
"""Render docs/img/expert-load-dashboard.png: what the "MoE expert load" dashboard shows, drawn
with matplotlib from SIMULATED data (not a Grafana screenshot).

The data: one hour of the synthetic "qwen3-vl-30b-a3b-chat-to-math" workload (the seed model's
shape: 48 MoE layers x 128 experts, top-8; the mix shifts from chat to math), replayed through the
project's model of vLLM's EPLB (``moe_eplb_harness.engines.engine.SimulatedEplb``) on EP 4 — first with EPLB off
(vLLM's static placement), then, from minute 30, on fresh pods with EPLB on and 8 redundant experts.
The panels are those of the dashboard's default view (scripts/dashboards.py) that the simulation
can feed: overview numbers, the layer x time balancedness heatmap, the top-5 imbalanced layers, and
the per-expert heatmap and per-rank load of the most imbalanced layer (the default ``$layer``).

    python scripts/render_dashboard_picture.py [--out docs/img/expert-load-dashboard.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.engines.engine import EngineSettings, SimulatedEplb, balancedness

ROOT = Path(__file__).resolve().parent.parent
EP, SWITCH_MIN = 4, 30.0


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


def worst_layer(rank_rate: np.ndarray) -> int:
    """The dashboard's default ``$layer``: the layer with the highest busiest-rank / mean load over
    the time range (rank_rate [T, L, P])."""
    total = rank_rate.sum(axis=0)  # [L, P]
    return int(np.argmax(total.max(axis=1) / np.maximum(total.mean(axis=1), 1e-9)))


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
    bal, rr = data["balancedness"], data["rank_rate"]
    layer = worst_layer(rr)
    L = bal.shape[1]
    fig = plt.figure(figsize=(16, 9.5))
    gs = fig.add_gridspec(3, 6, height_ratios=[0.32, 1, 1], hspace=0.5, wspace=0.35,
                          left=0.04, right=0.99, top=0.9, bottom=0.06)
    fig.suptitle(f"MoE expert load  —  namespace team-a · MoEInference qwen3-vl · layer {layer} (worst first) · "
                 f"EP {EP}          (rendered from SIMULATED data, not a Grafana screenshot)",
                 x=0.04, ha="left", fontsize=12, color=fg)

    def annotate(ax: plt.Axes) -> None:
        ax.axvline(sw, color="#73bf69", lw=1.5, ls="--")
        ax.text(sw, ax.get_ylim()[1], " EPLB on (new pods)", color="#73bf69", va="top", fontsize=8)

    # Overview: stat panels over the last 5 minutes
    last = m > m[-1] - 5
    stats = (("Balancedness (mean of layers)", f"{bal[last].mean():.1%}"),
             ("Worst layer balancedness", f"{bal[last].mean(axis=0).min():.1%}"),
             ("Balancedness with EPLB off", f"{bal[m < sw].mean():.1%}"),
             ("Routed tokens/s", f"{data['expert_rate'][last].sum(axis=(1, 2)).mean():,.0f}"),
             ("MoE layers x experts", f"{L} x {data['expert_rate'].shape[2]}"),
             ("Redundant experts", "8"))
    for i, (title, value) in enumerate(stats):
        ax = fig.add_subplot(gs[0, i])
        ax.set_xticks([]), ax.set_yticks([]), ax.grid(False)
        ax.set_title(title, fontsize=8)
        ax.text(0.5, 0.4, value, ha="center", va="center", fontsize=16, color="#73bf69", transform=ax.transAxes)

    # Balance across layers: layer x time heatmap of balancedness, top-k imbalanced layers
    ax = fig.add_subplot(gs[1, :3])
    im = ax.imshow(bal.T, aspect="auto", origin="lower", cmap="RdYlGn", vmin=0, vmax=1,
                   extent=(m[0], m[-1], -0.5, L - 0.5))
    ax.grid(False)
    ax.set_title("Balancedness per layer (layer x time)")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, pad=0.01, label="balancedness")
    annotate(ax)

    ax = fig.add_subplot(gs[1, 3:])
    imb = rr.max(axis=2) / np.maximum(rr.mean(axis=2), 1e-9)  # [T, L]
    top = np.argsort(imb.mean(axis=0))[::-1][:5]
    for l in top:
        ax.plot(m, imb[:, l], lw=1.2, label=f"layer {l}")
    ax.set_title("Top 5 imbalanced layers: max / mean rank load")
    ax.legend(ncol=5, loc="upper right")
    annotate(ax)

    # Layer $layer: experts and ranks
    ax = fig.add_subplot(gs[2, :3])
    rate = data["expert_rate"][:, layer, :].T  # [E, T]
    im = ax.imshow(rate, aspect="auto", origin="lower", cmap="inferno",
                   extent=(m[0], m[-1], -0.5, rate.shape[0] - 0.5), norm=matplotlib.colors.PowerNorm(0.5))
    ax.grid(False)
    ax.set_title(f"Layer {layer}: tokens/s per expert")
    ax.set_ylabel("expert")
    ax.set_xlabel("minutes")
    fig.colorbar(im, ax=ax, pad=0.01, label="tokens/s")
    annotate(ax)

    ax = fig.add_subplot(gs[2, 3:])
    for r in range(rr.shape[2]):
        ax.plot(m, rr[:, layer, r], lw=1.2, label=f"rank {r}")
    ax.plot(m, rr[:, layer].mean(axis=1), color="white", lw=1, ls=":", label="mean")
    ax.set_title(f"Layer {layer}: tokens/s per EP rank")
    ax.set_xlabel("minutes")
    ax.legend(ncol=5, loc="upper left")
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
