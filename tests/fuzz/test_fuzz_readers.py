"""Property-based tier over the bounded readers and ``validate`` (issue 24).

Whatever the bytes, each reader either returns its value or raises its one error type
(:class:`moe_eplb.contracts.bounded_read.InputError`), and each CLI command exits 0, 1 or 2 with no
traceback. The C-speed JSON depth scan agrees with the nesting of what ``json`` parses.
"""

from __future__ import annotations

import copy
import io
import json
import math
import zipfile

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb.cli import main
from moe_eplb.contracts import bounded_read
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.eplb.workload.tracefile import DomainCounts, TokenRouting, load_trace, read_routing_file
from tests.example_manifests import EXAMPLES, load_moeinferences

# --- value strategies ------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 8, 2**31, 2**53, 2**53 + 1, 2**62, 2**63, 10**12, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1e308, -0.0, 1e-300, 3.4e38, 1e39]),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=20)
JSON_FRAGMENTS = st.lists(st.sampled_from(
    ["[", "]", "{", "}", '"', "\\", '\\"', "\\\\", ",", ":", "0", "12", "-3.5e2", "1e400", "NaN", "Infinity",
     "-Infinity", "null", "true", '"a"', '"num_layers"', " ", "\n", "\x00", "\xff", "é"]), max_size=60)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


# --- the JSON layer ----------------------------------------------------------------------------------


@given(JSON_VALUES)
def test_json_depth_matches_the_parsed_nesting(value):
    text = json.dumps(value, allow_nan=True).encode()
    assert bounded_read.json_depth(text) == _depth(value)


@given(st.one_of(st.binary(max_size=300), JSON_FRAGMENTS.map(lambda f: "".join(f).encode("utf-8", "surrogatepass"))))
def test_parse_json_returns_or_raises_input_error(raw):
    try:
        value = bounded_read.parse_json(raw, "f.json", max_values=10_000, max_depth=8)
    except bounded_read.InputError as exc:
        assert str(exc).startswith("f.json: ") and "\n" not in str(exc)
        return
    assert _depth(value) <= 8
    floats = [value] if isinstance(value, float) else []
    assert all(math.isfinite(f) or abs(f) == math.inf for f in floats)  # 1e400 parses to inf; readers check


@given(st.lists(st.tuples(st.text(max_size=3), SCALARS), max_size=6))
def test_duplicate_keys_are_refused_exactly_when_present(pairs):
    text = "{" + ",".join(f"{json.dumps(k)}: {json.dumps(v, allow_nan=False) if _finite(v) else 0}"
                          for k, v in pairs) + "}"
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        with pytest.raises(bounded_read.InputError, match="duplicate key"):
            bounded_read.parse_json(text.encode(), "d.json")
    else:
        assert set(bounded_read.parse_json(text.encode(), "d.json")) == set(keys)


def _finite(v) -> bool:
    return not (isinstance(v, float) and not math.isfinite(v))


@given(SCALARS, st.integers(-5, 5), st.integers(0, 2**63))
def test_whole_number_is_in_range_or_input_error(value, lo, span):
    hi = lo + span
    try:
        out = bounded_read.whole_number(value, "k", lo, hi)
    except bounded_read.InputError as exc:
        assert str(exc).startswith("k: expected an integer")
        return
    assert type(out) is int and lo <= out <= hi and out == value


# --- traces --------------------------------------------------------------------------------------------

TRACE_KEYS = ["num_layers", "num_experts", "bucket_steps", "load", "bucket_seconds", "top_k", "model", "step_seconds",
              "rank_load", "kv_cache_usage", "preemptions", "requests_waiting", "rearrangements", "config",
              "kv_cache_bytes_per_gpu", "extra"]


def _good_trace() -> dict:
    load = np.arange(4 * 2 * 4).reshape(4, 2, 4) % 7
    return {"num_layers": 2, "num_experts": 4, "bucket_steps": [10, 0, 12, 9], "load": load.tolist(),
            "bucket_seconds": 15, "top_k": 2, "step_seconds": [0.05, None, 0.06, 0.05],
            "rank_load": load.reshape(4, 2, 2, 2).sum(axis=3).tolist(), "preemptions": [0, 0, 1, 0],
            "rearrangements": [{"bucket": 2, "seconds": 0.5}],
            "config": {"window_size": 10, "step_interval": 30, "num_redundant_experts": 0, "ep_size": 2}}


MUTATIONS = st.lists(st.tuples(st.sampled_from(TRACE_KEYS), st.one_of(JSON_VALUES, st.just("__delete__"))),
                     min_size=1, max_size=3)


def _mutated(base: dict, mutations) -> dict:
    d = copy.deepcopy(base)
    for key, value in mutations:
        if value == "__delete__":
            d.pop(key, None)
        else:
            d[key] = value
    return d


@given(MUTATIONS, st.sampled_from([".json", ".npz"]))
def test_trace_reader_returns_a_trace_or_a_trace_error(tmp_path_factory, mutations, suffix):
    d = _mutated(_good_trace(), mutations)
    path = tmp_path_factory.mktemp("t") / f"t{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(d, allow_nan=True))
    else:
        with zipfile.ZipFile(path, "w") as z:
            for key, value in d.items():
                try:
                    arr = (np.str_(json.dumps(value, allow_nan=True)) if key in ("config", "rearrangements")
                           else np.asarray(value))
                except (ValueError, OverflowError):
                    arr = np.str_(str(value))
                if arr.dtype == object:
                    arr = np.str_(json.dumps(value, allow_nan=True))
                buf = io.BytesIO()
                np.lib.format.write_array(buf, arr, allow_pickle=False)
                z.writestr(f"{key}.npy", buf.getvalue())
    try:
        trace = load_trace(path)
    except bounded_read.InputError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)
        return
    assert isinstance(trace, LoadTrace)
    assert np.all(np.isfinite(trace.load)) and np.all(trace.load >= 0) and np.all(trace.bucket_steps >= 0)
    assert trace.total_steps == int(np.sum(trace.bucket_steps))  # no int64 wrap
    trace.summary()  # what `trace info` prints


NESTED = st.sampled_from([("load", 1, 0, 2), ("load", 0, 1), ("bucket_steps", 2), ("rank_load", 3, 1, 0),
                          ("step_seconds", 0), ("preemptions", 2), ("config", "window_size"), ("config", "ep_size"),
                          ("config", "num_redundant_experts"), ("rearrangements", 0, "bucket"),
                          ("rearrangements", 0, "seconds")])


@given(st.lists(st.tuples(NESTED, JSON_VALUES), min_size=1, max_size=3))
def test_trace_reader_on_nested_mutations(tmp_path_factory, mutations):
    d = _good_trace()
    for where, value in mutations:
        obj = d
        for k in where[:-1]:
            obj = obj[k]
        obj[where[-1]] = value
    path = tmp_path_factory.mktemp("n") / "t.json"
    path.write_text(json.dumps(d, allow_nan=True))
    try:
        trace = load_trace(path)
    except bounded_read.InputError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)
        return
    assert np.all(np.isfinite(trace.load)) and trace.total_steps == int(np.sum(trace.bucket_steps))


ROUTING = {"kind": "token_routing_sequence", "num_experts": 8, "top_k": 2, "num_layers": 2,
           "experts": [[[0, 1], [2, 3]], [[4, 5], []]], "problem_id": [0, 1]}
COUNTS = {"kind": "expert_counts_by_domain", "num_experts": 4, "top_k": 2, "layers": [0, 3],
          "counts": {"chat": [[1, 2, 3, 4], [4, 3, 2, 1]]}}


@given(st.sampled_from([ROUTING, COUNTS]), st.lists(st.tuples(
    st.sampled_from(["kind", "num_experts", "top_k", "num_layers", "experts", "problem_id", "layers", "counts",
                     "model"]), st.one_of(JSON_VALUES, st.just("__delete__"))), min_size=1, max_size=3))
def test_routing_reader_returns_data_or_a_trace_error(tmp_path_factory, base, mutations):
    d = _mutated(base, [(k, v) for k, v in mutations if k != "kind" or v != "__delete__"])
    path = tmp_path_factory.mktemp("r") / "r.json"
    path.write_text(json.dumps(d, allow_nan=True))
    try:
        data = read_routing_file(path)
    except bounded_read.InputError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)
        return
    assert isinstance(data, (DomainCounts, TokenRouting))


# --- the CLI: trace info, rebalance --weights, validate -----------------------------------------------------


def _no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1, 2) and "Traceback" not in result.output


@given(MUTATIONS)
def test_trace_info_never_tracebacks(tmp_path_factory, mutations):
    path = tmp_path_factory.mktemp("i") / "t.json"
    path.write_text(json.dumps(_mutated(_good_trace(), mutations), allow_nan=True))
    _no_traceback(CliRunner().invoke(main, ["trace", "info", str(path)]))


@given(st.one_of(JSON_VALUES, st.lists(st.lists(SCALARS, min_size=1, max_size=6), min_size=1, max_size=4)))
def test_weights_reader_returns_a_table_or_names_the_flag(tmp_path_factory, value):
    import click

    from moe_eplb.cli.eplb_cmds import _read_weights

    path = tmp_path_factory.mktemp("w") / "w.json"
    path.write_text(json.dumps(value, allow_nan=True))
    try:
        table = _read_weights(str(path))
    except click.BadParameter as exc:
        assert exc.param_hint == "--weights"
        return
    assert len({len(row) for row in table}) == 1
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for row in table for v in row)


SEED = load_moeinferences(EXAMPLES / "qwen3-30b-a3b-autotune.yaml")[0]
SPEC_PATHS = ["spec.replicas", "spec.engine.maxModelLen", "spec.engine.shmSize", "spec.engine.extraArgs",
              "spec.engine.env", "spec.eplb.windowSize", "spec.eplb.numRedundantExperts", "spec.parallelism.tensor",
              "spec.autotune.memoryBudgetPerGpu", "spec.model.name", "metadata.name", "spec.engine.gpuMemoryUtilization"]


@given(st.lists(st.tuples(st.sampled_from(SPEC_PATHS), JSON_VALUES), min_size=1, max_size=3))
def test_validate_never_tracebacks_on_mutated_manifests(tmp_path_factory, mutations):
    doc = copy.deepcopy(SEED)
    for dotted, value in mutations:
        obj = doc
        *parents, last = dotted.split(".")
        for p in parents:
            obj = obj.setdefault(p, {}) if isinstance(obj.get(p, {}), dict) else obj
        obj[last] = value
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    try:
        path.write_text(yaml.safe_dump(doc))
    except yaml.YAMLError:
        return
    for command in ("validate", "render"):
        _no_traceback(CliRunner().invoke(main, [command, "-f", str(path)]))


@given(st.one_of(st.binary(max_size=400), JSON_FRAGMENTS.map("".join),
                 st.lists(st.sampled_from(["a: 1", "---", "- x", "&a [1]", "*a", "{", "!!python/object:x {}",
                                           "\t", "? k", ": v", "\x00", "key: [", "%YAML 1.1"]), max_size=12)
                 .map("\n".join)))
def test_validate_never_tracebacks_on_arbitrary_bytes(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("b") / "m.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    result = CliRunner().invoke(main, ["validate", "-f", str(path)])
    _no_traceback(result)
    assert result.exit_code in (0, 1)


@given(st.lists(st.tuples(NESTED, st.one_of(SCALARS, st.just(0), st.just(10**6))), min_size=1, max_size=4),
       st.sampled_from(["simulate", "calibrate", "tune"]))
@settings(max_examples=max(5, settings.default.max_examples // 4))
def test_commands_on_read_traces_never_traceback(tmp_path_factory, mutations, command):
    """Whatever the reader lets through, the commands that use it answer without a traceback."""
    d = _good_trace()
    for where, value in mutations:
        obj = d
        for k in where[:-1]:
            obj = obj[k]
        obj[where[-1]] = value
    path = tmp_path_factory.mktemp("c") / "t.json"
    path.write_text(json.dumps(d, allow_nan=True))
    args = {"simulate": ["simulate", "--trace", str(path), "--ep-size", "2", "--window", "10", "--interval", "10",
                         "--redundant", "0", "--json"],
            "calibrate": ["calibrate", "--trace", str(path), "--json"],
            "tune": ["tune", "--trace", str(path), "--ep-size", "2", "--min-steps", "1", "--json"]}[command]
    _no_traceback(CliRunner().invoke(main, args))
