"""The skip-or-fail rule for parts installed separately (tests/require.py), and the ``vllm`` marker:
every test module that needs vLLM or torch carries it, so that a fresh clone's ``make test-fast``
passes without vLLM (the marker skips them) and CI (``MOE_EPLB_REQUIRE_VLLM=1``) fails instead.
Which Prometheus and promtool the tests run (``find_prometheus``), and ``make test``'s side of the
rule: it requires every part it builds and lists each skip with its reason."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from moe_eplb_harness.floor import prometheus as fp
from tests import ROOT, source_ast
from tests.require import (
    REQUIRE_KUBE,
    REQUIRE_PROMETHEUS,
    REQUIRE_VLLM,
    missing,
    missing_vllm,
    prometheus_tools,
    vllm_missing_reason,
)

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
        tree = source_ast.parse(path.read_text(), filename=rel)
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


def _find(present: set[str], env: str | None = None, on_path: str | None = None) -> fp.PrometheusTools:
    """find_prometheus on a machine where exactly the paths in ``present`` are executables."""
    return fp.find_prometheus({fp.PROMETHEUS_ENV: env} if env is not None else {}, executable=lambda p: str(p) in present,
                              which=lambda name: on_path if name == "prometheus" else None,
                              debian=("/usr/bin/prometheus", "/usr/bin/promtool"), built=Path("/repo/tools/prometheus/bin"))


DEBIAN = {"/usr/bin/prometheus", "/usr/bin/promtool"}
BUILT = {"/repo/tools/prometheus/bin/prometheus", "/repo/tools/prometheus/bin/promtool"}


def test_the_debian_pair_first_then_one_on_path_then_the_projects_build():
    assert _find(DEBIAN | BUILT) == fp.PrometheusTools("/usr/bin/prometheus", "/usr/bin/promtool", "debian")
    # the Debian server without its promtool is no pair: the next place is asked
    local = {"/opt/p/prometheus", "/opt/p/promtool"}
    assert _find({"/usr/bin/prometheus"} | local | BUILT, on_path="/opt/p/prometheus") == fp.PrometheusTools(
        "/opt/p/prometheus", "/opt/p/promtool", "PATH")
    # a prometheus on PATH without promtool beside it does not count
    assert _find({"/opt/p/prometheus"} | BUILT, on_path="/opt/p/prometheus").source == "built"
    assert _find(BUILT) == fp.PrometheusTools(*sorted(BUILT), "built")


def test_nothing_found_names_the_make_target_in_one_line():
    for present in (set(), {"/repo/tools/prometheus/bin/prometheus"}):  # a build without promtool is no pair
        found = _find(present)
        assert (found.server, found.promtool, found.source) == (None, None, "none")
        assert "(run `make prometheus`)" in found.problem and "\n" not in found.problem


def test_the_override_is_the_only_place_looked_at_when_set():
    ours = {"/x/prometheus", "/x/promtool"}
    assert _find(ours | DEBIAN, env="/x/prometheus") == fp.PrometheusTools("/x/prometheus", "/x/promtool",
                                                                            fp.PROMETHEUS_ENV)
    bad = _find(DEBIAN | BUILT, env="/y/prometheus")
    assert bad.server is None and bad.problem.startswith("MOE_EPLB_PROMETHEUS=/y/prometheus: no executable")
    no_tool = _find({"/x/prometheus"} | DEBIAN, env="/x/prometheus")
    assert no_tool.server == "/x/prometheus" and no_tool.promtool is None and "promtool beside it (/x/promtool)" in no_tool.problem
    assert _find(DEBIAN, env="  ").source == "debian"  # set but empty: not an override


def test_make_prometheus_builds_only_where_no_pair_is_installed(monkeypatch, capsys):
    for found, code in ((fp.PrometheusTools("/usr/bin/prometheus", "/usr/bin/promtool", "debian"), 0),
                        (fp.PrometheusTools("/r/prometheus", "/r/promtool", "built"), 1),  # build.sh: a no-op when current
                        (fp.PrometheusTools(None, None, "none", "none here"), 1),
                        (fp.PrometheusTools(None, None, fp.PROMETHEUS_ENV, "MOE_EPLB_PROMETHEUS=/y: no"), 2)):
        monkeypatch.setattr(fp, "find_prometheus", lambda found=found: found)
        assert fp.main([]) == code, found
    assert capsys.readouterr().err.strip() == "error: MOE_EPLB_PROMETHEUS=/y: no"


def test_a_missing_prometheus_skips_or_fails_where_required(monkeypatch):
    monkeypatch.setattr(fp, "find_prometheus", lambda: fp.PrometheusTools(None, None, "none", "no pair (run `make prometheus`)"))
    monkeypatch.delenv(REQUIRE_PROMETHEUS, raising=False)
    monkeypatch.setenv(REQUIRE_KUBE, "1")  # another part's variable does not require it
    with pytest.raises(pytest.skip.Exception, match="make prometheus"):
        prometheus_tools()
    monkeypatch.setenv(REQUIRE_PROMETHEUS, "1")
    with pytest.raises(pytest.fail.Exception, match=r"MOE_EPLB_REQUIRE_PROMETHEUS=1 but no pair \(run `make prometheus`\)"):
        prometheus_tools()
    pair = fp.PrometheusTools("/p/prometheus", "/p/promtool", "built")
    monkeypatch.setattr(fp, "find_prometheus", lambda: pair)
    assert prometheus_tools() == pair


def _recipe(target: str) -> tuple[list[str], str]:
    """The prerequisites of ``target`` in the Makefile and its recipe (continuation lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    rule = re.search(rf"^{target}:([^#\n]*)(?:##[^\n]*)?\n((?:\t[^\n]*\n)+)", text, re.M)
    assert rule, target
    return rule.group(1).split(), rule.group(2)


def test_make_test_builds_every_real_part_requires_it_and_lists_each_skip():
    flags = {REQUIRE_KUBE, REQUIRE_VLLM, REQUIRE_PROMETHEUS, "MOE_EPLB_REQUIRE_VLLM_ENGINE"}
    used = set(re.findall(r"MOE_EPLB_REQUIRE_[A-Z_]+", "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))))
    assert used == flags  # a new part's variable must join make test's defaults
    text = (ROOT / "Makefile").read_text()
    for target, parts in (("test", {"setup", "setup-vllm", "kube-main", "prometheus"}),
                          ("test-slow", {"setup", "setup-vllm", "kube", "prometheus"})):
        deps, recipe = _recipe(target)
        assert parts <= set(deps), (target, deps)
        assert " -rfEs " in recipe and "$(REQUIRE)" in recipe, recipe
    for flag in flags:  # each 1 unless already set (MOE_EPLB_REQUIRE_KUBE=0 make test skips instead)
        assert f"{flag}=$${{{flag}-1}}" in text, flag


#: modules that start Prometheus under another rule
PROMETHEUS_EXEMPT = {
    "tests/autotune/test_operator_autotune.py": "the operator reads Prometheus when there is one, else scrapes the pods",
    "tests/kube/test_prometheus_operator_real.py": "the Prometheus 3 the operator configures, a kube-tier part (make kube)",
}
PROMETHEUS_NAMES = {"prometheus_binary", "promtool_binary", "find_prometheus", "start_prometheus", "backfilled_prometheus",
                    "PROMETHEUS", "PROMTOOL"}


def _uses_prometheus(tree: ast.Module) -> bool:
    """Imports a way to find or start Prometheus or promtool, or takes the ``prometheus`` fixture."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name in PROMETHEUS_NAMES for a in node.names):
            return True
        if isinstance(node, ast.FunctionDef) and any(a.arg == "prometheus" for a in node.args.args):
            return True
    return False


def _marks_prometheus(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "prometheus" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(tree))


def unmarked_prometheus_users(root=ROOT) -> list[str]:
    """Test modules that run Prometheus or promtool without the ``prometheus`` marker anywhere in them
    (so a missing binary would be an ad-hoc skip, or an error, instead of the marker's rule)."""
    bad = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        tree = source_ast.parse(path.read_text(), filename=rel)
        if rel not in PROMETHEUS_EXEMPT and _uses_prometheus(tree) and not _marks_prometheus(tree):
            bad.append(rel)
    return bad


def test_every_test_module_that_runs_prometheus_carries_the_marker(tmp_path):
    assert unmarked_prometheus_users() == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from tests.metrics.backfill import PROMTOOL\ndef test_a():\n    pass\n")
    (tmp_path / "tests" / "test_b.py").write_text("import pytest\n@pytest.mark.prometheus\ndef test_b(prometheus):\n    pass\n")
    (tmp_path / "tests" / "test_c.py").write_text("def test_c(prometheus):\n    pass\n")
    assert unmarked_prometheus_users(tmp_path) == ["tests/test_a.py", "tests/test_c.py"]
