"""Human output for ``moe-eplb simulate`` and ``moe-eplb tune``: rich tables and the progress bar,
plus the mapping from library errors to the command's flags."""

from __future__ import annotations

import contextlib

import click

#: library argument / error prefix -> the command-line flag that sets it
#: messages about the trace's content: the file is wrong, not a flag (exit 1, no usage text)
DATA_KEYS = frozenset({"trace", "load", "bucket_steps"})
FLAG_OF = {
    "ep_size": "--ep-size",
    "num_nodes": "--nodes",
    "num_groups": "--groups",
    "window_size": "--window",
    "step_interval": "--interval",
    "num_redundant_experts": "--redundant",
    "bounds": "--bounds",
    "memory_budget": "--memory-budget",
    "bytes_per_expert": "--bytes-per-expert",
    "current": "--current",
    "vllm_version": "--vllm-version",
    "all2all_backend": "--all2all-backend",
    "shared_expert_ratio": "--shared-expert-ratio",
    "topology": "--ep-size/--nodes/--groups",
    "step_seconds": "--trace",
    "rank_load": "--trace",
    "config": "--trace",
}


def bad_parameter(exc: Exception, default_hint: str | None = None) -> click.ClickException:
    """A click error whose hint names the flag the message's leading ``name:`` refers to."""
    msg = str(exc)
    head = msg.split(":", 1)[0].strip()
    head = head.split(".", 1)[1] if head.startswith("CostModel.") else head.split(".", 1)[0]
    if head in DATA_KEYS:
        return click.ClickException(msg)
    hint = FLAG_OF.get(head, default_hint)
    if hint:
        return click.BadParameter(msg, param_hint=hint)
    return click.ClickException(msg)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.2%}"


def print_simulation(console, trace, eplb, static) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title=f"EPLB simulation: W/I/R = {eplb.knobs.label}, ep {eplb.topology.ep_size}, "
                        f"{trace.num_buckets} buckets, {trace.total_steps} steps",
                  box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("no EPLB", justify="right")
    table.add_column(f"EPLB {eplb.knobs.label}", justify="right")
    rows = (
        ("balancedness", lambda r: f"{r.balancedness:.4f}"),
        ("predicted throughput", lambda r: f"{r.throughput.relative:.4f}"),
        ("  x imbalance", lambda r: f"{r.throughput.imbalance_factor:.4f}"),
        ("  x rearrangement overhead", lambda r: f"{r.throughput.overhead_factor:.4f}"),
        ("  x KV-cache memory", lambda r: f"{r.throughput.kv_factor:.4f}"),
        ("rearrangements", lambda r: str(r.rearrangements)),
        ("experts moved", lambda r: str(r.experts_moved)),
        ("redundant GiB per GPU", lambda r: f"{r.throughput.redundant_bytes_per_gpu / 2**30:.2f}"),
    )
    for label, fmt in rows:
        table.add_row(label, fmt(static), fmt(eplb))
    console.print(table)
    gain = eplb.throughput.relative / static.throughput.relative - 1
    worst = int(eplb.balancedness_per_layer.argmin()) if eplb.balancedness_per_layer.size else 0
    console.print(f"Predicted gain over no EPLB: [bold]{gain:+.2%}[/bold]. Least balanced layer: "
                  f"{worst} ({eplb.balancedness_per_layer[worst]:.4f}).")
    if not eplb.throughput.memory_penalty_known:
        console.print("[yellow]Expert size unknown for this shape: no KV-cache penalty counted; "
                      "pass --bytes-per-expert.[/yellow]")


def print_tune(console, result, top: int = 10) -> None:
    from rich import box
    from rich.table import Table

    d = result.to_dict()
    rec = d["recommendation"]
    table = Table(title=f"EPLB tuning: {len(result.candidates)} candidates, "
                        f"{result.policy_windows} policy windows, {result.seconds:.1f} s",
                  box=box.SIMPLE_HEAD)
    for col in ("rank", "W/I/R", "score", "throughput", "balancedness", "rearr.", "moved"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, c in enumerate(result.candidates[:top]):
        style = "bold green" if c.knobs == result.chosen.knobs else None
        table.add_row(str(i + 1), c.knobs.label, f"{c.score:.4f}", f"{c.mean:.4f}",
                      f"{c.result.balancedness:.4f}", str(c.result.rearrangements),
                      str(c.result.experts_moved), style=style)
    console.print(table)
    base = Table(title="Baselines", box=box.SIMPLE_HEAD)
    for col in ("", "W/I/R", "score", "throughput", "balancedness"):
        base.add_column(col, justify="right" if col else "left")
    no = result.no_eplb
    base.add_row("no EPLB", "-", f"{d['baselines']['no_eplb']['score']:.4f}",
                 f"{no.throughput.relative:.4f}", f"{no.balancedness:.4f}")
    for label, c in (("vLLM defaults", result.defaults), ("current", result.current),
                     ("recommended", result.pick)):
        if c is not None:
            base.add_row(label, c.knobs.label, f"{c.score:.4f}", f"{c.mean:.4f}",
                         f"{c.result.balancedness:.4f}")
    console.print(base)
    setting = ("EPLB off (spec.eplb.enabled: false)" if not result.enabled else
               f"window_size={rec['window_size']} step_interval={rec['step_interval']} "
               f"num_redundant_experts={rec['num_redundant_experts']}")
    console.print(
        f"[bold]{rec['decision'].upper()}[/bold]: {setting}"
        f"  (gain vs no EPLB {_pct(rec['gain_vs_no_eplb'])}, vs vLLM defaults "
        f"{_pct(rec['gain_vs_vllm_defaults'])}, vs current {_pct(rec['gain_vs_current'])})"
    )
    console.print(f"Reason: {rec['reason']}")
    print_advice(console, result, rec)
    mem = rec.get("memory")
    if mem is not None:
        lost = f"{mem['kv_tokens_lost']:.0f} KV tokens per GPU, " if mem.get("kv_tokens_lost") is not None else ""
        console.print(f"KV cache: the redundancy leaves {mem['capacity']:.1%} of it ({lost}prefix hit rate "
                      f"{mem['prefix_hit_rate_without_redundancy']:.1%} -> {mem['prefix_hit_rate']:.1%}); "
                      f"x {mem['batch_factor']:.4f} batch, x {mem['prefix_factor']:.4f} prefill of prefix misses")
    if d.get("robust"):
        print_robust(console, d["robust"])
    exp = rec.get("explore")
    if exp:
        console.print(f"[bold]EXPLORE[/bold]: try {exp['candidate']} on one replica against the running setting: "
                      f"{exp['parameter']} decides (regret at stake {exp['regret_at_stake']:.2%}, trial cost "
                      f"{exp['trial_cost']:.2%}). {exp['reason']}")


def print_advice(console, result, rec: dict) -> None:
    """Is EPLB worth it: EPLB OFF or REARRANGE ONLY with the predicted gain, the overlap EPLB costs,
    and what would change the answer."""
    adv = rec.get("advice") or {}
    if not result.enabled:
        on = rec.get("eplb_on") or {}
        vs_on = adv.get("off_vs_on")
        console.print(f"[bold]EPLB OFF[/bold] ({rec['decision']}): set spec.eplb.enabled: false -- predicted gain "
                      f"{_pct(rec.get('predicted_gain'))} over {rec.get('predicted_gain_vs') or '-'}, "
                      f"{_pct(vs_on)} against the best EPLB-on setting {adv.get('best_on')} (where EPLB must "
                      f"stay on: {on.get('decision', '-')} -- {on.get('reason', '')})")
    elif result.mode == "rearrange_only":
        console.print(f"[bold]REARRANGE ONLY[/bold]: EPLB on with {result.recommendation.num_redundant_experts} "
                      f"redundant experts (the fewest vLLM accepts here) every {result.recommendation.step_interval} "
                      f"steps -- predicted gain {_pct(rec.get('predicted_gain'))} over "
                      f"{rec.get('predicted_gain_vs') or '-'}, {_pct(rec.get('gain_vs_no_eplb'))} over EPLB off")
    if adv.get("overlap_dropped"):
        rng = (f" (range {adv['overlap_loss_low']:.2%}-{adv['overlap_loss_high']:.2%})"
               if adv.get("overlap_loss_high") is not None else "")
        console.print(f"Cost of being on: {adv.get('backend') or 'this backend'} runs the shared experts without "
                      f"overlap once EPLB is on: {adv['overlap_loss']:.2%} of every step{rng}")
    for line in adv.get("what_would_change") or ():
        console.print(f"What would change the answer: {line}")


def print_robust(console, robust: dict) -> None:
    """The robust decision: each parameter's range, the limiting one and what tightens it."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"Held over {robust['scenarios']} scenarios of these ranges (pick: smallest largest regret)",
                  box=box.SIMPLE_HEAD)
    for col in ("parameter", "value", "low", "high", "source"):
        table.add_column(col, justify="left" if col in ("parameter", "source") else "right")
    for name, r in robust["parameters"].items():
        table.add_row(name, _num(name, r["value"]), _num(name, r["low"]), _num(name, r["high"]), r["source"])
    console.print(table)
    worst = robust.get("worst_case_gain_vs_current")
    console.print(f"Largest regret of the choice {_pct(robust.get('max_regret'))}; worst-case gain vs current "
                  f"{_pct(worst)}; point-estimate pick {robust['point_estimate_pick']}")
    if robust.get("limiting_parameter"):
        console.print(f"Limited by {robust['limiting_parameter']} (against {robust['contender']}: "
                      f"{_pct(robust.get('limiting_effect'))} of worst case); tighten it with: {robust['tighten']}")
    else:
        console.print("No parameter's range changes the choice.")


def print_replica_costs(console, costs, replicas: int, kv_target: float) -> None:
    """``--replicas``: the KV-cache cost of each candidate's redundancy, in replicas."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"KV-cache cost of redundancy: replicas needed for today's traffic ({replicas} now, "
                        f"KV-cache target {kv_target:.0%})", box=box.SIMPLE_HEAD)
    for col in ("W/I/R", "KV cache per GPU", "replicas"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in costs:
        table.add_row(f"{c.window_size}/{c.step_interval}/{c.num_redundant_experts}", f"{c.kv_cache_gib_per_gpu:.2f} GiB",
                      "no KV cache left" if c.replicas is None else str(c.replicas))
    console.print(table)


def _num(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    if name == "kv_cache_bytes_per_gpu":
        return f"{v / 2**30:.2f} GiB"
    if name == "async_s_per_moved_byte":
        return f"{v:.3g}"
    return f"{v:.4g}"


def print_calibration(console, calibration, *, brief: bool = False) -> None:
    """The calibrated parameters (value, uncertainty, source, note); ``brief``: one line each for
    the measured ones and the names of the defaults (``tune``'s header)."""
    from rich import box
    from rich.table import Table

    params = calibration.parameters
    if brief:
        measured = [f"{n} {_num(n, p.value)} +/- {_num(n, p.uncertainty)}" for n, p in params.items()
                    if p.source == "measured"]
        defaults = [n for n, p in params.items() if p.source != "measured"]
        console.print("Calibrated from the trace's telemetry: "
                      + ("; ".join(measured) if measured else "nothing measured")
                      + (f". Defaults kept: {', '.join(defaults)}" if defaults else "")
                      + " (details: moe-eplb calibrate).")
        return
    table = Table(title="Cost model calibrated from telemetry", box=box.SIMPLE_HEAD)
    for col in ("parameter", "value", "+/-", "source", "how / why"):
        table.add_column(col, justify="right" if col in ("value", "+/-") else "left")
    for name, p in params.items():
        table.add_row(name, _num(name, p.value), _num(name, p.uncertainty), p.source, p.note,
                      style="bold" if p.source == "measured" else None)
    console.print(table)
    mode = "async" if calibration.use_async else "sync" if calibration.use_async is not None else "not recorded"
    console.print(f"Rearrangement mode: {mode}. Measured: {', '.join(calibration.measured) or 'nothing'}.")
    m = calibration.memory
    if m is not None:
        hit = "no prefix-cache telemetry" if not m.prefix_measured else f"prefix hit rate {m.hit_rate:.1%} at " \
              f"{m.free:.2f} caches free"
        console.print(f"KV memory model: demand from KV usage; {hit}; "
                      + "; ".join(f"{k} {_num(k, v)}" for k, v in m.values.items() if k != "kv_demand"))
    if calibration.ranges:
        ranges = Table(title="Ranges a tuning decision holds over", box=box.SIMPLE_HEAD)
        for col in ("parameter", "value", "low", "high", "source"):
            ranges.add_column(col, justify="left" if col in ("parameter", "source") else "right")
        for name, r in calibration.ranges.items():
            ranges.add_row(name, _num(name, r.value), _num(name, r.low), _num(name, r.high), r.source)
        console.print(ranges)


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str = "replaying"):
    """Yield a ``progress(done, total)`` callback drawing a rich bar on stderr (or None)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
