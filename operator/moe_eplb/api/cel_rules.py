"""Evaluate the CRD's own CEL ``x-kubernetes-validations`` rules, as the apiserver does at apply time.

Each rule is attached to a schema node; it runs with ``self`` bound to the object's value at that
node, only when that value is present (after defaulting). A rule that evaluates to false yields a
:class:`Problem` at the node's path plus the rule's ``fieldPath``, with the rule's ``message``.
Transition rules (``oldSelf``) are skipped: there is no old object here.
"""

from __future__ import annotations

import functools
from typing import Any

import cel

from moe_eplb.api.problem import Problem
from moe_eplb.api.schema import format_path

Schema = dict[str, Any]


def cel_format(template: Any, args: Any) -> str:
    """The Kubernetes CEL strings library's ``'...'.format([args])`` for the verbs the CRD uses:
    ``%d`` (an int), ``%s`` (any value as a string) and ``%%``. Python's CEL package has no
    ``format``; the CRD's messages need it (see :func:`moe_eplb.api.cel_catalog.divisibility_message`).
    A verb without an argument, an extra argument, or another verb raises ``ValueError`` (the
    apiserver also fails the expression, and falls back to ``message``)."""
    text, values = str(template), list(args)
    out: list[str] = []
    i = used = 0
    while i < len(text):
        ch = text[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        verb = text[i + 1:i + 2]
        i += 2
        if verb == "%":
            out.append("%")
            continue
        if verb not in ("d", "s") or used >= len(values):
            raise ValueError(f"format: unsupported verb %{verb} or too few arguments in {text!r}")
        value = values[used]
        used += 1
        if verb == "d":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"format: %d needs an integer, got {value!r}")
            out.append(str(int(value)))
        else:
            out.append(value if isinstance(value, str) else str(value))
    if used != len(values):
        raise ValueError(f"format: {len(values) - used} argument(s) left over in {text!r}")
    return "".join(out)


#: functions the apiserver's CEL environment has and Python's CEL package lacks
FUNCTIONS = {"format": cel_format}


def context_for(obj: Any) -> Any:
    """A CEL evaluation context with ``self`` bound to ``obj`` and :data:`FUNCTIONS`."""
    return cel.Context(variables={"self": obj}, functions=FUNCTIONS)


@functools.lru_cache(maxsize=256)
def _program(rule: str) -> Any:
    return cel.compile(rule)


def _message(rule: dict[str, Any], context: Any) -> str:
    """``messageExpression`` evaluated like the apiserver (falls back to ``message``)."""
    if rule.get("messageExpression"):
        try:
            text = _program(rule["messageExpression"]).execute(context)
            if isinstance(text, str) and text.strip():
                return text
        except Exception:  # the apiserver also falls back to message when the expression fails
            pass
    return rule.get("message") or f"failed rule: {rule['rule']}"


def _field(path: tuple, rule: dict[str, Any]) -> str:
    """Dotted path of the node plus the rule's ``fieldPath``."""
    sub = [p for p in (rule.get("fieldPath") or "").lstrip(".").split(".") if p]
    return format_path(list(path) + sub) or "<root>"


def cel_problems(obj: Any, schema: Schema, path: tuple = ()) -> list[Problem]:
    """Run every rule in ``schema`` (recursively) against ``obj``; one Problem per failed rule."""
    problems: list[Problem] = []
    context = None  # built once per node: converting the object to CEL values is the costly part
    for rule in schema.get("x-kubernetes-validations") or ():
        expr = rule["rule"]
        if "oldSelf" in expr:
            continue
        try:
            if context is None:
                context = context_for(obj)
            ok = _program(expr).execute(context)
        except Exception as exc:  # the apiserver reports evaluation errors as invalid values too
            problems.append(Problem(_field(path, rule), f"{rule.get('message', 'rule failed')} (rule error: {exc})",
                                    rule=expr))
            continue
        if ok is not True:
            problems.append(Problem(_field(path, rule), _message(rule, context), rule=expr))
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key, value in obj.items():
            if key in props:
                problems += cel_problems(value, props[key], path + (key,))
            elif isinstance(addl, dict):
                problems += cel_problems(value, addl, path + (key,))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            problems += cel_problems(item, schema["items"], path + (i,))
    return problems
