"""Exporter overhead on the real engine, measured two ways (shared by bench/bench_exporter_real.py
and scripts/e2e_vllm_cpu.sh; see the benchmark's docstring for the method)."""

from __future__ import annotations

import statistics
import time

from . import harness

TARGET_PCT = 1.0


def itl(engine: harness.Engine) -> tuple[float, float]:
    s = harness.Samples(engine.vllm_metrics_text())
    return (s.total("vllm:inter_token_latency_seconds_sum"), s.total("vllm:inter_token_latency_seconds_count"))


def exporter_totals(engine: harness.Engine, timeout: float = 20.0) -> dict:
    """Per-worker exporter totals (its snapshot files) once the idle flush has exported every step
    vLLM ran: ``{ep_rank: {exporter_seconds, steps, step_seconds}}``."""
    from moe_eplb.exporter import snapshot

    deadline = time.monotonic() + timeout
    while True:
        target = engine.vllm_steps()
        workers = snapshot.read_all(engine.exporter_dir)
        if workers and all(w.models[0].steps == target for w in workers):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"exporter snapshots did not reach {target} steps")
        time.sleep(0.25)
    return {w.models[0].ep_rank: {"exporter_seconds": w.exporter_seconds, "steps": w.recorded_steps,
                                  "step_seconds": w.models[0].step_seconds_sum} for w in workers}


def prompts(n: int) -> list[str]:
    return [harness.PROMPTS[i % len(harness.PROMPTS)] + f" #{i}" for i in range(n)]


def one_run(engine: harness.Engine, n: int, tokens: int, concurrency: int) -> float:
    """Mean decode step (inter-token latency) of one run, seconds."""
    s0, c0 = itl(engine)
    engine.run_requests(prompts(n), tokens, concurrency)
    s1, c1 = itl(engine)
    return (s1 - s0) / (c1 - c0)


def measure(with_exporter: harness.Engine, without: harness.Engine | None, runs: int = 7, requests: int = 8,
            tokens: int = 64, concurrency: int = 4) -> dict:
    """Alternate runs on the two engines (``without=None``: in-engine figure only)."""
    engines = [("with", with_exporter)] + ([("without", without)] if without is not None else [])
    for _, e in engines:  # warm: first forwards, prefix cache of the prompts
        one_run(e, requests, 8, concurrency)
    base = exporter_totals(with_exporter)
    itls: dict[str, list[float]] = {name: [] for name, _ in engines}
    for _ in range(runs):
        for name, e in engines:
            itls[name].append(one_run(e, requests, tokens, concurrency))
    end = exporter_totals(with_exporter)
    ranks = {}
    for r in sorted(end):
        d = {k: end[r][k] - base[r][k] for k in end[r]}
        ranks[r] = {"steps": d["steps"], "exporter_us_per_step": 1e6 * d["exporter_seconds"] / d["steps"],
                    "step_ms": 1e3 * d["step_seconds"] / d["steps"],
                    "overhead_pct": 100.0 * d["exporter_seconds"] / d["step_seconds"]}
    out = {"engine": harness.LABEL, "runs": runs, "requests": requests, "tokens": tokens,
           "concurrency": concurrency, "itl_ms": {k: [1e3 * x for x in v] for k, v in itls.items()},
           "in_engine": ranks,
           "exporter_step_overhead_pct": statistics.mean(x["overhead_pct"] for x in ranks.values())}
    if without is not None:
        a, b = statistics.median(itls["with"]), statistics.median(itls["without"])
        out["ab_overhead_pct"] = 100.0 * (a / b - 1.0)
        out["ab_spread_pct"] = 100.0 * (max(itls["without"]) - min(itls["without"])) / b
    return out


def table(res: dict) -> str:
    lines = [f"Exporter overhead on the real engine ({res['engine']}): {res['runs']} runs per arm, "
             f"{res['requests']} requests x {res['tokens']} tokens, {res['concurrency']} in flight", "",
             "| run | decode step with exporter (ms) | without (ms) |", "| --- | --- | --- |"]
    w, wo = res["itl_ms"]["with"], res["itl_ms"].get("without", [])
    for i in range(len(w)):
        lines.append(f"| {i + 1} | {w[i]:.2f} | {wo[i]:.2f} |" if wo else f"| {i + 1} | {w[i]:.2f} | - |")
    if wo:
        lines.append(f"| median | {statistics.median(w):.2f} | {statistics.median(wo):.2f} |")
        lines += ["", f"A/B: {res['ab_overhead_pct']:+.2f} % (run-to-run spread without the exporter: "
                      f"{res['ab_spread_pct']:.1f} %)"]
    lines += ["", "| EP rank | steps | exporter per step (us) | mean step (ms) | exporter share of the step |",
              "| --- | --- | --- | --- | --- |"]
    for r, x in res["in_engine"].items():
        lines.append(f"| {r} | {x['steps']} | {x['exporter_us_per_step']:.1f} | {x['step_ms']:.2f} | "
                     f"{x['overhead_pct']:.3f} % |")
    lines += ["", f"exporter_step_overhead_pct = {res['exporter_step_overhead_pct']:.3f} (target < {TARGET_PCT} %)"]
    return "\n".join(lines)
