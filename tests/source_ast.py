"""``ast.parse`` for the tests that read the project's sources, retried on CPython 3.11's spurious
``SystemError: AST constructor recursion depth mismatch``.

Python 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread, so a parse
that overlaps another thread's (an operator a test left running imports a module, and pytest's
assertion rewriting parses it) can fail with that error although the source is fine
(python/cpython#106905; seen with ``make test``'s two processes, one of which had run an operator
test before). A second parse does not overlap again; a real syntax error still raises.
"""

from __future__ import annotations

import ast
import time

ATTEMPTS = 3


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, tried up to :data:`ATTEMPTS` times on that ``SystemError`` only."""
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS - 1:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")
