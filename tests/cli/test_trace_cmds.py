"""`moe-eplb trace synth | info | profiles` through the real click group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.eplb.workload import profiles, synth
from moe_eplb.eplb.workload.tracefile import load_trace

TRACES = Path(os.environ.get("MOE_EPLB_SHARED_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))


def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_synth_writes_the_same_trace_as_the_api(tmp_path):
    out = tmp_path / "t.npz"
    r = _run("trace", "synth", "--profile", "qwen3-vl-30b-a3b-chat-code-math", "--hours", "0.25",
             "--seed", "7", "--shift-at", "0.4", "-o", str(out))
    assert r.exit_code == 0, r.output
    got = load_trace(out)
    want = synth.generate("qwen3-vl-30b-a3b-chat-code-math", hours=0.25, seed=7, shift_at=0.4)
    np.testing.assert_array_equal(got.load, want.load)
    np.testing.assert_array_equal(got.bucket_steps, want.bucket_steps)
    assert got.top_k == 8 and got.bucket_seconds == 15.0 and got.model == "qwen3-vl-30b-a3b"


def test_synth_model_shape_and_bucket_seconds(tmp_path):
    out = tmp_path / "t.json.gz"
    r = _run("trace", "synth", "--profile", "qwen3-vl-30b-a3b-steady", "--model-shape", "deepseek-v3",
             "--hours", "0.1", "--bucket-seconds", "30", "-o", str(out))
    assert r.exit_code == 0, r.output
    t = load_trace(out)
    assert t.load.shape == (12, 58, 256) and t.bucket_seconds == 30.0


@pytest.mark.parametrize(
    "args, words",
    [
        (["--profile", "nope"], ["--profile", "unknown profile 'nope'", "deepseek-v3-chat-code-math", "qwen3-vl-30b-a3b-steady"]),
        (["--profile", "deepseek-v3-steady", "--model-shape", "llama"], ["--model-shape", "deepseek-v3, qwen3-vl-30b-a3b"]),
        (["--profile", "deepseek-v3-steady", "--shift-at", "0.5"], ["--shift-at", "has one phase"]),
        (["--profile", "deepseek-v3-steady", "--hours", "-1"], ["--hours", "must be > 0"]),
    ],
)
def test_synth_errors_name_the_option(tmp_path, args, words):
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["trace", "synth", *args, "-o", str(out)])
    assert r.exit_code == 2, r.output
    for w in words:
        assert w in r.output, r.output
    assert not out.exists()


def test_synth_rejects_unknown_output_type(tmp_path):
    r = CliRunner().invoke(main, ["trace", "synth", "--profile", "deepseek-v3-steady", "-o", str(tmp_path / "t.csv")])
    assert r.exit_code == 2 and "--output" in r.output and ".npz" in r.output


def test_info_text_and_json(tmp_path):
    path = tmp_path / "t.json"
    from moe_eplb.eplb.workload.tracefile import save_trace

    trace = synth.generate("qwen3-vl-30b-a3b-steady", hours=0.1, seed=1)
    save_trace(trace, path)
    r = _run("trace", "info", str(path), "--json")
    assert r.exit_code == 0
    info = json.loads(r.output)
    assert info == json.loads(json.dumps(trace.summary()))
    assert info["num_buckets"] == 24 and info["num_layers"] == 48 and info["num_experts"] == 128
    text = _run("trace", "info", str(path)).output
    assert "imbalance_per_layer" in text and "num_experts            128" in text


def test_info_on_a_bad_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"num_layers": 1, "num_experts": 2, "bucket_steps": [1], "load": [[[1, -2]]]}))
    r = CliRunner().invoke(main, ["trace", "info", str(p)])
    assert r.exit_code == 1 and "load: negative value -2.0 at bucket 0, layer 0, expert 1" in r.output
    assert "Try '" not in r.output  # a bad file is not a usage error


def test_profiles_lists_everything():
    out = _run("trace", "profiles").output
    for name in synth.list_profiles():
        assert name in out
    assert "58 MoE layers x 256 experts, 8 group(s), top-8" in out


@pytest.mark.traces
@pytest.mark.skipif(not TRACES.is_dir(), reason=f"real routing data not found at {TRACES}")
def test_synth_from_real_files_and_info_on_them(tmp_path):
    out = tmp_path / "t.npz"
    files = ["olmoe_expert_counts.json", "mistral_expert_counts.json",
             "mixtral_gsm8k_token_routing.json", "mixtral_humaneval_token_routing.json"]
    r = _run("trace", "synth", "--profile", "deepseek-v3-chat-code-math", "--hours", "0.1",
             *[x for f in files for x in ("--from", str(TRACES / f))], "-o", str(out))
    assert r.exit_code == 0, r.output
    from_files = load_trace(out)
    # the shipped DeepSeek-V3 fit is DeepSeek-V3's own counts: compare with the same generator on
    # the shipped OLMoE + Mixtral fits, which is what fitting these files gives
    shipped = synth.generate("deepseek-v3-chat-code-math", hours=0.1, seed=0,
                             source=[profiles.builtin_popularity("olmoe"), profiles.builtin_temporal()])
    # the shipped fit is the fit of these files, rounded: the same trace up to that rounding
    # (a rounded correlation can swap two experts of nearly equal latent rank, nothing more)
    close = np.isclose(from_files.load, shipped.load, rtol=0.03, atol=50)
    assert close.mean() > 0.98
    np.testing.assert_allclose(from_files.popularity(), shipped.popularity(), atol=1e-3)
    np.testing.assert_array_equal(from_files.bucket_steps, shipped.bucket_steps)
    r = CliRunner().invoke(main, ["trace", "synth", "--profile", "deepseek-v3-steady", "-o", str(tmp_path / "y.json"),
                                  *[x for f in files[:2] for x in ("--from", str(TRACES / f))]])
    assert r.exit_code == 2 and "give one expert-counts file" in r.output
    r = CliRunner().invoke(main, ["trace", "synth", "--profile", "deepseek-v3-steady",
                                  "--from", str(TRACES / "olmoe_sft_expert_counts.json"), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "--from" in r.output and "it has: tulu" in r.output
    info = json.loads(_run("trace", "info", str(TRACES / "olmoe_expert_counts.json"), "--json").output)
    assert info["kind"] == "expert_counts_by_domain" and info["tv_between_domains"]["layer 15"][1] == pytest.approx(0.704, abs=1e-3)
    info = json.loads(_run("trace", "info", str(TRACES / "mixtral_humaneval_token_routing.json"), "--json").output)
    assert info["tokens"] == 338 and info["requests"] == 2
