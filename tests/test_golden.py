"""User-visible output does not change by accident: ``moe-eplb render`` of every example (as
parsed YAML, and free of YAML anchors) and ``moe-eplb tune --json`` on a fixed trace (timings
dropped), against golden copies (see ``tests/golden/__init__.py`` for when each was made)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.cli import main
from tests.golden import HERE, approx_floats, make_trace, strip_timings

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_render_of_every_example_is_unchanged(example):
    out = CliRunner().invoke(main, ["render", "-f", str(example)])
    assert out.exit_code == 0, out.output
    golden = (HERE / f"render-{example.name}").read_text()
    assert list(yaml.safe_load_all(out.stdout)) == list(yaml.safe_load_all(golden))
    assert "&id" not in out.stdout and "*id" not in out.stdout  # plain YAML: no anchors or aliases


@pytest.mark.parametrize("name,args", [
    ("tune-ep4.json", ["--ep-size", "4", "--current", "1000,3000,0"]),
    ("tune-ep8-bounds.json", ["--ep-size", "8", "--nodes", "2", "--current", "500,1000,8",
                              "--bounds", "window=250:4000,redundant=0:16"]),
])
def test_tune_json_on_a_fixed_trace_is_unchanged(tmp_path, name, args):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(make_trace()))
    out = CliRunner().invoke(main, ["tune", "--trace", str(trace), *args, "--json"])
    assert out.exit_code == 0, out.output
    got = strip_timings(json.loads(out.stdout))
    want = approx_floats(json.loads((HERE / name).read_text()))
    assert got["recommendation"] == want["recommendation"]
    assert got == want
