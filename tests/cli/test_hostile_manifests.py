"""Hostile manifests given to ``moe-eplb validate`` (and ``render``): each class gives one clear,
bounded line naming the file or field, what is wrong and the limit, and exit status 1 -- never a
traceback, a hang or unbounded memory (issue 14)."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.api import manifest
from moe_eplb.cli import main

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "qwen3-30b-a3b-autotune.yaml"


def _base() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _run(tmp_path, content: str | bytes, command: str = "validate"):
    path = tmp_path / "m.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    result = CliRunner().invoke(main, [command, "-f", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def _assert_one_clear_line(result, *words: str) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert len(lines[0]) < 500
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _dump(doc: dict) -> str:
    return yaml.safe_dump(doc, width=10**9)


@pytest.mark.parametrize("command", ["validate", "render"])
def test_alias_bomb_over_the_alias_limit(tmp_path, command):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    result = _run(tmp_path, "\n".join(lines) + "\n", command)
    _assert_one_clear_line(result, "m.yaml", f"more than {manifest.MAX_ALIASES} YAML aliases")


def test_alias_bomb_within_the_alias_limit_is_refused_before_expanding(tmp_path):
    lines = ["a: &a [x,x,x,x,x,x,x,x]"]
    lines += [f"{c}: &{c} [{','.join([f'*{p}'] * 8)}]" for p, c in zip("abcdefg", "bcdefgh")]
    result = _run(tmp_path, "\n".join(lines) + "\n")
    _assert_one_clear_line(result, "expands to 21913105 values", f"at most {manifest.MAX_NODES}")


def test_a_few_anchors_still_work(tmp_path):
    doc = _base()
    doc["metadata"]["annotations"] = {"image": "vllm/vllm-openai:v0.12.0"}
    text = _dump(doc).replace("    image: vllm/vllm-openai:v0.12.0", "    image: &img vllm/vllm-openai:v0.12.0", 1)
    text = text.replace("    image: vllm/vllm-openai:v0.12.0", "    image: *img", 1)
    assert "&img" in text and "*img" in text
    result = _run(tmp_path, text)
    assert result.exit_code == 0, result.output


def test_non_utf8_bytes(tmp_path):
    result = _run(tmp_path, b"\xff\xfe\x00bad" + EXAMPLE.read_bytes())
    _assert_one_clear_line(result, "not UTF-8", "byte 0", "0xff")


def test_deep_nesting(tmp_path):
    result = _run(tmp_path, EXAMPLE.read_text() + "x: " + "[" * 5000 + "]" * 5000 + "\n")
    _assert_one_clear_line(result, f"nested deeper than {manifest.MAX_DEPTH} levels")


def test_a_huge_list_gives_a_bounded_message(tmp_path):
    doc = _base()
    doc["spec"]["engine"]["extraArgs"] = ["--x"] * 20000
    result = _run(tmp_path, _dump(doc))
    _assert_one_clear_line(result, "spec.engine.extraArgs", "at most 128 entries (got 20000)")


def test_a_file_over_the_api_servers_request_limit(tmp_path):
    doc = _base()
    doc["metadata"]["annotations"] = {"a": "x" * (manifest.MAX_BYTES + 10)}
    result = _run(tmp_path, _dump(doc))
    _assert_one_clear_line(result, "more than 3145728", "3 MiB")


def test_annotations_over_256_kib(tmp_path):
    doc = _base()
    doc["metadata"]["annotations"] = {"a": "x" * 300_000}
    result = _run(tmp_path, _dump(doc))
    _assert_one_clear_line(result, "metadata.annotations", "262144 (256 KiB)")


def test_nan_is_refused_where_the_api_server_would(tmp_path):
    doc = _base()
    doc["spec"]["engine"]["gpuMemoryUtilization"] = float("nan")
    result = _run(tmp_path, _dump(doc))
    _assert_one_clear_line(result, "spec.engine.gpuMemoryUtilization", "nan", "finite number")


def test_bad_namespace_and_labels(tmp_path):
    doc = _base()
    doc["metadata"]["namespace"] = "Bad_NS!"
    result = _run(tmp_path, _dump(doc))
    _assert_one_clear_line(result, "metadata.namespace", "'Bad_NS!'", "namespace name")
    doc = _base()
    doc["metadata"]["labels"] = {"team": "a b"}
    _assert_one_clear_line(_run(tmp_path, _dump(doc)), "metadata.labels['team']", "label value")


def test_duplicate_keys(tmp_path):
    text = EXAMPLE.read_text().replace("spec:\n", "spec:\n  replicas: 1\n  replicas: 2\n", 1)
    _assert_one_clear_line(_run(tmp_path, text), "duplicate key 'replicas'", "line")


def test_a_long_name_is_reported_at_metadata_name(tmp_path):
    doc = _base()
    doc["metadata"]["name"] = "a" * 300
    line = _assert_one_clear_line(_run(tmp_path, _dump(doc)), ": metadata.name: ")
    assert "<root>" not in line


def test_messages_name_the_field_once_and_speak_yaml(tmp_path):
    doc = _base()
    doc["spec"]["replicas"] = True
    doc["spec"]["model"]["servedName"] = None
    result = _run(tmp_path, _dump(doc))
    assert result.exit_code == 1
    text = result.output
    assert "spec.replicas: expected a whole number, got true" in text
    assert "spec.model.servedName: must not be null" in text and text.count("servedName") == 1
    assert "None" not in text and "True" not in text and "not of type" not in text
    for line in text.splitlines():
        field = line.split(": ")[1]
        assert f"{field}: {field}:" not in line


def test_not_yaml_and_missing_file(tmp_path):
    _assert_one_clear_line(_run(tmp_path, "a: [1, 2\n"), "not valid YAML at line")
    result = CliRunner().invoke(main, ["validate", "-f", str(tmp_path / "nope.yaml")])
    _assert_one_clear_line(result, "nope.yaml", "cannot read it")


@pytest.mark.parametrize("command", ["validate", "render"])
@pytest.mark.parametrize("byte", [b"\0", b"\x07", b"\x1b"])
def test_control_bytes_are_one_line_not_a_traceback(tmp_path, command, byte):
    """The YAML reader refuses them as it is built: that must be inside the error handling (issue 24)."""
    result = _run(tmp_path, EXAMPLE.read_bytes().replace(b"spec:", b"spec:" + byte, 1), command)
    _assert_one_clear_line(result, "m.yaml", f"control character U+{byte[0]:04X}", "printable text")


@pytest.mark.parametrize("command", ["validate", "render"])
def test_too_many_documents_are_refused_before_validating_them(tmp_path, command):
    text = "---\n".join([EXAMPLE.read_text()] * (manifest.MAX_DOCUMENTS + 1))
    assert len(text) < manifest.MAX_BYTES
    result = _run(tmp_path, text, command)
    _assert_one_clear_line(result, "m.yaml", f"more than {manifest.MAX_DOCUMENTS} documents", "split the file")


def test_manifest_errors_are_input_errors():
    from moe_eplb.contracts.bounded_read import InputError
    from moe_eplb.contracts.trace_format import TraceError

    assert issubclass(manifest.ManifestError, InputError) and issubclass(TraceError, InputError)


@pytest.mark.parametrize("path,value,words", [
    ("engine.maxModelLen", 2**62, ("spec.engine.maxModelLen", "4611686018427387904 tokens is more than 2147483647")),
    ("engine.shmSize", "8Ei", ("spec.engine.shmSize", "'8Ei' is 9223372036854775808 bytes", "any node's memory (1Pi)")),
    ("autotune.memoryBudgetPerGpu", "8Ei", ("spec.autotune.memoryBudgetPerGpu", "any GPU's memory (1Ti)")),
])
def test_absurd_sizes_are_refused(tmp_path, path, value, words):
    doc = _base()
    section, key = path.split(".")
    doc["spec"].setdefault(section, {})[key] = value
    _assert_one_clear_line(_run(tmp_path, _dump(doc)), *words)
