"""Hostile trace files and flags given to ``trace info``, ``simulate``, ``tune``, ``trace synth`` and
``rebalance``: one clear line (the file or flag, what is wrong, the limit), fast, no traceback and
no unbounded memory. A bad FILE exits 1 (the flags were right); a bad flag exits 2 and names it
(issue 14)."""

from __future__ import annotations

import gzip
import io
import json
import pathlib
import warnings
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.eplb.workload.tracefile import save_trace

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
    _file_error(_run("trace", "info", path), "huge.npz", "array 'load' (100000, 1000, 1000)", "745.06 GiB",
                "at most 1.00 GiB (1073741824 bytes)", "--max-trace-bytes")


def test_corrupt_json_gz(tmp_path):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(b'{"num_layers": 1}')[:15])
    _file_error(_run("trace", "info", path), "bad.json.gz", "corrupt or truncated gzip file")


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


# --- issue 24: the bounded reader (moe_eplb.contracts.bounded_read) on every file the CLI reads ----------------

SIM = ("--ep-size", 4, "--window", 10, "--interval", 10, "--redundant", 0)


def _trace_dict(**changes) -> dict:
    d = {"num_layers": 2, "num_experts": 8, "bucket_steps": [40] * 6, "load": [[[5] * 8] * 2] * 6,
         "bucket_seconds": 15.0}
    d.update(changes)
    return d


def _npz(path: pathlib.Path, members: list[tuple[str, np.ndarray]]) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": on purpose
        for name, arr in members:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr, allow_pickle=False)
            z.writestr(name, buf.getvalue())
    return path


def test_gzip_bomb_is_refused_while_streaming(tmp_path):
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b"[" + b"0," * 2_000_000 + b"0]", 9))
    assert path.stat().st_size < 20_000
    _file_error(_run("trace", "info", path, "--max-trace-bytes", 1_000_000), "bomb.json.gz",
                "expands to more than the 1000000 bytes a JSON trace may have", ".npz")


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_json_with_too_many_values_is_refused_before_parsing(tmp_path, suffix):
    text = b'{"load": [' + b"0," * 16_000_001 + b"0]}"
    path = tmp_path / f"wide{suffix}"
    path.write_bytes(gzip.compress(text, 1) if suffix == ".json.gz" else text)
    words = ("JSON values in its first", "bytes gunzipped") if suffix == ".json.gz" else ("up to 16000003 JSON values",)
    _file_error(_run("trace", "info", path), f"wide{suffix}", *words, "at most 16000000 JSON values are read",
                "write large traces as .npz")


@pytest.mark.parametrize("dtype", ["<f8", "|u1"])
def test_npz_declaring_more_than_the_working_set_is_refused_before_reading(tmp_path, dtype):
    """1.9 GB of float64 (or 0.24 GB of uint8, 1.9 GB once float64) declared in a tiny file."""
    shape = (1900, 1000, 125) if dtype == "<f8" else (1900, 1000, 125)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    path = tmp_path / "big.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("load.npy", buf.getvalue())
    for args in (("trace", "info", path), ("simulate", "--trace", path, *SIM), ("tune", "--trace", path, "--ep-size", 4)):
        _file_error(_run(*args), "big.npz", "array 'load' (1900, 1000, 125)", "would take 1.77 GiB", "--max-trace-bytes")


@pytest.mark.parametrize("text,words", [
    ('{"num_layers": Infinity, "num_experts": 8}', ("Infinity at line 1, column 16 (in 'num_layers')", "must be finite")),
    ('{"num_layers": 2, "load": [[[1, NaN]]]}', ("NaN at line 1", "(in 'load')")),
    ('{"num_layers": 2, "num_layers": 3}', ("duplicate key 'num_layers'",)),
    ("[" * 100_000 + "]" * 100_000, ("nested deeper than 16 levels",)),
])
@pytest.mark.parametrize("command", ["info", "simulate", "tune", "calibrate"])
def test_json_trace_hostile_text(tmp_path, text, words, command):
    path = tmp_path / "t.json"
    path.write_text(text)
    args = {"info": ("trace", "info", path), "simulate": ("simulate", "--trace", path, *SIM),
            "tune": ("tune", "--trace", path, "--ep-size", 4), "calibrate": ("calibrate", "--trace", path)}[command]
    _file_error(_run(*args), "t.json", *words)


@pytest.mark.parametrize("changes,words", [
    (dict(bucket_steps=[1e308] * 6), ("bucket_steps: value 1e+308 above 2**53 at bucket 0",)),
    (dict(bucket_steps=[2**62] * 6), ("bucket_steps: value 4.611686018427388e+18 above 2**53 at bucket 0",)),
    (dict(bucket_steps=[2**52] * 6), ("bucket_steps:", "engine steps in all, more than 2**53")),
    (dict(load=[[[1e39] * 8] * 2] * 6), ("load: value 1e+39 above 2**53 at bucket 0, layer 0, expert 0",)),
    (dict(config={"window_size": 10**30, "step_interval": 10, "num_redundant_experts": 0}),
     ("config.window_size: expected an integer > 0 and <= 100000",)),
    (dict(config={"window_size": 10, "step_interval": 10, "num_redundant_experts": 2**40}),
     ("config.num_redundant_experts: expected an integer >= 0 and <= 1023",)),
    (dict(top_k=1.5), ("top_k: expected an integer > 0, got 1.5 (not a whole number)",)),
    (dict(rearrangements=[{"bucket": 2**70, "seconds": 1}]), ("rearrangements[0].bucket:",)),
])
def test_wrongly_accepted_values_are_refused_naming_the_field(tmp_path, changes, words):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace_dict(**changes)))
    for args in (("trace", "info", path), ("tune", "--trace", path, "--ep-size", 4)):
        _file_error(_run(*args), "t.json", *words)


def test_npz_non_finite_scalars_and_nested_json_members(tmp_path):
    ok = [("bucket_steps.npy", np.full(6, 40)), ("load.npy", np.full((6, 2, 8), 5.0))]
    cases = [
        ([("num_layers.npy", np.array(np.inf)), ("num_experts.npy", np.array(8))], "num_layers: expected an integer > 0, got inf"),
        ([("num_layers.npy", np.array(np.nan)), ("num_experts.npy", np.array(8))], "num_layers: expected an integer > 0, got nan"),
        ([("num_layers.npy", np.array(2)), ("num_experts.npy", np.array(8)),
          ("config.npy", np.str_("[" * 100_000 + "]" * 100_000))], "config: JSON nested deeper than 16 levels"),
        ([("num_layers.npy", np.array(2)), ("num_experts.npy", np.array(8)),
          ("rearrangements.npy", np.str_('[{"bucket": NaN, "seconds": 1}]'))], "rearrangements: NaN at line 1"),
        ([("num_layers.npy", np.array(2)), ("num_experts.npy", np.array(8)), ("num_layers.npy", np.array(3))],
         "member 'num_layers.npy' appears twice"),
    ]
    for i, (members, words) in enumerate(cases):
        path = _npz(tmp_path / f"c{i}.npz", ok + members)
        for args in (("trace", "info", path), ("simulate", "--trace", path, *SIM)):
            _file_error(_run(*args), f"c{i}.npz", words)


ROUTING = {"kind": "token_routing_sequence", "num_experts": 8, "top_k": 2, "experts": [[[0, 1], [2, 3]]] * 4}


@pytest.mark.parametrize("changes,words", [
    (dict(num_experts=10**12), ("num_experts: expected an integer >= 2 and <= 4096, got 1000000000000",)),
    (dict(num_experts=None), ("num_experts: expected an integer >= 2 and <= 4096, got None",)),
    (dict(top_k="abc"), ("top_k: expected an integer > 0 and <= 64, got 'abc'",)),
    (dict(top_k=9), ("top_k: 9 is more than num_experts 8",)),
    (dict(num_layers=5000), ("num_layers: expected an integer > 0 and <= 1024",)),
    (dict(experts=[[[0, 1], "x"]] * 4), ("experts[0][1] = x is not 2 expert ids < 8",)),
    (dict(problem_id=[None] * 4), ("problem_id: request ids are integers",)),
    (dict(num_experts=4096, experts=[[[0, 1]] * 32] * 5000), ("the load of 5000 tokens x 32 layers x 4096 experts",
                                                              "would take 4.88 GiB in memory; at most 1.00 GiB")),
])
def test_routing_files_are_bounded_and_typed(tmp_path, changes, words):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**ROUTING, **changes}))
    for args in (("trace", "info", path), ("trace", "synth", "--profile", "qwen3-vl-30b-a3b-steady", "--hours", 0.01,
                                          "--from", path, "-o", tmp_path / "o.json")):
        result = _run(*args)
        assert result.exit_code in (1, 2), result.output
        assert "r.json" in result.output and all(w in result.output for w in words), result.output


def test_routing_file_deep_huge_and_counts(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"kind": "expert_counts_by_domain", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _file_error(_run("trace", "info", deep), "deep.json", "nested deeper than 16 levels")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:  # sparse: 954 MB on paper
        fh.write(b'{"kind": "expert_counts_by_domain", ')
        fh.truncate(954_000_000)
    _file_error(_run("trace", "info", huge), "huge.json", "954000000 bytes on disk, more than the 268435456")
    counts = tmp_path / "c.json"
    counts.write_text(json.dumps({"kind": "expert_counts_by_domain", "num_experts": 4, "top_k": 2, "layers": [0],
                                  "counts": {"a": [[1, 2, 3, 1e300]]}}))
    _file_error(_run("trace", "info", counts), "c.json", "counts.a: value 1e+300 above 2**53 at layer 0, expert 3")


@pytest.mark.parametrize("text,words", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 16 levels; this file needs 2"),
    ('[[1, NaN]]', "NaN at line 1, column 6"),
    ('[[1, 1e400]]', "[0][1] is inf, not a finite number"),
    ('[[1, null]]', "[0][1] is None, not a finite number"),
])
def test_rebalance_weights_hostile(tmp_path, text, words):
    path = tmp_path / "w.json"
    path.write_text(text)
    _flag_error(_run("rebalance", "--weights", path, "--replicas", 2, "--groups", 1, "--nodes", 1, "--gpus", 1),
                "--weights", words)
