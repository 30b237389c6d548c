"""`moe-eplb calibrate`, `tune` on a trace with telemetry and `trace info` through the real click group."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.api.knobs import Knobs
from moe_eplb.cli import main
from moe_eplb.eplb.workload import synth
from moe_eplb.eplb.workload.tracefile import save_trace
from moe_eplb_harness.engines.physics import TrueCost
from moe_eplb_harness.engines.recording import record


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("calib")
    plain = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(6, 32, 1, 4), hours=1, seed=2)
    running = Knobs(1000, 2000, 0)
    rec = record(plain, running, 8, TrueCost(moe_time_share=0.5, use_async=False, sync_stall_s=1.2), seed=1)
    save_trace(rec, d / "tel.json.gz")
    save_trace(plain, d / "plain.npz")
    return d / "tel.json.gz", d / "plain.npz", running


def test_calibrate_json_has_every_parameter_with_value_uncertainty_and_source(traces):
    tel, _, _ = traces
    out = _run("calibrate", "--trace", tel, "--json")
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert set(d) == {"parameters", "measured", "use_async", "fit", "cost_model", "ranges", "memory"}
    assert d["ranges"]["sync_stall_s"]["source"] == "measured" and "tighten" in d["ranges"]["sync_stall_s"]
    assert d["ranges"]["kv_batch_elasticity"]["source"] == "prior" and len(d["cost_model"]["kv_demand"]) == 32
    assert list(d["parameters"]) == ["moe_time_share", "seconds_per_step", "sync_stall_s", "async_s_per_moved_byte",
                                     "kv_throughput_elasticity", "kv_cache_bytes_per_gpu"]
    share = d["parameters"]["moe_time_share"]
    assert share["source"] == "measured" and abs(share["value"] - 0.5) <= 0.1 and share["uncertainty"] > 0
    assert d["parameters"]["sync_stall_s"]["value"] == pytest.approx(1.2, rel=0.1)
    assert d["parameters"]["async_s_per_moved_byte"] == {**d["parameters"]["async_s_per_moved_byte"],
                                                         "source": "default", "uncertainty": None}
    assert d["use_async"] is False and d["cost_model"]["use_async"] is False
    assert d["cost_model"]["moe_time_share"] == share["value"]


def test_calibrate_table(traces):
    out = _run("calibrate", "--trace", traces[0])
    assert out.exit_code == 0
    assert "moe_time_share" in out.output and "measured" in out.output and "Rearrangement mode: sync" in out.output


def test_calibrate_exit_codes(traces, tmp_path):
    _, plain, _ = traces
    out = _run("calibrate", "--trace", plain)
    assert out.exit_code == 1
    assert "none of the telemetry keys" in out.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_layers": 1, "num_experts": 2, "bucket_steps": [1], "load": [[[1, 1]]],
                               "kv_cache_usage": [3]}))
    out = _run("calibrate", "--trace", bad)
    assert out.exit_code == 1  # the file's content is wrong, not the flag
    assert "kv_cache_usage: must be in [0, 1]" in out.output and "bad.json" in out.output
    assert _run("calibrate").exit_code == 2  # --trace is required


def test_tune_calibrates_and_takes_the_recorded_config_as_current(traces):
    tel, _, running = traces
    out = _run("tune", "--trace", tel, "--ep-size", 8, "--json")
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert d["calibration"]["measured"][0] == "moe_time_share"
    assert d["cost_model"]["moe_time_share"] == d["calibration"]["parameters"]["moe_time_share"]["value"]
    assert d["cost_model"]["use_async"] is False
    cur = d["baselines"]["current"]
    assert (cur["window_size"], cur["step_interval"], cur["num_redundant_experts"]) == (1000, 2000, 0)
    assert any("recorded config" in n for n in d["notes"])


def test_tune_no_calibrate_keeps_the_constants(traces):
    tel, _, _ = traces
    d = json.loads(_run("tune", "--trace", tel, "--ep-size", 8, "--json", "--no-calibrate").stdout)
    assert "calibration" not in d
    assert d["cost_model"]["moe_time_share"] == 0.35 and d["cost_model"]["use_async"] is True
    assert d["baselines"]["current"]["step_interval"] == 2000  # the config is still the current one


def test_tune_current_flag_and_other_ep_size_win_over_the_config(traces):
    tel, _, _ = traces
    d = json.loads(_run("tune", "--trace", tel, "--ep-size", 8, "--current", "500,1000,0", "--json").stdout)
    assert d["baselines"]["current"]["window_size"] == 500 and "notes" not in d
    d = json.loads(_run("tune", "--trace", tel, "--ep-size", 4, "--json").stdout)
    assert d["baselines"]["current"] is None and "not taken as the current" in d["notes"][0]


def test_tune_prints_what_was_measured(traces):
    out = _run("tune", "--trace", traces[0], "--ep-size", 8)
    assert out.exit_code == 0
    assert "Calibrated from the trace's telemetry: moe_time_share" in out.output
    assert "Defaults kept: async_s_per_moved_byte" in out.output


def test_trace_info_summarises_the_telemetry(traces):
    d = json.loads(_run("trace", "info", traces[0], "--json").stdout)
    assert d["telemetry"][0] == "step_seconds" and d["config"]["step_interval"] == 2000
    assert d["rearrangements"]["count"] > 0 and d["served_imbalance"]["min"] >= 1.0
    assert np.isfinite(d["step_seconds"]["median"])


def test_tune_prices_each_candidates_redundancy_in_replicas(traces):
    """`tune --replicas N [--kv-target T]`: per candidate, the KV cache its redundancy leaves and the
    replicas it needs at the trace's KV-cache use (eplb/replay/capacity.py), in JSON and as a table."""
    from moe_eplb.eplb.replay.capacity import capacity_from_trace, replicas_needed
    from moe_eplb.eplb.workload.tracefile import load_trace

    tel, plain, _ = traces
    args = ("tune", "--trace", tel, "--ep-size", 8, "--bytes-per-expert", 64 * 2**20)
    d = json.loads(_run(*args, "--replicas", 3, "--kv-target", 0.8, "--json").stdout)
    costs = d["replica_costs"]
    assert 1 <= len(costs) <= 6
    assert [(c["window_size"], c["step_interval"], c["num_redundant_experts"]) for c in costs] == \
        [(c["window_size"], c["step_interval"], c["num_redundant_experts"]) for c in d["candidates"][:len(costs)]]
    cap = capacity_from_trace(load_trace(tel), replicas=3, redundant=0, target=0.8)
    for c in costs:
        more = c["num_redundant_experts"] * 6 * 64 / 1024 / 8  # GiB of redundant experts per GPU (6 layers)
        assert c["kv_cache_gib_per_gpu"] == pytest.approx(cap.kv_bytes_per_gpu / 2**30 - more, abs=1e-3)
        assert c["replicas"] is None or c["replicas"] >= replicas_needed(
            cap, c["num_redundant_experts"], num_moe_layers=6, bytes_per_expert=64 * 2**20, ep_size=8,
            throughput_ratio=2.0)
    assert "replica_costs" not in json.loads(_run(*args, "--json").stdout)  # only when asked
    table = _run(*args, "--replicas", 3)
    assert table.exit_code == 0 and "KV-cache cost of redundancy" in table.output
    no_tel = _run("tune", "--trace", plain, "--ep-size", 8, "--replicas", 3, "--min-steps", 1)
    assert no_tel.exit_code == 2 and "no KV-cache telemetry" in no_tel.output
