"""``moe-eplb validate``, ``render`` and ``crd`` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.api.spec import parse
from moe_eplb.cli import main
from moe_eplb.render.objects import render_children
from tests.example_manifests import EXAMPLES

SEED = EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml"


@pytest.fixture()
def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def test_validate_good_file(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", str(SEED)])
    assert result.exit_code == 0
    assert result.stdout == "valid\n" and result.stderr == ""


def test_validate_bad_file_exits_1_with_messages_on_stderr(runner, tmp_path) -> None:
    bad = SEED.read_text().replace("numRedundantExperts: 8", "numRedundantExperts: 7").replace(
        "windowSize: 3000", "windowsize: 3000")
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert f"{path}: spec.eplb.windowsize: unknown field 'windowsize'; did you mean 'windowSize'?" in lines
    assert any("spec.eplb.numRedundantExperts" in line and "use numRedundantExperts 4 or 8" in line for line in lines)


def test_multi_document_file_names_the_bad_document(runner, tmp_path) -> None:
    docs = list(yaml.safe_load_all(SEED.read_text()))
    good = docs[0]
    bad = yaml.safe_load(SEED.read_text())
    bad["metadata"]["name"] = "second"
    bad["spec"]["parallelism"]["tensor"] = 1
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([good, bad]))
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1
    assert "document 2 (second): spec.eplb.enabled:" in result.stderr
    assert "document 1" not in result.stderr


def test_other_kinds_are_skipped(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", str(EXAMPLES / "deepseek-v3-multinode.yaml")])
    assert result.exit_code == 0 and result.stdout == "valid\n"
    assert "Secret (v1) is not a MoEInference, skipped" in result.stderr


def test_render_prints_exactly_render_children(runner) -> None:
    result = runner.invoke(main, ["render", "-f", str(SEED)])
    assert result.exit_code == 0
    printed = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert printed == render_children_of(yaml.safe_load(SEED.read_text()))


def test_render_refuses_invalid_input(runner, tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(SEED.read_text().replace("tensor: 4", "tensor: 1"))
    result = runner.invoke(main, ["render", "-f", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert "spec.eplb.enabled" in result.stderr


@pytest.mark.parametrize(("content", "words"), [("a: [unclosed", "not valid YAML"), ("", "no MoEInference")])
def test_unreadable_inputs(runner, tmp_path, content, words) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(content)
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1 and words in result.stderr


def test_missing_file(runner, tmp_path) -> None:
    result = runner.invoke(main, ["validate", "-f", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1 and "cannot read" in result.stderr


def test_stdin(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", "-"], input=SEED.read_text())
    assert result.exit_code == 0 and result.stdout == "valid\n"


def test_console_script_end_to_end() -> None:
    """The installed entry point, in a fresh process (exit codes as a shell sees them)."""
    ok = subprocess.run([sys.executable, "-m", "moe_eplb", "validate", "-f", str(SEED)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "valid"
    crd = subprocess.run([sys.executable, "-m", "moe_eplb", "crd"], capture_output=True, text=True)
    assert crd.returncode == 0 and yaml.safe_load(crd.stdout)["kind"] == "CustomResourceDefinition"


def render_children_of(resource):
    """``render_children`` of a resource dict (parsed once)."""
    return render_children(parse(resource))
