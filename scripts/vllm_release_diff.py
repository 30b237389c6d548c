#!/usr/bin/env python3
"""What a new vLLM release changes for moe-eplb: every vLLM file and symbol the exporter, the policy
parity tests and the validation depend on, compared between two releases' Python sources.

    python scripts/vllm_release_diff.py 0.33.0 0.34.0                  # pip download --no-deps both
    python scripts/vllm_release_diff.py 0.33.0 0.34.0 --sources .venv/vllm-src   # offline
    python scripts/vllm_release_diff.py 0.33.0 0.34.0 --diff            # + the changed code

Nothing is installed: without ``--sources`` both wheels are downloaded with ``--no-deps`` and only
their ``*.py`` files are extracted (scripts/vllm_src.py) into ``--cache`` (default
``~/.cache/moe-eplb/vllm-src``). ``--sources DIR`` reads ``DIR/<OLD>/vllm`` and ``DIR/<NEW>/vllm``
(the layout ``make setup-vllm`` leaves in ``.venv/vllm-src``).

A symbol is compared by its code (Python's AST, docstrings and formatting ignored); a file by its
bytes; a string by its presence; a pattern by the set of lines matching it. The status is ``same``,
``changed``, ``added`` (only in NEW), ``removed`` (only in OLD) or ``absent`` (in neither). The
catalog's model classes and quantization methods (``moe_eplb.api.catalog``) are found by class name
wherever they live. docs/vllm-releases.md says what to do with the report.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))

from moe_eplb.contracts import vllm_facts  # noqa: E402 - the project's own names of vLLM's facts


@dataclass(frozen=True)
class Dep:
    """One thing of vLLM's that moe-eplb depends on. ``kind``: ``file`` (bytes), ``symbol`` (code of
    a module-level ``name`` or ``Class.member``), ``bases`` (a class's header: name and bases),
    ``import`` (the module imports ``symbol``), ``string`` (a literal occurs in the file),
    ``pattern`` (lines matching the regex ``symbol`` in the files under ``path``)."""

    area: str
    path: str  # under vllm/ ("" = find the class by name)
    symbol: str = ""
    kind: str = "symbol"
    why: str = ""


EPLB = "distributed/eplb/eplb_state.py"
ASYNC = "distributed/eplb/async_worker.py"
RUNNER = "v1/worker/gpu/model_runner.py"

#: The fixed list. ``exporter``: operator/moe_eplb/exporter (hook, layout, recorder, plugin);
#: ``policy``: operator/moe_eplb/eplb/replay/policy.py and its parity tests (tests/eplb); ``validation``:
#: operator/moe_eplb/api and render (flags, EPLB config, environment), with the catalog's classes
#: added by :func:`catalog_deps`.
DEPENDENCIES: tuple[Dep, ...] = (
    Dep("exporter", EPLB, kind="file", why="the EPLB state the hook patches"),
    Dep("exporter", EPLB, "EplbState", "bases", "the class the hook patches"),
    Dep("exporter", EPLB, "EplbState.__init__", why="model_states, should_record_tensor, is_async, parallel_config, "
        "async_worker_error"),
    Dep("exporter", EPLB, "EplbState.step", why="wrapped: step(is_dummy, is_profile, log_stats); the pass and the gate"),
    Dep("exporter", EPLB, "EplbState.rearrange", why="wrapped and timed"),
    Dep("exporter", EPLB, "EplbState.add_model", why="wrapped: served model name, model_states key"),
    Dep("exporter", EPLB, "EplbState.prepare_forward", why="wrapped: unpadded tokens per step"),
    Dep("exporter", EPLB, "EplbState._update_layer_should_record", why="how vLLM writes should_record_tensor"),
    Dep("exporter", EPLB, "EplbState._all_ranks_result_ready", why="async worker failure raised on every rank"),
    Dep("exporter", EPLB, "EplbModelState", why="expert_load_pass, physical_to_logical_map, logical_replica_count, "
        "model, model_name, rebalanced"),
    Dep("exporter", EPLB, "EplbLayerState", why="the router's recording gate (tests' router stand-in)"),
    Dep("exporter", EPLB, "hash_config_cached", "import", "model_states key function (hook.KEY_FUNCTIONS)"),
    Dep("exporter", EPLB, "compute_hash_cached", "import", "model_states key function (hook.KEY_FUNCTIONS)"),
    Dep("exporter", "config/utils.py", "hash_config_cached", why="the key of model_states (0.34)"),
    Dep("exporter", "config/utils.py", "compute_hash_cached", why="the key of model_states (0.32 - 0.33)"),
    Dep("exporter", ASYNC, kind="file", why="async rearrangement: timing, failure"),
    Dep("exporter", ASYNC, "start_async_worker", why="stores the worker's exception in async_worker_error"),
    Dep("exporter", ASYNC, vllm_facts.ASYNC_REARRANGED_LOG, "string",
        "the async cycle duration the exporter reads (vllm_facts.ASYNC_REARRANGED_LOG)"),
    Dep("exporter", EPLB, vllm_facts.ASYNC_WORKER_FAILED, "string",
        "the failure the exporter counts (vllm_facts.ASYNC_WORKER_FAILED)"),
    Dep("exporter", "v1/worker/gpu/eplb_utils.py", "EPLBController", why="the runner's EPLB controller "
        "(creates, steps, suppresses the state)"),
    Dep("exporter", "v1/worker/gpu/eplb_utils.py", "step_eplb_after", why="when the runner steps EPLB"),
    Dep("exporter", RUNNER, "GPUModelRunner.eplb_state", why="the runner's state (a property of the runner)"),
    Dep("exporter", RUNNER, "GPUModelRunner.load_model", why="where the state is created and models registered"),
    Dep("exporter", "v1/worker/gpu_model_runner.py", kind="file", why="Model Runner V1 (gone in 0.34)"),
    Dep("exporter", "plugins/__init__.py", "load_general_plugins", why="loads the exporter plugin in every process"),
    Dep("exporter", "plugins/__init__.py", "load_plugins_by_group", why="entry-point group vllm.general_plugins"),
    Dep("exporter", "distributed/parallel_state.py", "get_ep_group", why="EP rank and size of a worker"),
    Dep("exporter", "config/vllm.py", "get_current_vllm_config_or_none", why="the worker's VllmConfig (KV cache size)"),
    Dep("exporter", "model_executor/models/interfaces.py", "MixtureOfExperts", why="num_moe_layers, expert counts"),
    Dep("exporter", "v1/metrics/loggers.py", kind="file", why="vLLM's own metric names (charts, autoscaling)"),
    Dep("policy", "distributed/eplb/policy/default.py", kind="file", why="DefaultEplbPolicy: moe-eplb's policy "
        "must place as it does"),
    Dep("policy", "distributed/eplb/policy/abstract.py", kind="file", why="the policy interface"),
    Dep("policy", "distributed/eplb/policy/__init__.py", kind="file", why="the policy registry ('default' only)"),
    Dep("policy", EPLB, "compute_logical_maps", why="log2phy/logcnt from phy2log (fixtures/regen.py)"),
    Dep("validation", "config/parallel.py", "EPLBConfig", why="--eplb-config keys, defaults, limits"),
    Dep("validation", "config/parallel.py", "ParallelConfig._validate_parallel_config", why="EPLB/EP admission rules"),
    Dep("validation", "config/parallel.py", "ParallelConfig.compute_eplb_num_redundant_experts",
        why="redundancy when not given (0.34)"),
    Dep("validation", "config/parallel.py", "ParallelConfig.__post_init__", why="EP size, elastic EP, fault tolerance"),
    Dep("validation", "engine/arg_utils.py", "EngineArgs.add_cli_args", why="the flags the renderer writes"),
    Dep("validation", "entrypoints/common/cli_args.py", "make_arg_parser", why="the vllm serve parser (0.33+)"),
    Dep("validation", "platforms/interface.py", "Platform.validate_environ", why="VLLM_* variables the pod may set"),
    Dep("validation", "model_executor/models/registry.py", kind="file", why="architectures (catalog)"),
    Dep("validation", "model_executor/layers/fused_moe/fused_moe_method_base.py", "FusedMoEMethodBase.supports_eplb",
        why="EPLB off unless a method says otherwise"),
    Dep("validation", "model_executor", r"def supports_eplb", "pattern", "every quantization method's EPLB gate"),
)


def catalog_deps() -> list[Dep]:
    """One entry per catalog architecture (its class header: does it still implement
    MixtureOfExperts?) and per quantization method (its ``supports_eplb``), found by class name."""
    from moe_eplb.api.catalog import ARCHITECTURES, QUANTIZATIONS

    deps = [Dep("validation", "", name, "bases", "catalog architecture") for name in sorted(ARCHITECTURES)]
    for method in sorted({q.vllm_method for q in QUANTIZATIONS.values() if q.vllm_method}):
        deps.append(Dep("validation", "", f"{method}.supports_eplb", "symbol", "catalog quantization method"))
    return deps


# --- reading one source tree ---------------------------------------------------------------------


class Tree:
    """One release's ``vllm/`` package (parsed files cached)."""

    def __init__(self, root: Path):
        self.root = root / "vllm" if (root / "vllm").is_dir() else root
        self._ast: dict[Path, ast.Module | None] = {}
        self._classes: dict[str, Path] | None = None

    def file(self, rel: str) -> Path | None:
        path = self.root / rel
        return path if path.is_file() else None

    def parse(self, path: Path) -> ast.Module | None:
        if path not in self._ast:
            try:
                self._ast[path] = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                self._ast[path] = None
        return self._ast[path]

    def find_class(self, name: str) -> Path | None:
        """The file defining top-level ``class name`` (models and layers first)."""
        if self._classes is None:
            self._classes = {}
            rx = re.compile(r"^class (\w+)\b", re.M)
            files = sorted(self.root.rglob("*.py"), key=lambda p: ("model_executor" not in p.parts
                                                                    and "models" not in p.parts, str(p)))
            for path in files:
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                for match in rx.finditer(text):
                    self._classes.setdefault(match.group(1), path)
        return self._classes.get(name)

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return node


def _lookup(module: ast.Module, dotted: str) -> ast.AST | None:
    scope: list[ast.stmt] = module.body
    node = None
    for part in dotted.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = getattr(node, "body", [])
    return node


def _code(node: ast.AST) -> str:
    """Comparable text of a node's code (no docstrings, no positions)."""
    import copy

    return ast.unparse(_strip_docstrings(copy.deepcopy(node)))


def _header(node: ast.ClassDef) -> str:
    return f"class {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"


def _imports(module: ast.Module) -> set[str]:
    names = set()
    for n in ast.walk(module):
        if isinstance(n, ast.ImportFrom):
            names.update(a.asname or a.name for a in n.names)
    return names


def read(tree: Tree, dep: Dep) -> tuple[str | None, str]:
    """(comparable content or None when absent, where it is) of ``dep`` in ``tree``."""
    if dep.kind == "pattern":
        base = tree.root / dep.path
        if not base.exists():
            return None, dep.path
        rx = re.compile(dep.symbol)
        lines = set()
        for path in sorted(base.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if not rx.search(text):
                continue
            module = tree.parse(path)
            for cls in (n for n in (module.body if module else []) if isinstance(n, ast.ClassDef)):
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and rx.search(f"def {fn.name}"):
                        lines.add(f"{tree.rel(path)}:{cls.name}: {_code(fn).splitlines()[-1].strip()}")
        return "\n".join(sorted(lines)), dep.path
    path = tree.file(dep.path) if dep.path else tree.find_class(dep.symbol.split(".")[0])
    if path is None:
        return None, dep.path
    where = tree.rel(path)
    if dep.kind == "file":
        return hashlib.sha256(path.read_bytes()).hexdigest(), where
    if dep.kind == "string":
        return (dep.symbol if dep.symbol in path.read_text(encoding="utf-8") else None), where
    module = tree.parse(path)
    if module is None:
        return None, where
    if dep.kind == "import":
        return (dep.symbol if dep.symbol in _imports(module) else None), where
    node = _lookup(module, dep.symbol)
    if node is None:
        return None, where
    return (_header(node) if dep.kind == "bases" and isinstance(node, ast.ClassDef) else _code(node)), where


def status(old: str | None, new: str | None) -> str:
    if old is None and new is None:
        return "absent"
    if old is None:
        return "added"
    if new is None:
        return "removed"
    return "same" if old == new else "changed"


@dataclass
class Row:
    dep: Dep
    status: str
    where: str
    old: str | None
    new: str | None


def compare(old_root: Path, new_root: Path, deps: list[Dep]) -> list[Row]:
    old_tree, new_tree = Tree(old_root), Tree(new_root)
    rows = []
    for dep in deps:
        old, old_where = read(old_tree, dep)
        new, new_where = read(new_tree, dep)
        where = new_where if new is not None else old_where
        if old is not None and new is not None and old_where != new_where:
            where = f"{old_where} -> {new_where}"
        rows.append(Row(dep, status(old, new), where, old, new))
    return rows


def render(rows: list[Row], old: str, new: str, diff: bool = False, only_changes: bool = False) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    order = ("changed", "added", "removed", "same", "absent")
    out = [f"vLLM {old} -> {new}: {len(rows)} dependencies of moe-eplb: "
           + ", ".join(f"{counts[s]} {s}" for s in order if s in counts)]
    for r in sorted(rows, key=lambda r: (order.index(r.status), r.dep.area)):
        if only_changes and r.status in ("same", "absent"):
            continue
        label = (r.where or "(class not found)") + (f":{r.dep.symbol}" if r.dep.symbol and r.dep.kind not in
                                                     ("string", "pattern") else "")
        if r.dep.kind in ("string", "pattern"):
            label += f' {r.dep.kind} "{r.dep.symbol}"'
        out.append(f"{r.status:8} {r.dep.area:10} {label}  ({r.dep.why})")
        if diff and r.status == "changed" and r.dep.kind != "file":
            lines = difflib.unified_diff((r.old or "").splitlines(), (r.new or "").splitlines(), old, new, lineterm="", n=1)
            out.extend("    " + ln for ln in list(lines)[2:])
    return "\n".join(out)


def sources(args) -> tuple[Path, Path]:
    if args.sources is not None:
        roots = (args.sources / args.old, args.sources / args.new)
        for root in roots:
            if not (root / "vllm").is_dir():
                raise SystemExit(f"error: {root}/vllm does not exist (--sources DIR must hold {args.old}/vllm "
                                 f"and {args.new}/vllm, as `make setup-vllm` leaves .venv/vllm-src)")
        return roots
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_src

    try:
        return vllm_src.fetch(args.old, args.cache), vllm_src.fetch(args.new, args.cache)
    except RuntimeError as exc:
        raise SystemExit(f"error: {exc} (offline? give --sources DIR)") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Which vLLM files and symbols moe-eplb depends on changed "
                                     "between two releases.")
    parser.add_argument("old", help="the release moe-eplb supports, e.g. 0.33.0")
    parser.add_argument("new", help="the release to take in, e.g. 0.34.0")
    parser.add_argument("--sources", type=Path, help="directory holding OLD/vllm and NEW/vllm (no download)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "moe-eplb" / "vllm-src",
                        help="where downloaded sources are kept (default: %(default)s)")
    parser.add_argument("--diff", action="store_true", help="print the code of every changed symbol as a diff")
    parser.add_argument("--changes", action="store_true", help="list only what is not the same")
    args = parser.parse_args(argv)
    old_root, new_root = sources(args)
    rows = compare(old_root, new_root, [*DEPENDENCIES, *catalog_deps()])
    print(render(rows, args.old, args.new, diff=args.diff, only_changes=args.changes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
