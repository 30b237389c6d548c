"""The skip-or-fail rule for parts installed separately (tests/require.py), and the ``vllm`` marker:
every test module that needs vLLM or torch carries it, so that a fresh clone's ``make test-fast``
passes without vLLM (the marker skips them) and CI (``MOE_EPLB_REQUIRE_VLLM=1``) fails instead."""

from __future__ import annotations

import ast
import importlib.util

import pytest

from tests import ROOT
from tests.require import REQUIRE_KUBE, REQUIRE_VLLM, missing, missing_vllm, vllm_missing_reason

#: modules that use vLLM or torch only when present and test the same without them
OPTIONAL_USERS = {
    "tests/eplb/test_simulator.py": "vLLM's policy is the independent reference when installed, ours otherwise",
}


def test_missing_vllm_skips_and_fails_where_required(monkeypatch):
    monkeypatch.delenv(REQUIRE_VLLM, raising=False)
    monkeypatch.setenv(REQUIRE_KUBE, "1")  # the kube tier's variable does not require vLLM
    with pytest.raises(pytest.skip.Exception, match="no wheel"):
        missing_vllm("no wheel")
    monkeypatch.setenv(REQUIRE_VLLM, "1")
    with pytest.raises(pytest.fail.Exception, match="MOE_EPLB_REQUIRE_VLLM=1 but no wheel"):
        missing_vllm("no wheel")
    monkeypatch.delenv(REQUIRE_KUBE)
    with pytest.raises(pytest.skip.Exception, match="not built"):
        missing("not built")


def test_the_reason_names_the_missing_package(monkeypatch):
    vllm_missing_reason.cache_clear()
    try:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
        assert vllm_missing_reason() == ("needs vLLM (marker vllm): the 'vllm' package is not installed "
                                         "(make setup-vllm)")
        vllm_missing_reason.cache_clear()
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else object())
        assert "the 'torch' package is not installed" in vllm_missing_reason()
        vllm_missing_reason.cache_clear()
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
        assert vllm_missing_reason() is None
    finally:
        vllm_missing_reason.cache_clear()


def _needs_vllm(tree: ast.Module) -> bool:
    """Imports vllm or torch (anywhere, functions too), or takes the ``real_eplb`` fixture."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("vllm", "torch") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("vllm", "torch"):
            return True
        if isinstance(node, ast.FunctionDef) and any(a.arg == "real_eplb" for a in node.args.args):
            return True
    return False


def _markers(tree: ast.Module) -> set[str]:
    """The marks in the module's ``pytestmark`` (``pytest.mark.X`` names)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                    out.add(sub.attr)
    return out


def unmarked_vllm_users(root=ROOT) -> list[str]:
    """Test modules that need vLLM or torch without the ``vllm`` (or ``vllm_engine``) marker."""
    bad = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        if rel not in OPTIONAL_USERS and _needs_vllm(tree) and not _markers(tree) & {"vllm", "vllm_engine"}:
            bad.append(rel)
    return bad


def test_every_test_module_that_needs_vllm_carries_the_marker():
    assert unmarked_vllm_users() == []


def test_the_marker_check_finds_an_unmarked_module(tmp_path):
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("def test_x():\n    import torch\n")
    (tmp_path / "tests" / "a" / "test_y.py").write_text(
        "import pytest\npytestmark = [pytest.mark.vllm]\ndef test_y(real_eplb):\n    pass\n")
    (tmp_path / "tests" / "a" / "test_z.py").write_text("def test_z(real_eplb):\n    pass\n")
    assert unmarked_vllm_users(tmp_path) == ["tests/a/test_x.py", "tests/a/test_z.py"]
