"""Import rules of the product (``moe_eplb``) and the harness (``moe_eplb_harness``).

The layers -- every import, function-local ones included, points the way the data flows -- are
import-linter contracts in ``.importlinter`` (the product's layers, the EPLB core's three rooms, the
exporter alone, the product without the harness, the harness's layers and its two independent
backends), run by ``make lint`` (``lint-imports``). Here: that those contracts are the ones the
architecture describes and can fail, and what import-linter cannot say --

* no import circles: no two modules import each other, directly or around a circle, also not through
  a function-local import and also not between a package and its own modules (import-linter's
  contracts see packages, not a package's ``__init__`` importing a module that imports it back);
* nothing outside ``tests/`` imports from ``tests/`` (also in shell scripts and the Makefile);
* the package root imports nothing, and every contract module lives in ``moe_eplb/contracts/`` (the
  folder the exporter's injector copies) and is named there by docs and code.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import source_ast

PACKAGE = Path(__file__).resolve().parent.parent / "operator" / "moe_eplb"
CONTRACTS_DIR = PACKAGE / "contracts"
#: the contract modules: every module of ``moe_eplb/contracts/`` (the folder is the one list that the
#: injector copies and the docs name)
CONTRACTS = {p.stem for p in CONTRACTS_DIR.glob("*.py") if p.stem != "__init__"}
HARNESS = PACKAGE.parent.parent / "harness" / "moe_eplb_harness"


def _layer(module: str) -> str | None:
    """``moe_eplb.api.spec`` -> ``api``; ``moe_eplb.contracts.k8s_names`` -> ``contracts``; else None."""
    parts = module.split(".")
    if parts[0] != "moe_eplb":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _here(path: Path, src: Path) -> tuple[Path, list[str]]:
    rel = path.relative_to(src).with_suffix("")
    return rel, list(rel.parts if rel.name != "__init__" else rel.parts[:-1])


def _imports(path: Path, src: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path`` (a module under the source root ``src``),
    relative ones resolved."""
    tree = source_ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_base(node, path, src)
            out.append((node.lineno, mod))
            # ``from moe_eplb import api`` imports the package api
            if mod and "." not in mod:
                top = src / mod
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names
                        if (top / a.name).is_dir() or (top / f"{a.name}.py").exists()]
    return out


def _module_of(path: Path, src: Path = PACKAGE.parent) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, function-local imports included (``from
    moe_eplb.eplb.workload import synth`` imports the module ``moe_eplb.eplb.workload.synth``)."""
    src = package.parent
    modules = {_module_of(p, src): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        targets = [target for _line, target in _imports(path, src)]
        for node in ast.walk(source_ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(node, path, src)
                targets += [f"{base}.{alias.name}" for alias in node.names]
        graph[mod] = {t for t in targets if t in modules and t != mod}
    return graph


def _from_base(node: ast.ImportFrom, path: Path, src: Path = PACKAGE.parent) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    rel, here = _here(path, src)
    if not node.level:
        return node.module or ""
    base = here[: len(here) - node.level + (1 if rel.name == "__init__" else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


@pytest.mark.parametrize("package", [PACKAGE, HARNESS], ids=lambda p: p.name)
def test_no_import_circles_in_the_package(package):
    """No two modules of the package import each other, directly or around a circle -- also not
    through an import inside a function (which only hides the circle from Python at import time),
    and not between a package's ``__init__`` and its own modules."""
    assert import_cycles(_import_graph(package)) == []


def test_the_graph_sees_a_package_and_its_own_module(tmp_path):
    pkg = tmp_path / "moe_eplb" / "eplb" / "trace"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from moe_eplb.eplb.trace.core import LoadTrace\n")
    (pkg / "core.py").write_text("def f():\n    from moe_eplb.eplb.trace import LoadTrace\n")
    graph = _import_graph(tmp_path / "moe_eplb")
    assert import_cycles(graph) == [["moe_eplb.eplb.trace", "moe_eplb.eplb.trace.core"]]


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


ROOT = PACKAGE.parent.parent
#: Where code that is not a test lives: none of it may import from tests/ (a bench, a script or a
#: make target that needs a helper gets it from the product, the harness or scripts/).
OUTSIDE_TESTS = ("operator", "harness", "bench", "scripts")
#: ``python -m tests.x``, ``from tests... import``, ``import tests...`` in a shell line or a make recipe
_TESTS_IMPORT_TEXT = re.compile(r"(-m\s+tests\.|\bfrom\s+tests(\.|\s+import)|\bimport\s+tests\b)")


def imports_from_tests() -> list[str]:
    """``file:line: what`` of every import of the ``tests`` package outside tests/ (function-local
    ones included) and of every ``python -m tests...`` or inline import in a script or the Makefile."""
    bad = []
    for top in OUTSIDE_TESTS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix == ".py":
                for node in ast.walk(source_ast.parse(path.read_text(), filename=str(path))):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                    bad += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in names
                            if n == "tests" or n.startswith("tests.")]
            elif path.suffix == ".sh":
                bad += _text_imports(path)
    return bad + _text_imports(ROOT / "Makefile")


def _text_imports(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if not line.lstrip().startswith("#") and _TESTS_IMPORT_TEXT.search(line)]


def test_nothing_outside_tests_imports_from_tests():
    assert imports_from_tests() == []


@pytest.mark.parametrize("line,found", [
    ('exec "$PY" -m tests.vllm_engine.e2e "$@"', True),
    ("\t$(PY) -c 'from tests.vllm_engine import harness'", True),
    ("\t$(PY) -m pytest -q tests/vllm_engine", False),
    ('exec "$PY" -m moe_eplb_harness.vllm_engine.e2e', False),
])
def test_the_text_rule(line, found):
    assert bool(_TESTS_IMPORT_TEXT.search(line)) is found


def test_contracts_import_only_each_other_and_the_root_imports_nothing():
    assert CONTRACTS >= {"k8s_names", "metric_names", "vllm_facts", "trace_format", "bounded_read"}
    for path in [*CONTRACTS_DIR.glob("*.py"), PACKAGE / "__init__.py"]:
        for line, mod in _imports(path):
            layer = _layer(mod)
            assert layer is None or layer == "contracts", f"{path.name}:{line} imports {mod}"


#: a module's docstring that calls itself a contract (as every contract module's first line does)
_CLAIMS_CONTRACT = re.compile(r"\(a contract[:)]", re.I)


def contracts_outside_the_package(package: Path = PACKAGE) -> list[str]:
    """Modules outside ``moe_eplb/contracts/`` that call themselves a contract, or that carry the name
    of a contract module: a contract lives in the one package, where the injector copies it."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == package / "contracts":
            continue
        doc = ast.get_docstring(source_ast.parse(path.read_text(), filename=str(path))) or ""
        if _CLAIMS_CONTRACT.search(doc.split("\n", 1)[0]) or path.stem in CONTRACTS:
            bad.append(str(path.relative_to(package.parent)))
    return bad


def test_every_contract_module_lives_in_contracts():
    assert contracts_outside_the_package() == []


def test_the_contract_location_check_finds_a_stray(tmp_path):
    pkg = tmp_path / "moe_eplb"
    (pkg / "contracts").mkdir(parents=True)
    (pkg / "contracts" / "k8s_names.py").write_text('"""Names (a contract: imports nothing)."""\n')
    (pkg / "api").mkdir()
    (pkg / "api" / "names.py").write_text('"""More names (a contract: imports nothing)."""\n')
    (pkg / "vllm_facts.py").write_text('"""Facts."""\n')
    assert contracts_outside_the_package(pkg) == ["moe_eplb/api/names.py", "moe_eplb/vllm_facts.py"]


#: where the project names its modules in prose and code: docs, docstrings, scripts, build files
_NAMING_FILES = ("docs/*.md", "operator/**/*.py", "harness/**/*.py", "scripts/**/*.py", "bench/*.py", "tests/**/*.py", "Dockerfile",
                 "Makefile", "charts/**/*.yaml", "charts/**/*.tpl")


def stale_contract_names(root: Path = ROOT) -> list[str]:
    """``file:line: name`` of every mention of a contract module where it does not live (directly
    under ``moe_eplb/``, as before the package) or of a ``contracts`` module that does not exist."""
    stale = re.compile(r"moe_eplb[./](" + "|".join(sorted(CONTRACTS)) + r")\b")
    named = re.compile(r"\bcontracts[./]([a-z0-9_]+)")
    bad = []
    for pattern in _NAMING_FILES:
        for path in sorted(root.glob(pattern)):
            if path.resolve() == Path(__file__).resolve():
                continue  # this file's own example of a stray
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                found = [m.group(0) for m in stale.finditer(line)]
                found += [m.group(0) for m in named.finditer(line) if m.group(1) not in CONTRACTS | {"py"}]
                bad += [f"{path.relative_to(root)}:{i}: {f}" for f in found]
    return bad


def test_docs_and_code_name_the_contracts_where_they_live():
    assert stale_contract_names() == []
    doc = ast.get_docstring(source_ast.parse((CONTRACTS_DIR / "__init__.py").read_text())) or ""
    assert all(f"``{name}``" in doc for name in CONTRACTS), "contracts/__init__.py: list every module it holds"


def test_the_naming_check_finds_stale_names(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("see `moe_eplb/k8s_names.py` and `moe_eplb.contracts.gone`\n"
                                            "fine: `moe_eplb.contracts.vllm_facts`, `contracts/trace_format.py`\n")
    assert stale_contract_names(tmp_path) == ["docs/a.md:1: moe_eplb/k8s_names", "docs/a.md:1: contracts.gone"]




# ---- the import-linter contracts (.importlinter) --------------------------------------------------
CONTRACT_FILE = ROOT / ".importlinter"


def _contracts() -> dict[str, dict[str, list[str]]]:
    """contract id -> option -> its lines, from ``.importlinter``."""
    ini = configparser.ConfigParser()
    ini.read_string(CONTRACT_FILE.read_text())
    return {s.split(":", 2)[2]: {k: [v.strip() for v in ini[s][k].strip().splitlines()] for k in ini[s]}
            for s in ini.sections() if s.startswith("importlinter:contract:")}


def test_the_contracts_are_the_architecture():
    """The layers of docs/architecture.md, as import-linter contracts: the product's stack with the
    exporter beside the controller (only the CLI above it may import it), the EPLB core's rooms, the
    harness's stack with its two independent backends, and the two forbidden ones."""
    c = _contracts()
    assert c["product-layers"]["type"] == ["layers"]
    assert c["product-layers"]["layers"] == ["moe_eplb.cli", "moe_eplb.controller | moe_eplb.exporter",
                                             "moe_eplb.metrics | moe_eplb.render", "moe_eplb.eplb", "moe_eplb.api",
                                             "moe_eplb.contracts"]
    assert c["eplb-rooms"]["layers"] == ["moe_eplb.eplb.tuning", "moe_eplb.eplb.replay", "moe_eplb.eplb.workload"]
    assert c["harness-layers"]["layers"][-1] == "moe_eplb_harness.engines"
    assert (c["backends"]["type"], set(c["backends"]["modules"])) == (
        ["independence"], {"moe_eplb_harness.emulated", "moe_eplb_harness.real"})
    assert (c["product-without-harness"]["source_modules"], c["product-without-harness"]["forbidden_modules"]) == (
        ["moe_eplb"], ["moe_eplb_harness"])
    assert set(c["exporter-alone"]["forbidden_modules"]) >= {"moe_eplb.api", "moe_eplb.controller", "moe_eplb.cli"}
    # every top-level folder of both packages is in a layer
    layered = {m.strip() for spec in ("product-layers", "harness-layers") for line in c[spec]["layers"]
               for m in line.split("|")}
    folders = {f"{top.name}.{p.parent.name}" for top in (PACKAGE, HARNESS) for p in top.glob("*/__init__.py")}
    assert folders == layered


def test_make_lint_runs_import_linter():
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    assert "ruff check" in recipe and "lint-imports" in recipe


def _copy_sources(dest: Path) -> dict[str, str]:
    """Both packages copied under ``dest`` (``operator/``, ``harness/``) with the contract file; the
    environment that imports them from there."""
    for top in (PACKAGE, HARNESS):
        shutil.copytree(top, dest / top.parent.name / top.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(CONTRACT_FILE, dest / ".importlinter")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(dest / "operator"), str(dest / "harness")]))


#: ``lint-imports`` (its console script's entry) run by this Python
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
#: a wrong-way import (function-local where that hides it from Python) -> the contract it breaks
WRONG_WAY = [
    ("operator/moe_eplb/exporter/plugin.py", "from moe_eplb.api import knobs", "exporter-alone"),
    ("operator/moe_eplb/eplb/replay/capacity.py", "from moe_eplb.eplb.tuning import robust", "eplb-rooms"),
    ("operator/moe_eplb/api/knobs.py", "from moe_eplb.render import labels", "product-layers"),
    ("operator/moe_eplb/render/labels.py", "from moe_eplb.eplb.workload import trace", "render-reads-the-api"),
    ("operator/moe_eplb/cli/api_cmds.py", "from moe_eplb_harness.demo import command", "product-without-harness"),
    ("harness/moe_eplb_harness/emulated/lws.py", "from moe_eplb_harness.real import probes", "backends"),
    ("harness/moe_eplb_harness/floor/pods.py", "from moe_eplb_harness.cluster import world", "harness-layers"),
]


@pytest.mark.integration
@pytest.mark.parametrize("path,line,broken", WRONG_WAY, ids=[w[2] for w in WRONG_WAY])
def test_lint_imports_finds_a_wrong_way_import(tmp_path, path, line, broken):
    env = _copy_sources(tmp_path)
    target = tmp_path / path
    target.write_text(target.read_text() + f"\n\ndef _wrong_way():\n    {line}\n")
    name = _contracts()[broken]["name"][0]
    out = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"{name} BROKEN" in out.stdout, out.stdout[-3000:]
