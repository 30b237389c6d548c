"""No function in ``operator/moe_eplb`` has a body over 100 lines (the project's rule): a longer one
does several things and is split along its steps. The body counts from its first statement (the
docstring included) to its last line; nested functions count in their parent too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import source_ast

PACKAGE = Path(__file__).resolve().parent.parent / "operator" / "moe_eplb"
MAX_BODY_LINES = 100


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return fn.end_lineno - fn.body[0].lineno + 1


def long_functions(limit: int = MAX_BODY_LINES) -> list[str]:
    """``path:function (N lines)`` of every function whose body is longer than ``limit``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(source_ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > limit:
                out.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.name} ({body_lines(node)} lines)")
    return out


def test_no_function_body_exceeds_100_lines():
    assert long_functions() == []


def test_the_check_sees_a_long_function():
    source = "def f():\n    '''doc'''\n" + "    x = 1\n" * 120
    fn = source_ast.parse(source).body[0]
    assert body_lines(fn) == 121
