"""``moe-eplb rebalance | simulate | tune | trace``: the EPLB math on the command line.

Shared module: each command lives in its own ``_add_<name>(main)`` function, owned by the engineer
of that area; ``register`` calls them all. Heavy imports stay inside the command bodies.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from moe_eplb.contracts import vllm_facts


def register(main: click.Group) -> None:
    _add_rebalance(main)
    _add_trace(main)
    _add_simulate(main)
    _add_tune(main)
    _add_calibrate(main)


# --- rebalance (policy) ------------------------------------------------------------------------

_REBALANCE_FLAGS = {
    "num_replicas": "--replicas",
    "num_groups": "--groups",
    "num_nodes": "--nodes",
    "num_gpus": "--gpus",
    "weight": "--weights",
}


#: Most bytes of a ``--weights`` file (a [1024][4096] table of 12-digit numbers is ~55 MB).
MAX_WEIGHTS_BYTES = 64 * 2**20


def _read_weights(path: str) -> list:
    """The ``--weights`` file: JSON, a 2-D list ``[L][E]`` of finite numbers, read bounded
    (:mod:`moe_eplb.contracts.bounded_read`: size, values, depth, duplicate keys, NaN/Infinity)."""
    from moe_eplb.contracts import bounded_read

    try:
        data = bounded_read.parse_json(bounded_read.read_bytes(path, max_bytes=MAX_WEIGHTS_BYTES, gz=False,
                                                               what="weights file"), path, need_depth=2)
    except bounded_read.InputError as exc:
        raise click.BadParameter(str(exc), param_hint="--weights") from None
    if not isinstance(data, list) or not data or not all(isinstance(row, list) for row in data) or not data[0]:
        raise click.BadParameter(
            f"{path} must hold a non-empty 2-D list [layers][experts] of numbers",
            param_hint="--weights",
        )
    width = len(data[0])
    for i, row in enumerate(data):
        if len(row) != width:
            raise click.BadParameter(
                f"{path}: row {i} has {len(row)} experts, row 0 has {width}; every layer needs "
                "the same number of experts",
                param_hint="--weights",
            )
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                    or value in (float("inf"), float("-inf")):
                raise click.BadParameter(
                    f"{path}: [{i}][{j}] is {repr(value)[:40]}, not a finite number", param_hint="--weights"
                )
    return data


def _add_rebalance(main: click.Group) -> None:
    @main.command("rebalance")
    @click.option("--weights", "weights_path", required=True, metavar="FILE.json",
                  help="JSON 2-D list [layers][experts]: load (tokens) of each logical expert.")
    @click.option("--replicas", type=int, required=True,
                  help="Physical expert slots (logical + redundant), a multiple of --gpus.")
    @click.option("--groups", type=int, required=True,
                  help="Expert groups (DeepSeek-V3: 8; use 1 for models without groups).")
    @click.option("--nodes", type=int, required=True, help="Nodes (hierarchical if groups % nodes == 0).")
    @click.option("--gpus", type=int, required=True, help="GPUs, i.e. EP ranks.")
    def rebalance_cmd(weights_path: str, replicas: int, groups: int, nodes: int, gpus: int) -> None:
        """Place experts on GPUs exactly as vLLM's default EPLB policy does.

        Prints JSON {"phy2log": [[...]], "logcnt": [[...]]}: for each layer, the logical expert of
        each physical slot (GPU-major: slots g*S..(g+1)*S-1 are GPU g's, S = replicas / gpus) and
        the replica count of each logical expert.
        """
        from moe_eplb.eplb.replay.policy import PolicyError, rebalance

        weights = _read_weights(weights_path)
        experts = len(weights[0])
        limit = experts + vllm_facts.MAX_REDUNDANT_EXPERTS
        if not experts <= replicas <= limit:
            raise click.BadParameter(f"{replicas} slots for {experts} experts: vLLM allows {experts} to {limit} "
                                     f"(experts + at most {vllm_facts.MAX_REDUNDANT_EXPERTS} redundant)",
                                     param_hint="--replicas")
        try:
            phy2log, _, logcnt = rebalance(weights, replicas, groups, nodes, gpus)
        except PolicyError as exc:
            hint = _REBALANCE_FLAGS.get(exc.param, exc.param)
            reason = f"{weights_path}: {exc.reason}" if exc.param == "weight" else exc.reason
            raise click.BadParameter(reason, param_hint=hint) from None
        json.dump({"phy2log": phy2log.tolist(), "logcnt": logcnt.tolist()}, sys.stdout)
        sys.stdout.write("\n")


# --- trace (load traces and the workload generator) ---------------------------------------------


def _trace_error(exc: Exception, hint: str | None = None) -> click.ClickException:
    """A problem with a flag's value -> usage error naming the flag (exit 2); with a file's content
    -> a plain error (exit 1, no "Try --help": the flags were right)."""
    if hint:
        return click.BadParameter(str(exc), param_hint=hint)
    return click.ClickException(str(exc))


def _report_dir(path: str | None) -> Path | None:
    """``--report DIR``, made sure to be usable BEFORE the work: a directory (created if needed),
    not an existing file, writable."""
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise click.BadParameter(f"{path} exists and is not a directory; give a directory for the report",
                                 param_hint="--report")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".moe-eplb-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise click.BadParameter(f"cannot write the report into {path}: {exc.strerror or exc}",
                                 param_hint="--report") from None
    return out


def _add_trace(main: click.Group) -> None:
    @main.group("trace")
    def trace_group() -> None:
        """Load traces: generate realistic ones, and inspect trace files."""

    for add in (_add_trace_profiles, _add_trace_synth, _add_trace_from_prometheus, _add_trace_info):
        add(trace_group)


def _add_trace_profiles(trace_group: click.Group) -> None:
    """``trace profiles``: the generator's profiles and model shapes."""

    @trace_group.command("profiles")
    def trace_profiles_cmd() -> None:
        """List the generator's built-in profiles and model shapes."""
        from moe_eplb.eplb.workload import synth

        for name in synth.list_profiles():
            prof = synth.get_profile(name)
            click.echo(f"{name:<34} {prof.description}")
        click.echo("")
        for name, (layers, experts, groups, top_k) in synth.MODEL_SHAPES.items():
            click.echo(f"{name:<34} {layers} MoE layers x {experts} experts, {groups} group(s), top-{top_k}")


def _add_trace_synth(trace_group: click.Group) -> None:
    """``trace synth``: generate a trace from real expert popularity."""

    @trace_group.command("synth")
    @click.option("--profile", "profile_name", required=True, metavar="NAME",
                  help="Built-in workload profile (see `moe-eplb trace profiles`).")
    @click.option("--model-shape", metavar="SHAPE", default=None,
                  help="Target shape: deepseek-v3 or qwen3-vl-30b-a3b (default: the profile's).")
    @click.option("--hours", type=float, default=1.0, show_default=True, help="Trace length.")
    @click.option("--bucket-seconds", type=float, default=15.0, show_default=True, help="Seconds per bucket.")
    @click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same trace.")
    @click.option("--shift-at", type=float, default=None, metavar="FRACTION",
                  help="Where the first domain-mix shift happens, as a fraction of the trace (shifting profiles).")
    @click.option("--from", "sources", multiple=True, metavar="FILE",
                  help="Real routing data to fit on instead of the shipped fits: an expert_counts_by_domain "
                       "JSON (popularity) and/or token_routing_sequence JSON (time structure). Repeatable.")
    @click.option("-o", "--output", required=True, metavar="OUT.json|.json.gz|.npz", help="Trace file to write.")
    def trace_synth_cmd(profile_name, model_shape, hours, bucket_seconds, seed, shift_at, sources, output) -> None:
        """Generate a load trace from real expert popularity (see docs/traces.md)."""
        from moe_eplb.eplb.workload import synth, tracefile
        from moe_eplb.eplb.workload.trace import TraceError

        if profile_name not in synth.list_profiles():
            raise click.BadParameter(
                f"unknown profile {profile_name!r}; choose one of: {', '.join(synth.list_profiles())}",
                param_hint="--profile",
            )
        if model_shape is not None and model_shape not in synth.MODEL_SHAPES:
            raise click.BadParameter(
                f"unknown shape {model_shape!r}; choose one of: {', '.join(synth.MODEL_SHAPES)}",
                param_hint="--model-shape",
            )
        try:
            tracefile.trace_suffix(output)
        except TraceError as exc:
            raise _trace_error(exc, "--output") from None
        _check_synth_size(profile_name, model_shape, hours, bucket_seconds)
        try:
            trace = synth.generate(
                profile_name, model_shape=model_shape, hours=hours, bucket_seconds=bucket_seconds,
                seed=seed, shift_at=shift_at, source=list(sources) or None,
            )
        except synth.SynthError as exc:
            msg = str(exc)
            hint = {"shift_at": "--shift-at", "hours": "--hours", "bucket_seconds": "--bucket-seconds",
                 "model_shape": "--model-shape", "seed": "--seed", "source": "--from"}.get(
                msg.split(":", 1)[0], "--from" if sources and msg.startswith("profile: domain") else None)
            raise _trace_error(exc, hint) from None
        except TraceError as exc:
            raise _trace_error(exc, "--from" if sources else None) from None
        try:
            tracefile.save_trace(trace, output)
        except OSError as exc:
            raise click.BadParameter(f"cannot write {output}: {exc.strerror or exc}", param_hint="--output") from None
        s = trace.summary()
        click.echo(
            f"wrote {output}: {s['num_buckets']} buckets x {s['num_layers']} layers x {s['num_experts']} experts, "
            f"{s['total_steps']} steps, max/mean per layer {s['imbalance_per_layer']['min']:.2f}"
            f"-{s['imbalance_per_layer']['max']:.2f}",
            err=True,
        )


def _add_trace_from_prometheus(trace_group: click.Group) -> None:
    """``trace from-prometheus``: a MoEInference's load read from Prometheus."""

    @trace_group.command("from-prometheus")
    @click.option("--url", required=True, help="Prometheus base URL, e.g. http://prometheus-operated.monitoring:9090.")
    @click.option("--namespace", default="default", show_default=True, help="Namespace of the MoEInference.")
    @click.option("--name", required=True, help="Name of the MoEInference (the series' moeinference label).")
    @click.option("--hours", type=float, default=1.0, show_default=True, help="How much history to read.")
    @click.option("--bucket-seconds", type=float, default=15.0, show_default=True, help="Seconds per bucket.")
    @click.option("--end", type=float, default=None, metavar="UNIX_SECONDS",
                  help="End of the window (default: now).")
    @click.option("--model", default=None, help="Served model name to read (default: the only one, or the main model).")
    @click.option("-o", "--output", required=True, metavar="OUT.json|.json.gz|.npz", help="Trace file to write.")
    def trace_from_prometheus_cmd(url, namespace, name, hours, bucket_seconds, end, model, output) -> None:
        """Read a MoEInference's expert load from Prometheus into a trace file (the operator's reader:
        raw counter samples, exact per bucket; restarts, joins and scrape gaps handled)."""
        from moe_eplb.eplb.workload import tracefile
        from moe_eplb.eplb.workload.trace import TraceError
        from moe_eplb.metrics.errors import LoadReadError
        from moe_eplb.metrics.reader import read_load_trace

        try:
            tracefile.trace_suffix(output)
        except TraceError as exc:
            raise _trace_error(exc, "--output") from None
        if not (hours > 0 and bucket_seconds > 0):
            raise click.BadParameter("must be > 0", param_hint="--hours/--bucket-seconds")
        try:
            trace = read_load_trace(prometheus_url=url, namespace=namespace, name=name, window_seconds=hours * 3600,
                                    bucket_seconds=bucket_seconds, now=end, model=model)
        except LoadReadError as exc:
            raise click.ClickException(f"{exc.reason}: {exc.message}") from None
        try:
            tracefile.save_trace(trace, output)
        except OSError as exc:
            raise click.BadParameter(f"cannot write {output}: {exc.strerror or exc}", param_hint="--output") from None
        spread = trace.meta.get("interpolated_fraction", 0.0)
        click.echo(f"wrote {output}: {trace.num_buckets} buckets x {trace.num_layers} layers x {trace.num_experts} "
                   f"experts, {trace.total_steps} engine steps, model {trace.model or '?'}"
                   + (f"; {spread:.1%} of the load spread over scrape gaps" if spread else ""), err=True)


def _add_trace_info(trace_group: click.Group) -> None:
    """``trace info``: what a trace or routing data file holds."""

    @trace_group.command("info")
    @click.argument("path", metavar="FILE")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    @_max_trace_option
    def trace_info_cmd(path: str, as_json: bool, max_trace_bytes: int) -> None:
        """Shape, steps and expert imbalance of a trace file (.json, .json.gz, .npz) or of a real
        routing data file (expert counts by domain, token routing)."""
        from moe_eplb.eplb.workload import tracefile
        from moe_eplb.eplb.workload.trace import TraceError

        try:
            if path.lower().endswith((".json", ".json.gz")) and _is_routing_file(path):
                info = _routing_info(tracefile.read_routing_file(path))
            else:
                trace = tracefile.load_trace(path, max_bytes=max_trace_bytes)
                info = trace.summary()
                if trace.meta.get("warnings"):
                    info["warnings"] = list(trace.meta["warnings"])
        except TraceError as exc:
            raise _trace_error(exc) from None
        if as_json:
            json.dump(info, sys.stdout, indent=1)
            sys.stdout.write("\n")
            return
        for key, value in info.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
            elif key == "warnings":
                value = "; ".join(value)
            elif isinstance(value, float):
                value = f"{value:.6g}"
            click.echo(f"{key:<22} {value}")


#: Largest trace ``trace synth`` generates: the generator's peak memory is ~2.5x the trace
#: (measured: 8 h of Qwen3-VL, a 94 MB trace, peaks at 236 MB), so 1 GiB stays under 3 GiB.
MAX_SYNTH_BYTES = 2**30


def _check_synth_size(profile_name: str, model_shape: str | None, hours: float, bucket_seconds: float) -> None:
    """Refuse, before generating, a trace too large to generate in reasonable memory."""
    from moe_eplb.eplb.workload import synth

    if not (hours > 0 and bucket_seconds > 0):
        return  # the generator names the flag
    shape = synth.MODEL_SHAPES[model_shape or synth.get_profile(profile_name).model_shape]
    buckets = int(hours * 3600 // bucket_seconds)
    nbytes = buckets * shape[0] * shape[1] * 8
    if nbytes > MAX_SYNTH_BYTES:
        most = MAX_SYNTH_BYTES / (shape[0] * shape[1] * 8) * bucket_seconds / 3600
        raise click.BadParameter(
            f"{hours:g} h of {bucket_seconds:g} s buckets of a {shape[0]} x {shape[1]} model is {nbytes / 2**30:.1f} GiB "
            f"in memory; at most {MAX_SYNTH_BYTES / 2**30:.0f} GiB are generated: use at most {most:.0f} h, or "
            "longer buckets (--bucket-seconds)", param_hint="--hours")


def _is_routing_file(path: str) -> bool:
    import gzip

    try:
        opener = gzip.open if path.lower().endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            head = fh.read(4096)
    except (OSError, EOFError, UnicodeDecodeError, ValueError):  # unreadable: load_trace says why
        return False
    return '"kind"' in head and ("expert_counts_by_domain" in head or "token_routing_sequence" in head)


def _routing_info(data) -> dict:
    """Summary of a real routing data file (plain numbers)."""
    import numpy as np

    from moe_eplb.eplb.workload import profiles, tracefile

    if isinstance(data, tracefile.DomainCounts):
        fit = profiles.fit_popularity(data)
        return {
            "kind": tracefile.KIND_EXPERT_COUNTS,
            "model": data.model,
            "num_experts": data.num_experts,
            "top_k": data.top_k,
            "layers": list(data.layers),
            "domains": list(data.domains),
            "max_over_mean": {d: [round(float(x), 3) for x in v] for d, v in fit.max_over_mean.items()},
            "tv_between_domains": {
                f"layer {layer}": [round(float(fit.tv[i][np.triu_indices(len(data.domains), 1)].min()), 3),
                                   round(float(fit.tv[i][np.triu_indices(len(data.domains), 1)].max()), 3)]
                if len(data.domains) > 1 else None
                for i, layer in enumerate(data.layers)
            },
        }
    temporal = profiles.fit_temporal([data])
    return {
        "kind": tracefile.KIND_TOKEN_ROUTING,
        "model": data.model,
        "num_experts": data.num_experts,
        "top_k": data.top_k,
        "num_layers": data.num_layers,
        "tokens": int(data.choices.shape[0]),
        "requests": int(len(np.unique(data.sequence_id))),
        "lag1_autocorrelation": round(temporal.lag1, 4),
        "kappa": round(temporal.kappa, 2),
    }


# --- simulate and tune (simulator, tuner) ------------------------------------------------------


def _max_trace_option(fn):
    from moe_eplb.contracts.trace_format import MAX_TRACE_BYTES

    return click.option("--max-trace-bytes", type=click.IntRange(1), default=MAX_TRACE_BYTES, show_default=True,
                        help="Most bytes the trace may take: on disk, as JSON text, and as float64 arrays "
                             "(simulate and tune need about 3x that at peak).")(fn)


def _load_trace_arg(path: str, max_bytes: int | None = None):
    from moe_eplb.contracts.trace_format import MAX_TRACE_BYTES
    from moe_eplb.eplb.workload.trace import TraceError
    from moe_eplb.eplb.workload.tracefile import load_trace

    try:
        trace = load_trace(path, max_bytes=max_bytes or MAX_TRACE_BYTES)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None  # the file is wrong, not the flag: exit 1
    for warning in trace.meta.get("warnings", ()):  # physical consistency (docs/traces.md)
        click.echo(f"Warning: {path}: {warning}", err=True)
    return trace


def _topology_options(fn):
    fn = click.option("--groups", type=int, default=1, show_default=True,
                      help="Expert groups (DeepSeek-V3: 8; 1 for models without groups).")(fn)
    fn = click.option("--nodes", type=int, default=1, show_default=True,
                      help="Nodes the EP ranks span (hierarchical policy when groups % nodes == 0).")(fn)
    fn = click.option("--ep-size", type=int, required=True, help="Expert-parallel size (GPUs).")(fn)
    fn = click.option("--trace", "trace_path", required=True, metavar="FILE",
                      help="Load trace (.json, .json.gz or .npz; see docs/traces.md).")(fn)
    return _max_trace_option(fn)


def _cost_options(fn):
    fn = click.option("--bytes-per-expert", type=float, default=None,
                      help="Bytes of one expert in one MoE layer (default: known for DeepSeek-V3 and "
                           "Qwen3-VL-30B-A3B shapes).")(fn)
    fn = click.option("--sync", "sync_mode", is_flag=True,
                      help="Model sync rearrangement (stall per rearrangement) instead of async.")(fn)
    return fn


def _worth_options(fn):
    """``tune``'s options on whether EPLB is worth it: the shared-expert overlap it costs, EPLB off."""
    fn = click.option("--no-off", "no_off", is_flag=True,
                      help="Never recommend EPLB off (spec.eplb.enabled: false); rearrange-only stays a candidate.")(fn)
    fn = click.option("--shared-expert-ratio", type=float, default=None,
                      help="The shared experts' compute over the routed experts' per token (default: the model "
                           "catalog's; DeepSeek-V3 0.125, 0 for models without shared experts).")(fn)
    fn = click.option("--gpu-vendor", type=click.Choice(["nvidia", "amd"]), default=None,
                      help="The GPUs (which overlap-safe backends the advice names; default: any).")(fn)
    fn = click.option("--vllm-version", default=None, metavar="X.Y.Z",
                      help="The engine's vLLM (its rule for the overlap; default: the newest release read).")(fn)
    fn = click.option("--all2all-backend", default=None, metavar="NAME",
                      help="The engine's --all2all-backend (default vLLM's, allgather_reducescatter): with EPLB on, "
                           "most backends run the shared experts without overlap, which the tuner prices.")(fn)
    fn = click.option("--model", default=None, metavar="NAME",
                      help="Catalog model (Hugging Face id) for its shared experts; default: the trace's model.")(fn)
    return fn


def _add_simulate(main: click.Group) -> None:
    @main.command("simulate")
    @_topology_options
    @click.option("--window", type=int, required=True, help="EPLB window_size (steps).")
    @click.option("--interval", type=int, required=True, help="EPLB step_interval (steps).")
    @click.option("--redundant", type=click.IntRange(0, vllm_facts.MAX_REDUNDANT_EXPERTS), required=True,
                  help="EPLB num_redundant_experts (0..1023, vLLM's limit).")
    @_cost_options
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
    @click.option("--report", "report_dir", default=None, metavar="DIR",
                  help="Write plots and summary.md to DIR.")
    def simulate_cmd(trace_path, max_trace_bytes, ep_size, nodes, groups, window, interval, redundant,
                     bytes_per_expert, sync_mode, as_json, report_dir) -> None:
        """Replay vLLM's EPLB over a load trace and predict balancedness and throughput.

        Rearranges every --interval steps from the last --window steps of load (first after
        interval/4 steps, as vLLM does) with vLLM's default policy, and compares with no EPLB.
        """
        from moe_eplb.api.knobs import Knobs
        from moe_eplb.cli.tune_output import bad_parameter, print_simulation
        from moe_eplb.eplb.replay.costmodel import CostModel
        from moe_eplb.eplb.replay.simulator import Replay, SimError, Topology

        _report_dir(report_dir)
        trace = _load_trace_arg(trace_path, max_trace_bytes)
        try:
            cost = CostModel(use_async=not sync_mode, bytes_per_expert=bytes_per_expert)
            replay = Replay(trace, Topology(ep_size, nodes, groups), cost)
            eplb = replay.run(Knobs(window, interval, redundant))
            static = replay.run_static()
        except (SimError, ValueError) as exc:
            raise bad_parameter(exc) from None
        if report_dir:
            from moe_eplb.eplb.tuning.report import write_simulation_report

            write_simulation_report(report_dir, trace, eplb, static)
        if as_json:
            gain = eplb.throughput.relative / static.throughput.relative - 1
            json.dump({"eplb": eplb.to_dict(), "no_eplb": static.to_dict(),
                       "gain_vs_no_eplb": gain, "cost_model": cost.to_dict()}, sys.stdout)
            sys.stdout.write("\n")
            return
        from rich.console import Console

        print_simulation(Console(), trace, eplb, static)
        if report_dir:
            click.echo(f"Report written to {Path(report_dir) / 'summary.md'}")


def _add_tune(main: click.Group) -> None:
    @main.command("tune")
    @_topology_options
    @click.option("--memory-budget", default=None, metavar="BYTES_PER_GPU",
                  help="Memory each GPU may spend on redundant experts: bytes or 8Gi / 500M.")
    @click.option("--bounds", "bounds_text", default=None,
                  metavar="window=LO:HI,interval=LO:HI,redundant=LO:HI",
                  help="Search ranges, e.g. window=500:5000,interval=500:10000,redundant=0:32.")
    @click.option("--current", "current_text", default=None, metavar="W,I,R|off",
                  help="The running window,interval,redundant (or off: EPLB runs off now); changed only if the "
                       "gain pays a restart.")
    @_cost_options
    @_worth_options
    @click.option("--min-gain", type=float, default=0.005, show_default=True,
                  help="Extra relative gain required before recommending a change.")
    @click.option("--workers", type=int, default=1, show_default=True,
                  help="Processes for policy calls.")
    @click.option("--no-calibrate", "no_calibrate", is_flag=True,
                  help="Keep the cost model's constants even when the trace has telemetry.")
    @click.option("--no-robust", "no_robust", is_flag=True,
                  help="Decide on the calibrated point estimate alone, not over the parameters' ranges.")
    @click.option("--min-steps", type=click.IntRange(1), default=None,
                  help="Fewest engine steps to tune on (default: the operator's InsufficientData threshold, "
                       "2000). Lower it only for short experiments: the recommendation then rests on little data.")
    @click.option("--replicas", type=click.IntRange(1), default=None,
                  help="Replicas (replica groups) serving the trace's traffic now: adds, per candidate, the KV-cache "
                       "cost of its redundancy in replicas (needs the trace's KV-cache telemetry), and prices a "
                       "trial on one of them (the exploration line).")
    @click.option("--kv-target", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                  help="With --replicas: the KV-cache usage the autoscaler holds (its KVCacheUsage target; 1 = full).")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
    @click.option("--report", "report_dir", default=None, metavar="DIR",
                  help="Write plots and summary.md to DIR.")
    def tune_cmd(trace_path, max_trace_bytes, ep_size, nodes, groups, memory_budget, bounds_text, current_text,
                 bytes_per_expert, sync_mode, min_gain, workers, no_calibrate, no_robust, min_steps, replicas, kv_target,
                 as_json, report_dir, **worth) -> None:
        """Search window x interval x redundancy for the best drift-robust predicted throughput.

        Prints the recommendation (keep or change), every evaluated candidate ranked, and the
        baselines (no EPLB, vLLM defaults 1000/3000/0, current). A trace with telemetry calibrates
        the cost model first (see `moe-eplb calibrate`; --no-calibrate keeps the constants), the
        decision then holds over the ranges of what the telemetry cannot pin down (--no-robust:
        the point estimate decides), and its recorded config is the current configuration unless
        --current is given. EPLB off is a candidate like any setting (--no-off: never): with
        --all2all-backend, the shared-expert overlap EPLB turns off there is priced, and the advice
        says EPLB OFF or REARRANGE ONLY with its predicted gain and what would change the answer.
        """
        from moe_eplb.cli.tune_args import overlap_context, parse_knobs, tune_options
        from moe_eplb.cli.tune_output import bad_parameter, print_calibration, print_tune, progress_bar
        from moe_eplb.eplb.replay.costmodel import CostModel
        from moe_eplb.eplb.replay.simulator import SimError
        from moe_eplb.eplb.tuning.tuner import MIN_TUNE_STEPS, TuneError, tune

        _report_dir(report_dir)
        trace = _load_trace_arg(trace_path, max_trace_bytes)
        calibration, notes = None, []
        try:
            options = tune_options(ep_size=ep_size, nodes=nodes, groups=groups, memory_budget=memory_budget,
                                   bounds=bounds_text, bytes_per_expert=bytes_per_expert, min_gain=min_gain,
                                   workers=workers, min_steps=min_steps, replicas=replicas)
            current_on = (current_text or "").strip().lower() != "off"
            current = parse_knobs(current_text) if current_text and current_on else None
            overlap = overlap_context(trace.model, model=worth["model"], backend=worth["all2all_backend"],
                                      version_text=worth["vllm_version"], vendor=worth["gpu_vendor"],
                                      shared_expert_ratio=worth["shared_expert_ratio"], nodes=nodes, ep_size=ep_size)
            options = dataclasses.replace(options, overlap=overlap, allow_off=not worth["no_off"])
            cost = CostModel(use_async=not sync_mode)
            tel = trace.telemetry
            if current is None and tel is not None and tel.config is not None:
                if tel.config.ep_size in (None, ep_size):
                    current = tel.config.knobs
                    notes.append(f"current configuration {current.label}: the trace's recorded config")
                else:
                    notes.append(f"the trace's recorded config ran on ep_size {tel.config.ep_size}, not "
                                 f"{ep_size}: not taken as the current configuration")
            if tel is not None and not no_calibrate:
                calibration, cost = _calibrated(trace, cost, nodes, groups, bytes_per_expert, sync_mode)
            with progress_bar(not as_json and sys.stderr.isatty(), "tuning") as progress:
                result = tune(trace, options, current=current, cost=cost, progress=progress,
                              robust=calibration.robustness() if calibration is not None and not no_robust else None,
                              current_enabled=current_on)
            if options.min_steps < MIN_TUNE_STEPS:
                notes.append(f"--min-steps {options.min_steps}: tuned on {trace.total_steps} engine steps, fewer than the "
                             f"{MIN_TUNE_STEPS} the operator requires; treat the recommendation as an experiment")
        except (TuneError, SimError, ValueError) as exc:
            raise bad_parameter(exc) from None
        costs = _replica_costs(trace, result, replicas, kv_target, bytes_per_expert or cost.bytes_per_expert,
                               ep_size) if replicas else None
        if report_dir:
            from moe_eplb.eplb.tuning.report import write_tune_report

            write_tune_report(report_dir, trace, result)
        if as_json:
            out = result.to_dict()
            if costs is not None:
                out["replica_costs"] = [c.to_dict() for c in costs]
            if calibration is not None:
                out["calibration"] = calibration.to_dict()
            if notes:
                out["notes"] = notes
            json.dump(out, sys.stdout)
            sys.stdout.write("\n")
            return
        from rich.console import Console

        console = Console()
        if calibration is not None:
            print_calibration(console, calibration, brief=True)
        for note in notes:
            console.print(f"Note: {note}")
        print_tune(console, result)
        if costs is not None:
            from moe_eplb.cli.tune_output import print_replica_costs

            print_replica_costs(console, costs, replicas, kv_target)
        if report_dir:
            click.echo(f"Report written to {Path(report_dir) / 'summary.md'}")


def _replica_costs(trace, result, replicas: int, kv_target: float, bytes_per_expert: float | None, ep_size: int):
    """``moe-eplb tune --replicas``: each candidate's redundancy priced in replicas at the trace's
    KV-cache use (:func:`moe_eplb.eplb.replay.capacity.candidate_costs`)."""
    from moe_eplb.eplb.replay.capacity import candidate_costs, capacity_from_trace

    running = result.current.knobs if result.current is not None else None
    cap = capacity_from_trace(trace, replicas=replicas, target=kv_target,
                              redundant=running.num_redundant_experts if running is not None else 0)
    if cap is None:
        raise click.BadParameter("the trace has no KV-cache telemetry (kv_cache_usage and kv_cache_bytes_per_gpu): "
                                 "record one from a deployment with the exporter, or leave --replicas out",
                                 param_hint="--replicas")
    if not bytes_per_expert:
        raise click.BadParameter("the size of one expert is needed to price redundancy in KV cache: "
                                 "give --bytes-per-expert", param_hint="--replicas")
    return candidate_costs(result, cap, num_moe_layers=trace.num_layers, bytes_per_expert=bytes_per_expert,
                           ep_size=ep_size)


def _calibrated(trace, cost, nodes: int, groups: int, bytes_per_expert: float | None, sync_flag: bool):
    """(Calibration, calibrated cost model) of a trace with telemetry; ``--sync`` wins over the
    recorded mode."""
    from dataclasses import replace

    from moe_eplb.eplb.tuning.calibrate import calibrate

    if bytes_per_expert is not None:
        cost = replace(cost, bytes_per_expert=float(bytes_per_expert))
    calibration = calibrate(trace, cost=cost, num_nodes=nodes, num_groups=groups)
    cost = calibration.apply(cost)
    if sync_flag:
        cost = replace(cost, use_async=False)
    return calibration, cost


def _add_calibrate(main: click.Group) -> None:
    @main.command("calibrate")
    @click.option("--trace", "trace_path", required=True, metavar="FILE",
                  help="Load trace with telemetry (.json, .json.gz or .npz; see docs/traces.md).")
    @click.option("--nodes", type=int, default=1, show_default=True,
                  help="Nodes the EP ranks span (replay of the recorded config, async mode).")
    @click.option("--groups", type=int, default=1, show_default=True,
                  help="Expert groups (DeepSeek-V3: 8; 1 for models without groups).")
    @_cost_options
    @_max_trace_option
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
    def calibrate_cmd(trace_path, nodes, groups, bytes_per_expert, sync_mode, max_trace_bytes, as_json) -> None:
        """Fit the cost model to a trace's telemetry: the MoE share of a step, the rearrangement
        cost and the KV-cache penalty of redundant experts, each with its uncertainty and source
        (measured, or the default kept and why). See docs/tuner.md ("Calibration")."""
        from moe_eplb.cli.tune_output import bad_parameter, print_calibration
        from moe_eplb.eplb.replay.costmodel import CostModel
        from moe_eplb.eplb.replay.simulator import SimError
        from moe_eplb.eplb.tuning.calibrate import CalibrationError

        trace = _load_trace_arg(trace_path, max_trace_bytes)
        if trace.telemetry is None:
            from moe_eplb.contracts.trace_format import TELEMETRY_KEYS

            raise click.ClickException(
                f"{trace_path}: the trace has none of the telemetry keys ({', '.join(TELEMETRY_KEYS)}), so there is "
                "nothing to calibrate on; record one with the operator's reader or the exporter's trace capture")
        try:
            calibration, cost = _calibrated(trace, CostModel(use_async=not sync_mode), nodes, groups,
                                            bytes_per_expert, sync_mode)
        except (CalibrationError, SimError, ValueError) as exc:
            raise bad_parameter(exc) from None
        if as_json:
            json.dump({**calibration.to_dict(), "cost_model": cost.to_dict()}, sys.stdout)
            sys.stdout.write("\n")
            return
        from rich.console import Console

        print_calibration(Console(), calibration)
