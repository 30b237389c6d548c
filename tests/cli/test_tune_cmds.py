"""`moe-eplb simulate` and `moe-eplb tune` through the real click group."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.eplb.replay.simulator import simulate, simulate_static
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.eplb.workload.tracefile import save_trace


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    T, L, E = 16, 3, 16
    pop = rng.gamma(0.5, 1.0, size=(L, E))
    load = rng.poisson(pop / pop.sum(-1, keepdims=True) * 3000, size=(T, L, E)).astype(float)
    trace = LoadTrace(load=load, bucket_steps=np.full(T, 250), bucket_seconds=10.0)
    path = tmp_path_factory.mktemp("traces") / "t.json"
    save_trace(trace, path)
    return path, trace


def test_simulate_json_matches_the_api(trace_file):
    path, trace = trace_file
    r = _run("simulate", "--trace", path, "--ep-size", 4, "--window", 500, "--interval", 1000,
             "--redundant", 4, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    api = simulate(trace, ep_size=4, window_size=500, step_interval=1000, num_redundant_experts=4)
    static = simulate_static(trace, ep_size=4)
    assert d["eplb"]["balancedness"] == pytest.approx(api.balancedness, abs=1e-6)
    assert d["eplb"]["rearrangements"] == api.rearrangements == len(range(250, 4000, 1000))
    assert d["eplb"]["experts_moved"] == api.experts_moved
    assert d["no_eplb"]["balancedness"] == pytest.approx(static.balancedness, abs=1e-6)
    assert d["gain_vs_no_eplb"] == pytest.approx(api.throughput.relative / static.throughput.relative - 1)
    assert len(d["eplb"]["balancedness_per_layer"]) == 3
    assert len(d["eplb"]["balancedness_over_time"]) == 16


def test_simulate_table_and_report(trace_file, tmp_path):
    path, _ = trace_file
    r = _run("simulate", "--trace", path, "--ep-size", 4, "--window", 500, "--interval", 1000,
             "--redundant", 0, "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    assert "no EPLB" in r.output and "balancedness" in r.output
    for name in ("summary.md", "balancedness.png", "expert_load.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 0
    assert "| no EPLB |" in (tmp_path / "rep" / "summary.md").read_text()


def test_tune_json_and_report(trace_file, tmp_path):
    path, _ = trace_file
    r = _run("tune", "--trace", path, "--ep-size", 4, "--memory-budget", "8Gi",
             "--bytes-per-expert", 1e8, "--bounds", "window=500:2000,interval=1000:3000,redundant=0:8",
             "--current", "1000,3000,0", "--json", "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rec = d["recommendation"]
    assert rec["decision"] in ("keep", "change")
    assert d["baselines"]["current"]["window_size"] == 1000
    assert d["baselines"]["vllm_defaults"]["step_interval"] == 3000
    assert d["baselines"]["no_eplb"]["balancedness"] > 0
    for c in d["candidates"]:
        assert 500 <= c["window_size"] <= 2000 and 1000 <= c["step_interval"] <= 3000
        assert c["num_redundant_experts"] in (0, 4, 8)
    assert [c["rank"] for c in d["candidates"]] == list(range(1, len(d["candidates"]) + 1))
    assert (tmp_path / "rep" / "summary.md").read_text().startswith("# EPLB tuning")
    # 8 GiB allows all of 0..8 here (3 layers x 1e8 B x 8 / 4 = 0.6 GB); 300 MB allows only 0 and 4.
    r = _run("tune", "--trace", path, "--ep-size", 4, "--memory-budget", "300000000",
             "--bytes-per-expert", 1e8, "--bounds", "redundant=0:8", "--json")
    d = json.loads(r.output)
    assert {c["num_redundant_experts"] for c in d["candidates"]} == {0, 4}


def test_tune_table(trace_file):
    path, _ = trace_file
    r = _run("tune", "--trace", path, "--ep-size", 4, "--bounds", "redundant=0:4")
    assert r.exit_code == 0, r.output
    assert "Baselines" in r.output and "Reason:" in r.output
    assert "CHANGE" in r.output or "KEEP" in r.output


@pytest.fixture(scope="module")
def flat_file(tmp_path_factory):
    """Half an hour of nearly even expert popularity on a DeepSeek-like shape (balancing gains little)."""
    from moe_eplb.eplb.workload import synth

    trace = synth.generate("deepseek-v3-flat", model_shape=(8, 64, 4, 6), hours=0.5, seed=0)
    path = tmp_path_factory.mktemp("traces") / "flat.npz"
    save_trace(trace, path)
    return path


def test_tune_prints_eplb_off_with_its_gain_and_what_would_change_it(flat_file):
    """DeepEP low latency turns off the shared-expert overlap with EPLB on; where balancing gains less
    than that costs, the recommendation is EPLB off, with its predicted gain."""
    args = ("tune", "--trace", flat_file, "--ep-size", 8, "--groups", 4, "--current", "1000,3000,0",
            "--all2all-backend", "deepep_low_latency", "--shared-expert-ratio", 0.333, "--vllm-version", "0.34.0",
            "--gpu-vendor", "nvidia")
    r = _run(*args)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "EPLB OFF (change): set spec.eplb.enabled: false -- predicted gain +" in text
    assert "Cost of being on: deepep_low_latency runs the shared experts without overlap" in text
    assert "What would change the answer: switch the all2all backend (spec.parallelism.all2allBackend) to" in text
    assert "deepep_v2" in text
    d = json.loads(_run(*args, "--json").output)
    rec = d["recommendation"]
    assert rec["enabled"] is False and rec["mode"] == "off" and rec["decision"] == "change"
    assert rec["predicted_gain"] > 0.02 and rec["predicted_gain_vs"] == "current"
    assert d["baselines"]["eplb_off"]["enabled"] is False
    # the same trace where the overlap is kept: EPLB stays on, rearranging only, and says so
    r = _run("tune", "--trace", flat_file, "--ep-size", 8, "--groups", 4, "--all2all-backend", "deepep_v2",
             "--shared-expert-ratio", 0.333)
    assert r.exit_code == 0, r.output
    assert "REARRANGE ONLY: EPLB on with 0 redundant experts" in " ".join(r.output.split())
    # --no-off: never off
    d = json.loads(_run(*args, "--no-off", "--json").output)
    assert d["recommendation"]["enabled"] is True and d["baselines"]["eplb_off"] is None


def test_tune_current_off(flat_file):
    d = json.loads(_run("tune", "--trace", flat_file, "--ep-size", 8, "--groups", 4, "--current", "off",
                        "--all2all-backend", "deepep_low_latency", "--shared-expert-ratio", 0.333, "--json").output)
    assert d["recommendation"]["enabled"] is False and d["recommendation"]["decision"] == "keep"
    assert d["baselines"]["current"]["enabled"] is False


@pytest.mark.parametrize(
    ("args", "flag", "needle"),
    [
        (["tune", "--all2all-backend", "pigeon"], "--all2all-backend", "not one of vLLM's backends"),
        (["tune", "--vllm-version", "latest"], "--vllm-version", "not a version"),
        (["tune", "--shared-expert-ratio", -1], "--shared-expert-ratio", "within 0..4"),
        (["simulate", "--window", 500, "--interval", 1000, "--redundant", 3], "--redundant", "divide"),
        (["simulate", "--window", 0, "--interval", 1000, "--redundant", 0], "--window", "window_size"),
        (["tune", "--bounds", "redundant=1:3"], "--bounds", "no R in 1:3"),
        (["tune", "--bounds", "speed=1:3"], "--bounds", "NAME=LO:HI"),
        (["tune", "--memory-budget", "lots"], "--memory-budget", "not a byte count"),
        (["tune", "--memory-budget", "1", "--bytes-per-expert", "1e9", "--bounds", "redundant=4:8"],
         "--memory-budget", "less than"),
        (["tune", "--current", "1,2"], "--current", "W,I,R"),
    ],
)
def test_errors_name_the_flag(trace_file, args, flag, needle):
    path, _ = trace_file
    r = _run(*args, "--trace", path, "--ep-size", 4)
    assert r.exit_code == 2, r.output
    assert flag in r.output and needle in r.output


def test_bad_trace_file_is_reported(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_layers": 1, "num_experts": 2, "bucket_steps": [1],
                               "load": [[[1, -1]]]}))
    r = _run("simulate", "--trace", bad, "--ep-size", 2, "--window", 1, "--interval", 1,
             "--redundant", 0)
    assert r.exit_code == 1 and "bad.json" in r.output and "negative" in r.output and "Try '" not in r.output
    r = _run("tune", "--trace", tmp_path / "missing.json", "--ep-size", 2)
    assert r.exit_code == 1 and "missing.json: no such file" in r.output


def test_report_plots_show_every_configuration_against_time(trace_file, tmp_path):
    """Every line is in the legend; the recommendation equal to vLLM's defaults is one line naming
    both (not one hidden under the other); the x-axis is time; ``--report DIR/`` prints one slash."""
    from moe_eplb.eplb.replay.simulator import simulate, simulate_static
    from moe_eplb.eplb.tuning.report import _plt, balancedness_figure, merge_series, time_axis

    path, trace = trace_file
    defaults = simulate(trace, ep_size=4, window_size=1000, step_interval=3000, num_redundant_experts=0)
    other = simulate(trace, ep_size=4, window_size=500, step_interval=1000, num_redundant_experts=0)
    series = [("no EPLB", simulate_static(trace, ep_size=4)), ("vLLM defaults 1000/3000/0", defaults),
              ("recommended 1000/3000/0", defaults), ("500/1000/0", other)]
    merged = merge_series(series)
    assert [label for label, _ in merged] == ["no EPLB", "vLLM defaults 1000/3000/0 = recommended 1000/3000/0",
                                              "500/1000/0"]
    fig = balancedness_figure(series, trace)
    ax = fig.axes[0]
    lines = [line.get_label() for line in ax.get_lines()]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert lines == legend and len(lines) == 3
    edges, xlabel = time_axis(trace)
    assert "time since the trace's start" in xlabel and ax.get_xlabel() == xlabel
    assert edges[-1] == pytest.approx(trace.num_buckets * trace.bucket_seconds / (60.0 if "min" in xlabel else 3600.0))
    _plt().close(fig)
    out = _run("simulate", "--trace", path, "--ep-size", 4, "--window", 500, "--interval", 1000,
              "--redundant", 0, "--report", f"{tmp_path / 'rep'}/")
    assert out.exit_code == 0, out.output
    assert f"Report written to {tmp_path / 'rep' / 'summary.md'}" in out.output and "//" not in out.output
