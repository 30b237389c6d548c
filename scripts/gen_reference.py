#!/usr/bin/env python3
"""Generate docs/reference.md, the MoEInference field reference, FROM the CRD's OpenAPI schema.

The reference cannot drift from the API: every field, type, default, constraint, description and
validation rule comes from crds/moeinferences.eplb.ai.yaml, and tests/chart/test_reference_doc.py
fails when the committed file differs from this script's output.

    python scripts/gen_reference.py           # write docs/reference.md
    python scripts/gen_reference.py --check   # exit 1 if docs/reference.md is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "moeinferences.eplb.ai.yaml"
OUT = ROOT / "docs" / "reference.md"

_CONSTRAINTS = (
    ("minimum", "≥ {}"), ("maximum", "≤ {}"), ("exclusiveMinimum", "> {}"), ("exclusiveMaximum", "< {}"),
    ("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"), ("minItems", "items ≥ {}"),
    ("maxItems", "items ≤ {}"), ("pattern", "matches `{}`"), ("format", "format {}"),
)


def _text(s: str | None) -> str:
    """One markdown table cell: whitespace collapsed, pipes escaped."""
    return " ".join((s or "").split()).replace("|", "\\|")


def _json(v: Any) -> str:
    return json.dumps(v, separators=(", ", ": "))


def type_of(schema: dict[str, Any]) -> str:
    """A short human type: ``integer``, ``[]string``, ``map[string]integer``, ``int or string``."""
    if schema.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = schema.get("type")
    if t == "array":
        return "[]" + type_of(schema.get("items", {}))
    if t == "object":
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            return "map[string]" + type_of(addl)
        if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
            return "object (free-form)"
        return "object"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(type_of(s) for s in schema.get("anyOf", schema.get("oneOf", [])))
    return t or "any"


def constraints(schema: dict[str, Any]) -> str:
    out = []
    if "enum" in schema:
        out.append("one of " + ", ".join(f"`{e}`" for e in schema["enum"]))
    for key, fmt in _CONSTRAINTS:
        if key in schema and not (key == "exclusiveMinimum" and isinstance(schema[key], bool)):
            out.append(fmt.format(schema[key]))
    if schema.get("exclusiveMinimum") is True and "minimum" in schema:
        out[out.index(f"≥ {schema['minimum']}")] = f"> {schema['minimum']}"
    if schema.get("x-kubernetes-list-type"):
        out.append(f"list type {schema['x-kubernetes-list-type']}")
    return "; ".join(out)


#: fields whose schema is a Kubernetes type (generated, scripts/gen_podspec_schema.py): listed as
#: that type, not field by field (``kubectl explain`` documents them)
KUBERNETES_TYPES = {"spec.engine.podTemplate.spec": "core/v1 PodSpec"}


def walk(schema: dict[str, Any], path: str, required: bool = False, *,
         whole: bool = False) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Yield ``(path, schema, required)`` for every field below ``schema`` in document order; the
    fields inside :data:`KUBERNETES_TYPES` only with ``whole``."""
    props = schema.get("properties", {})
    req = set(schema.get("required", []))
    for name, sub in props.items():
        p = f"{path}.{name}" if path else name
        yield p, sub, name in req
        if p in KUBERNETES_TYPES and not whole:
            continue
        yield from walk(sub, p, whole=whole)
        items = sub.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from walk(items, p + "[]", whole=whole)
        addl = sub.get("additionalProperties")
        if isinstance(addl, dict) and addl.get("properties"):
            yield from walk(addl, p + "{}", whole=whole)


def field_table(root: dict[str, Any], path: str) -> list[str]:
    lines = ["| Field | Type | Default | Constraints | Description |", "| --- | --- | --- | --- | --- |"]
    for p, sub, req in walk(root, path):
        name = f"`{p}`" + (" **(required)**" if req else "")
        default = f"`{_json(sub['default'])}`" if "default" in sub else ""
        kind = KUBERNETES_TYPES.get(p) or type_of(sub)
        lines.append(f"| {name} | {kind} | {default} | {_text(constraints(sub))} | "
                     f"{_text(sub.get('description'))} |")
    return lines


def rules(root: dict[str, Any], path: str) -> Iterator[tuple[str, str, str]]:
    """``(path, rule, message)`` of every CEL validation rule, the root's included."""
    for r in root.get("x-kubernetes-validations", []):
        yield path or "(object)", r["rule"], r.get("message", "")
    for p, sub, _ in walk(root, path, whole=True):
        for r in sub.get("x-kubernetes-validations", []):
            yield p, r["rule"], r.get("message", "")
        items = sub.get("items")
        if isinstance(items, dict):
            for r in items.get("x-kubernetes-validations", []):
                yield p + "[]", r["rule"], r.get("message", "")


def render(crd: dict[str, Any]) -> str:
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v.get("storage")]
    schema = version["schema"]["openAPIV3Schema"]
    names = spec["names"]
    out = [
        "# MoEInference reference",
        "",
        "<!-- GENERATED by scripts/gen_reference.py from crds/moeinferences.eplb.ai.yaml; do not edit. -->",
        "",
        _text(schema.get("description")),
        "",
        "| | |",
        "| --- | --- |",
        f"| API | `{spec['group']}/{version['name']}` |",
        f"| Kind | `{names['kind']}` (list: `{names.get('listKind', names['kind'] + 'List')}`) |",
        f"| Plural / short names | `{names['plural']}` / {', '.join(f'`{s}`' for s in names.get('shortNames', []))} |",
        f"| Scope | {spec['scope']} |",
    ]
    sub = version.get("subresources", {})
    if sub:
        parts = []
        if "status" in sub:
            parts.append("`status`")
        if "scale" in sub:
            sc = sub["scale"]
            parts.append(f"`scale` (replicas `{sc['specReplicasPath']}` / `{sc['statusReplicasPath']}`, "
                         f"selector `{sc.get('labelSelectorPath', '')}`)")
        out.append(f"| Subresources | {', '.join(parts)} |")
    cols = version.get("additionalPrinterColumns", [])
    if cols:
        out += ["", "## `kubectl get moe` columns", "",
                "| Column | Type | From | Meaning |", "| --- | --- | --- | --- |"]
        for c in cols:
            wide = " (with `-o wide`)" if c.get("priority", 0) > 0 else ""
            out.append(f"| {c['name']}{wide} | {c['type']} | `{_text(c['jsonPath'])}` | {_text(c.get('description'))} |")
    props = schema["properties"]
    for section in ("spec", "status"):
        if section not in props:
            continue
        s = props[section]
        out += ["", f"## `{section}`", "", _text(s.get("description")), ""] + field_table(s, section)
    all_rules = list(rules(schema, ""))
    if all_rules:
        out += ["", "## Validation rules", "",
                "Checked by the API server (CEL) on create and update, and by `moe-eplb validate` offline. "
                "The message is what `kubectl apply` prints when the rule fails.", "",
                "| Where | Rule | Message |", "| --- | --- | --- |"]
        for p, rule, msg in all_rules:
            out.append(f"| `{p}` | `{_text(rule)}` | {_text(msg)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/reference.md is stale")
    args = ap.parse_args(argv)
    text = render(yaml.safe_load(CRD.read_text()))
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
