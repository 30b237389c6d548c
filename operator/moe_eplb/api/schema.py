"""Apiserver-like handling of a custom object against the CRD's structural OpenAPI schema.

Three steps, in the apiserver's order: :func:`fill_schema_defaults` (schema ``default`` values, applied
recursively, also inside defaulted objects), :func:`unknown_field_problems` (what strict field
validation / ``kubectl apply --validate=strict`` reports; the apiserver would otherwise prune them
silently) and :func:`schema_problems` (types, enums, bounds, patterns, required fields) using
``openapi-schema-validator``'s OpenAPI 3.0 validator.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator
from typing import Any

from openapi_schema_validator import OAS30Validator

from moe_eplb.api.problem import REMOVE, Problem, Rename
from moe_eplb.api.quantity import QUANTITY_PATTERN

Schema = dict[str, Any]


def format_path(parts: Iterator[Any] | list[Any]) -> str:
    """``['spec', 'engine', 'extraArgs', 2]`` -> ``spec.engine.extraArgs[2]``; keys with dots or
    slashes (``nvidia.com/gpu``) are bracketed."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif any(c in str(part) for c in "./ "):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def fill_schema_defaults(obj: Any, schema: Schema) -> Any:
    """Fill in schema defaults like the apiserver does, returning a new object.

    For each object node, a missing property with a ``default`` gets a deep copy of it, then
    defaulting recurses into every present property (so ``default: {}`` on an object makes its
    children's defaults apply too). Array items and ``additionalProperties`` values are defaulted.
    """
    obj = copy.deepcopy(obj)
    _default_in_place(obj, schema)
    return obj


def _default_in_place(obj: Any, schema: Schema) -> None:
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if "default" in sub and (key not in obj or obj[key] is None):
                obj[key] = copy.deepcopy(sub["default"])
        for key, value in obj.items():
            if key in props:
                _default_in_place(value, props[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                _default_in_place(value, schema["additionalProperties"])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default_in_place(item, schema["items"])


def _preserves_unknown(schema: Schema) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields")) or schema.get(
        "x-kubernetes-embedded-resource", False
    )


def unknown_field_problems(obj: Any, schema: Schema, path: tuple = ()) -> list[Problem]:
    """Fields the schema does not declare (typos), each with a 'did you mean' when one is close.

    ``metadata`` at the root is an ObjectMeta the apiserver checks itself and is skipped.
    """
    problems: list[Problem] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for key, value in obj.items():
            if not path and key == "metadata":
                continue
            if props is not None and key in props:
                problems += unknown_field_problems(value, props[key], path + (key,))
            elif isinstance(addl, dict):
                problems += unknown_field_problems(value, addl, path + (key,))
            elif props is not None and not _preserves_unknown(schema) and addl is not True:
                guess = _guess(key, props)
                fix = (((path + (key,)), Rename(guess) if guess and guess not in obj else REMOVE),)
                problems.append(Problem(format_path(path + (key,)), _unknown_message(key, props), fix=fix))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            problems += unknown_field_problems(item, schema["items"], path + (i,))
    return problems


def _guess(key: str, props: dict[str, Any]) -> str | None:
    names = sorted(props)
    lowered = {n.lower(): n for n in names}
    return lowered.get(key.lower()) or next(iter(difflib.get_close_matches(key, names, n=1, cutoff=0.6)), None)


def _unknown_message(key: str, props: dict[str, Any]) -> str:
    names = sorted(props)
    guess = _guess(key, props)
    hint = f"did you mean {guess!r}?" if guess else f"known fields here: {', '.join(names)}"
    return f"unknown field {key!r}; {hint}"


def _oas_schema(schema: Any) -> Any:
    """Copy of a Kubernetes structural schema that the OAS 3.0 validator reads the same way.

    ``x-kubernetes-int-or-string`` without an explicit ``anyOf`` becomes ``anyOf: [int, str]``;
    ``pattern``/``format`` next to an int-or-string only constrain the string branch (as in Kubernetes).
    """
    if isinstance(schema, list):
        return [_oas_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _oas_schema(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


_VALIDATORS: dict[int, OAS30Validator] = {}


def schema_problems(obj: Any, schema: Schema) -> list[Problem]:
    """Type, enum, bound, pattern and required-field violations, one Problem per error."""
    validator = _VALIDATORS.get(id(schema))
    if validator is None:
        validator = _VALIDATORS[id(schema)] = OAS30Validator(_oas_schema(schema))
    problems = []
    seen: set[str] = set()
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else ""
            problems.append(Problem(format_path(path + [missing]), "required field is missing; set it"))
            continue
        where = format_path(path) or "<root>"
        if err.instance is None:  # "None for not nullable" and "None is not of type ...": one message
            if where in seen:
                continue
            seen.add(where)
        problems.append(Problem(where, _error_message(err)))
    return problems


def show(value: Any, limit: int = 60) -> str:
    """A value as a person reads it in a message, bounded: strings quoted and cut, ``true``/``null``
    as in YAML, lists and objects by size."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "…")
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} entries"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


_TYPE_WORDS = {"integer": "a whole number", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "an object (key: value)"}


_PATTERN_HINTS = {
    "image": "an image reference: [registry[:port]/]repository[:tag][@sha256:digest], lower-case repository "
    "(e.g. vllm/vllm-openai:v0.12.0)",
    "version": "a vLLM version like 0.12.0",
    "architecture": "a class name like Qwen3MoeForCausalLM",
    "memoryBudgetPerGpu": "a quantity like 8Gi",
    "prometheusUrl": "an http(s):// URL",
    "mountPath": "an absolute path",
}


def _error_message(err: Any) -> str:
    """A message naming what is wrong and the fix, with the offending value shown bounded."""
    v, value, bound = err.validator, err.instance, err.validator_value
    if value is None and v in ("type", "nullable"):
        return "must not be null: give a value or remove the key"
    if v == "type":
        want = " or ".join(_TYPE_WORDS.get(t, t) for t in ([bound] if isinstance(bound, str) else bound))
        return f"expected {want}, got {show(value)}"
    if v == "enum":
        return f"{show(value)} is not one of {', '.join(map(show, bound))}"
    if v == "pattern":
        field = str(err.absolute_path[-1]) if err.absolute_path else ""
        what = _PATTERN_HINTS.get(field) or ("a Kubernetes quantity like 16Gi or 500m" if bound == QUANTITY_PATTERN
                                             else f"the required form (regular expression {bound})")
        return f"{show(value)} does not match {what}"
    if v in ("minimum", "maximum"):
        exclusive = err.schema.get("exclusiveMinimum" if v == "minimum" else "exclusiveMaximum")
        rel = (">" if exclusive else ">=") if v == "minimum" else ("<" if exclusive else "<=")
        return f"{show(value)} must be {rel} {bound}; use a value in the allowed range"
    if v == "maxItems":
        return f"at most {bound} entries (got {len(value)}); remove some"
    if v == "minItems":
        return f"at least {bound} entries (got {len(value)})"
    if v == "maxLength":
        return f"at most {bound} characters (got {len(value)}); shorten it"
    if v == "minLength":
        return f"at least {bound} characters (got {len(value)})"
    if v == "maxProperties":
        return f"at most {bound} keys (got {len(value)})"
    return " ".join(str(err.message).split())[:200]
