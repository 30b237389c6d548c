"""Import layering of the ``moe_eplb`` package (issue 10): every import, including imports inside
functions, points the way the data flows. A wrong-way import fails here with the file and line.

* ``contracts`` (the package ``moe_eplb/contracts/``: names, facts and formats several packages
  share; its modules are read from the folder, the one list) imports nothing of the project but
  itself and is open to all; no module outside it claims to be a contract;
* ``api`` imports nothing; ``render`` api; ``eplb`` api; ``metrics`` api, eplb; ``controller`` api,
  render, eplb, metrics; ``exporter`` nothing (it runs inside vLLM pods); ``cli`` anything of the
  product (the harness, ``harness/moe_eplb_harness``, is a distribution of its own that the product
  never imports).

And no import circles: no two modules of the package import each other, directly or around a
circle, also not through a function-local import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "operator" / "moe_eplb"
CONTRACTS_DIR = PACKAGE / "contracts"
#: the contract modules: every module of ``moe_eplb/contracts/`` (the folder is the one list that the
#: injector copies and the docs name)
CONTRACTS = {p.stem for p in CONTRACTS_DIR.glob("*.py") if p.stem != "__init__"}
ALLOWED = {
    "contracts": set(),
    "api": set(),
    "render": {"api"},
    "eplb": {"api"},
    "metrics": {"api", "eplb"},
    "controller": {"api", "render", "eplb", "metrics"},
    "exporter": set(),
    "cli": None,
}
TOP_LEVEL = {"__init__": set(), "__main__": None}  # __main__ is the CLI's entry


def _layer(module: str) -> str | None:
    """``moe_eplb.api.spec`` -> ``api``; ``moe_eplb.contracts.k8s_names`` -> ``contracts``; else None."""
    parts = module.split(".")
    if parts[0] != "moe_eplb":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = list(rel.parts if rel.name != "__init__" else rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (1 if rel.name == "__init__" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            # ``from moe_eplb import api`` imports the package api
            if mod == "moe_eplb":
                out += [(node.lineno, f"moe_eplb.{a.name}") for a in node.names
                        if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").exists()]
    return out


def _source_layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _source_layer(path)
        if src in TOP_LEVEL:
            allowed = TOP_LEVEL[src]
        else:
            assert src in ALLOWED, f"{path}: package {src!r} has no layering rule; add it to ALLOWED and docs"
            allowed = ALLOWED[src]
        for line, mod in _imports(path):
            dst = _layer(mod)
            if dst is None or dst == src or dst == "contracts" or allowed is None:
                continue
            if dst == "__init__" and mod == "moe_eplb":
                continue  # the package root itself (only __version__)
            if dst not in allowed:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} imports {mod} ({dst})")
    return bad


def _module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, function-local imports included (``from
    moe_eplb.sim import engine`` imports the module ``moe_eplb.sim.engine``)."""
    modules = {_module_of(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        targets = [target for _line, target in _imports(path)]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(node, path)
                targets += [f"{base}.{alias.name}" for alias in node.names]
        graph[mod] = {t for t in targets if t in modules and t != mod}
    return graph


def _from_base(node: ast.ImportFrom, path: Path) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = list(rel.parts if rel.name != "__init__" else rel.parts[:-1])
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


def test_no_import_circles_in_the_package():
    """No two modules of moe_eplb import each other, directly or around a circle -- also not through
    an import inside a function (which only hides the circle from Python at import time)."""
    assert import_cycles(_import_graph()) == []


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
                for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
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


def test_every_import_follows_the_layers():
    assert _violations() == []


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
        doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""
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
    doc = ast.get_docstring(ast.parse((CONTRACTS_DIR / "__init__.py").read_text())) or ""
    assert all(f"``{name}``" in doc for name in CONTRACTS), "contracts/__init__.py: list every module it holds"


def test_the_naming_check_finds_stale_names(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("see `moe_eplb/k8s_names.py` and `moe_eplb.contracts.gone`\n"
                                            "fine: `moe_eplb.contracts.vllm_facts`, `contracts/trace_format.py`\n")
    assert stale_contract_names(tmp_path) == ["docs/a.md:1: moe_eplb/k8s_names", "docs/a.md:1: contracts.gone"]


@pytest.mark.parametrize("source,target,ok", [
    ("exporter", "moe_eplb.eplb.trace", False),
    ("render", "moe_eplb.api.spec", True),
    ("api", "moe_eplb.render.objects", False),
    ("metrics", "moe_eplb.controller.k8s", False),
])
def test_the_rule_itself(source, target, ok):
    dst = _layer(target)
    assert (dst in (ALLOWED[source] or set())) is ok


# ---- the harness: two backends behind one seam --------------------------------------------------
HARNESS = ROOT / "harness" / "moe_eplb_harness"
#: the backend packages of the harness: neither imports the other (what both need is in ``floor/``)
BACKENDS = {"emulated": "real", "real": "emulated"}


def backend_crossings(package: Path = HARNESS) -> list[str]:
    """``<side>/file.py:line: imports module`` for every import, function-local ones included,
    relative or absolute, ``from moe_eplb_harness import <other>`` too, from one backend package of
    the harness into the other."""
    bad = []
    for side, other in BACKENDS.items():
        banned = f"moe_eplb_harness.{other}"
        for path in sorted((package / side).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = ".".join((["moe_eplb_harness", side][: 3 - node.level] if node.level else [])
                                    + ([node.module] if node.module else []))
                    names = [base] if base == banned or base.startswith(banned + ".") else [
                        f"{base}.{a.name}" for a in node.names]
                else:
                    continue
                bad += [f"{side}/{path.name}:{node.lineno}: imports {n}" for n in dict.fromkeys(names)
                        if n == banned or n.startswith(banned + ".")]
    return bad


def test_the_backends_do_not_import_each_other():
    assert (HARNESS / "emulated" / "__init__.py").is_file() and (HARNESS / "real" / "__init__.py").is_file()
    assert backend_crossings() == []


def test_the_backend_check_finds_crossings(tmp_path):
    harness = tmp_path / "moe_eplb_harness"
    for side in BACKENDS:
        (harness / side).mkdir(parents=True)
    (harness / "emulated" / "a.py").write_text("import json\n\n\ndef f():\n    from moe_eplb_harness.real.nodeagent import NodeAgent\n")
    (harness / "emulated" / "b.py").write_text("from moe_eplb_harness import floor, real\n")
    (harness / "real" / "c.py").write_text("from ..emulated import kubeapi\nfrom . import probes\nimport moe_eplb_harness.floor.pods\n")
    assert backend_crossings(harness) == [
        "emulated/a.py:5: imports moe_eplb_harness.real.nodeagent",
        "emulated/b.py:1: imports moe_eplb_harness.real",
        "real/c.py:1: imports moe_eplb_harness.emulated",
    ]


def harness_imports(package: Path = PACKAGE) -> list[str]:
    """``file:line: module`` of every import of the harness (``moe_eplb_harness``) in the product,
    function-local ones included: the product distribution does not depend on it."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(package.parent)}:{node.lineno}: {n}" for n in names
                    if n == "moe_eplb_harness" or n.startswith("moe_eplb_harness.")]
    return bad


def test_the_product_never_imports_the_harness():
    """The operator image holds the product only (Dockerfile): nothing in it may import the harness,
    also not inside a function; ``moe-eplb demo`` reaches it through an entry point."""
    assert harness_imports() == []


def test_the_harness_check_finds_an_import(tmp_path):
    (tmp_path / "moe_eplb" / "cli").mkdir(parents=True)
    (tmp_path / "moe_eplb" / "cli" / "x.py").write_text("def f():\n    from moe_eplb_harness.demo import tuning\n")
    assert harness_imports(tmp_path / "moe_eplb") == ["moe_eplb/cli/x.py:2: moe_eplb_harness.demo"]
