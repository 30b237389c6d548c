"""Hostile trace files and flags given to ``trace info``, ``simulate``, ``tune``, ``trace synth`` and
``rebalance``: one clear line (the file or flag, what is wrong, the limit), fast, no traceback and
no unbounded memory. A bad FILE exits 1 (the flags were right); a bad flag exits 2 and names it
(issue 14)."""

from __future__ import annotations

import gzip
import io
import json
import pathlib
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.eplb.trace import LoadTrace
from moe_eplb.eplb.tracefile import save_trace

WEIGHTS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rebalance-weights.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> pathlib.Path:
    rng = np.random.default_rng(1)
    load = rng.poisson(50, size=(12, 4, 32)).astype(float)
    path = tmp_path_factory.mktemp("t") / "ok.npz"
    save_trace(LoadTrace(load=load, bucket_steps=np.full(12, 400), bucket_seconds=15.0), path)
    return path


def _run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output and "Aborted" not in result.output
    return result


def _file_error(result, *words):
    assert result.exit_code == 1, result.output
    assert "Try '" not in result.output  # the flags were right; the file is not
    line = result.output.strip().splitlines()[-1]
    assert all(w in line for w in words), line


def _flag_error(result, flag, *words):
    assert result.exit_code == 2, result.output
    assert flag in result.output and all(w in result.output for w in words), result.output


def test_truncated_npz(good, tmp_path):
    bad = tmp_path / "trunc.npz"
    bad.write_bytes(good.read_bytes()[:300])
    for args in (("trace", "info", bad), ("simulate", "--trace", bad, "--ep-size", 4, "--window", 10,
                                          "--interval", 10, "--redundant", 0), ("tune", "--trace", bad, "--ep-size", 4)):
        _file_error(_run(*args), "trunc.npz", "corrupt or truncated .npz")


def test_npz_header_claiming_a_huge_array_is_refused_before_allocating(tmp_path):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": (100000, 1000, 1000)})
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("load.npy", buf.getvalue() + b"\0" * 16)
    _file_error(_run("trace", "info", path), "huge.npz", "800000000000 bytes", "at most 2147483648")


def test_corrupt_json_gz(tmp_path):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(b'{"num_layers": 1}')[:15])
    _file_error(_run("trace", "info", path), "bad.json.gz", "corrupt or truncated .json.gz")


def test_not_json_names_the_place(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"num_layers": ')
    _file_error(_run("trace", "info", path), "bad.json", "not valid JSON (line 1")


def test_simulate_redundancy_is_bounded_like_the_crd(good):
    _flag_error(_run("simulate", "--trace", good, "--ep-size", 4, "--window", 10, "--interval", 10,
                     "--redundant", 100000), "--redundant", "0<=x<=1023")


@pytest.mark.parametrize("command", ["simulate", "tune"])
def test_more_gpus_than_experts_is_refused_and_blames_the_ep_size(good, command):
    extra = ("--window", 10, "--interval", 10, "--redundant", 0) if command == "simulate" else ()
    result = _run(command, "--trace", good, "--ep-size", 64, *extra)
    _flag_error(result, "--ep-size", "64 GPUs but the model has 32 experts")
    assert "--bounds" not in result.output


def test_nodes_must_divide_the_ep_size(good):
    _flag_error(_run("simulate", "--trace", good, "--ep-size", 8, "--nodes", 3, "--window", 10, "--interval", 10,
                     "--redundant", 0), "--nodes", "3 nodes do not divide ep_size 8")


@pytest.mark.parametrize("target", ["file", "unwritable"])
def test_tune_report_into_a_file_or_nowhere_fails_before_tuning(good, tmp_path, target):
    if target == "file":
        report = tmp_path / "taken"
        report.write_text("x")
        words = ("exists and is not a directory",)
    else:  # under a file: no user, root included, can create it
        (tmp_path / "plain").write_text("x")
        report = tmp_path / "plain" / "sub"
        words = ("cannot write the report into", "Not a directory")
    _flag_error(_run("tune", "--trace", good, "--ep-size", 4, "--report", report), "--report", *words)


def test_trace_synth_refuses_a_trace_too_large_before_generating(tmp_path):
    _flag_error(_run("trace", "synth", "--profile", "qwen3-vl-30b-a3b-steady", "--hours", 200, "-o",
                     tmp_path / "x.npz"), "--hours", "at most 1 GiB", "use at most 91 h")
    assert not (tmp_path / "x.npz").exists()


def test_rebalance_refuses_an_impossible_slot_count_before_allocating():
    _flag_error(_run("rebalance", "--weights", WEIGHTS, "--replicas", 100_000_000, "--groups", 4, "--nodes", 2,
                     "--gpus", 8), "--replicas", "vLLM allows 12 to 1035")


def test_tune_on_one_bucket_says_it_is_too_little_data(tmp_path):
    path = tmp_path / "one.json"
    save_trace(LoadTrace(load=np.full((1, 2, 8), 10.0), bucket_steps=np.array([30]), bucket_seconds=15.0), path)
    result = _run("tune", "--trace", path, "--ep-size", 4)
    _file_error(result, "1 bucket(s) and 30 engine steps are too little to tune on", "InsufficientData")
    assert "consistent" not in result.output


def test_tune_min_steps_allows_a_short_experiment_and_says_so(tmp_path):
    path = tmp_path / "short.json"
    rng = np.random.default_rng(0)
    save_trace(LoadTrace(load=rng.uniform(5, 50, (6, 2, 8)), bucket_steps=np.full(6, 40), bucket_seconds=15.0), path)
    refused = _run("tune", "--trace", path, "--ep-size", 4)
    _file_error(refused, "240 engine steps are too little to tune on")
    out = _run("tune", "--trace", path, "--ep-size", 4, "--min-steps", 200, "--json")
    assert out.exit_code == 0, out.output
    notes = json.loads(out.stdout)["notes"]
    assert any("--min-steps 200: tuned on 240 engine steps, fewer than the 2000" in n for n in notes)
    _flag_error(_run("tune", "--trace", path, "--ep-size", 4, "--min-steps", 0), "--min-steps")
