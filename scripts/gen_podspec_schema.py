"""Generate the ``core/v1`` PodSpec schema of ``spec.engine.podTemplate.spec`` in the CRD.

Source: the OpenAPI v3 document of the core group (``/openapi/v3/api/v1``) as the kube-apiserver of
the release ``tools/kube`` builds serves it (started here from ``tools/kube/bin`` on loopback for a
few seconds: ``moe_eplb_harness.real.controlplane``), or a saved copy of that document (``--openapi``). The
served document is used rather than the copy in the ``k8s.io/kubernetes`` module
(``api/openapi-spec/v3``) because only the served one carries the enum values (``operator: In``,
``imagePullPolicy``), so the apiserver refuses ``operator: in`` when the MoEInference is applied.

The ``$ref``s are inlined into one structural schema (what a CRD needs): Quantity and IntOrString
become ``x-kubernetes-int-or-string`` (a Quantity also gets the quantity grammar as a pattern, so a
typo such as ``memory: 16GB`` is refused at apply time, not when the Deployment is created);
``x-kubernetes-list-type``, ``-list-map-keys`` and ``-map-type`` are kept, the strategic-merge
extensions (``x-kubernetes-patch-*``, ``-unions``) dropped (a CRD schema has no place for them),
``default`` kept only where a list-map key needs it (``protocol: TCP``, ``name: ""``), and ``required:
[containers]`` dropped at the root (an overlay is a fragment). Field descriptions are left out
(``kubectl explain pod.spec`` has them): with them the CRD is over 500 kB, past the 256 kB that a
client-side ``kubectl apply`` can record, and slower to load. Lists that the CRD's CEL rules walk
get a ``maxItems`` (:data:`MAX_ITEMS`) so that the rules' estimated cost fits the apiserver's budget.

The project's CEL rules for what the operator owns (:mod:`moe_eplb.api.podtemplate`) are attached
to it. The result goes into ``operator/moe_eplb/api/crd.yaml`` between :data:`BEGIN` and :data:`END`;
``tests/kube/test_podtemplate_real.py`` checks the committed block equals :func:`block_yaml` of
what the running apiserver serves.

Usage: ``python scripts/gen_podspec_schema.py`` (rewrites crd.yaml; then copy the CRD to crds/ and
the chart). ``--print`` writes the block to stdout instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
for _src in ("harness", "operator"):  # the product, and the harness's control plane (--live)
    if str(REPO / _src) not in sys.path:
        sys.path.insert(0, str(REPO / _src))

from moe_eplb.api.podtemplate import crd_node, engine_pod_fields  # noqa: E402
from moe_eplb.api.quantity import QUANTITY_PATTERN  # noqa: E402

CRD_YAML = REPO / "operator" / "moe_eplb" / "api" / "crd.yaml"
BEGIN = "# BEGIN generated PodSpec (scripts/gen_podspec_schema.py)"
END = "# END generated PodSpec"
#: indentation of ``podTemplate:`` under ``spec.engine.properties`` in crd.yaml
INDENT = " " * 20
REF_PREFIX = "#/components/schemas/"
POD_SPEC = "io.k8s.api.core.v1.PodSpec"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
#: bounds on the lists the CRD's CEL rules iterate (paths inside the PodSpec; ``[]`` = the items)
MAX_ITEMS = {
    ("containers",): 32,
    ("containers", "[]", "env"): 256,
    ("containers", "[]", "ports"): 64,
    ("containers", "[]", "volumeMounts"): 128,
    ("initContainers",): 32,
    ("volumes",): 256,
}
#: the schema keywords kept, in the order they are written (a served document and the module's copy
#: order keys differently)
_KEEP = ("type", "format", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "required",
         "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")


def served_openapi() -> dict[str, Any]:
    """``/openapi/v3/api/v1`` of the built kube-apiserver (tools/kube/bin), started for the purpose."""
    import tempfile

    from moe_eplb_harness.real.controlplane import ControlPlaneError, control_plane

    with tempfile.TemporaryDirectory(prefix="gen-podspec-") as tmp:
        try:
            with control_plane(tmp) as cp:
                return cp.request("GET", "/openapi/v3/api/v1")
        except ControlPlaneError as exc:
            raise SystemExit(f"{exc}; or pass --openapi with a saved /openapi/v3/api/v1") from None


def load_openapi(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _ref_name(node: dict[str, Any]) -> str | None:
    if "$ref" in node:
        return node["$ref"].removeprefix(REF_PREFIX)
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "$ref" in all_of[0]:
        return all_of[0]["$ref"].removeprefix(REF_PREFIX)
    return None


def _special(name: str) -> dict[str, Any] | None:
    if name == QUANTITY:
        return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                "pattern": QUANTITY_PATTERN}
    if name == INT_OR_STRING:
        return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    return None


def structural(node: dict[str, Any], schemas: dict[str, Any], path: tuple[str, ...] = (),
               stack: tuple[str, ...] = ()) -> dict[str, Any]:
    """``node`` with every ``$ref`` inlined, as a structural CRD schema (see the module docstring)."""
    name = _ref_name(node)
    out: dict[str, Any]
    if name is not None:
        if name in stack:
            raise ValueError(f"recursive schema {name} at {'.'.join(path)}")
        special = _special(name)
        if special is not None:
            return special
        return structural(schemas[name], schemas, path, stack + (name,))
    out = {k: node[k] for k in _KEEP if k in node}
    if "properties" in node:
        out["properties"] = {key: structural(sub, schemas, path + (key,), stack)
                             for key, sub in sorted(node["properties"].items())}
        if "type" not in out:
            out["type"] = "object"
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], schemas, path + ("{}",), stack)
        out.setdefault("type", "object")
    if isinstance(node.get("items"), dict):
        out["items"] = structural(node["items"], schemas, path + ("[]",), stack)
        if path in MAX_ITEMS:
            out["maxItems"] = MAX_ITEMS[path]
    _list_key_defaults(out)
    return out


def _list_key_defaults(out: dict[str, Any]) -> None:
    """Mark upstream's ``default`` of list-map keys that are not required (a structural schema needs
    one or the other): ``protocol: TCP`` of a container port, ``name: ""`` of an image pull secret."""
    item = out.get("items") or {}
    for key in out.get("x-kubernetes-list-map-keys") or ():
        prop = (item.get("properties") or {}).get(key)
        if prop is not None and key not in (item.get("required") or ()) and "default" in prop:
            prop[_KEEP_DEFAULT] = True


_KEEP_DEFAULT = "__keep_default"


def _drop_defaults(node: Any) -> None:
    """Remove every ``default`` but the marked ones (see :func:`_list_key_defaults`)."""
    if isinstance(node, dict):
        if not node.pop(_KEEP_DEFAULT, False):
            node.pop("default", None)
        for key in ("properties",):
            for sub in (node.get(key) or {}).values():
                _drop_defaults(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                _drop_defaults(node[key])


def pod_spec_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """The structural schema of ``spec.engine.podTemplate.spec`` from the core group's OpenAPI v3."""
    schemas = doc["components"]["schemas"]
    spec = structural(schemas[POD_SPEC], schemas)
    _drop_defaults(spec)
    spec.pop("required", None)  # a fragment: the operator supplies the containers
    return {"description": POD_SPEC_DESCRIPTION, **spec}


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


POD_SPEC_DESCRIPTION = ("A core/v1 PodSpec fragment merged into every engine pod like a strategic merge "
                        "(`kubectl explain pod.spec` documents the fields): the container named vllm "
                        "merges into the engine container, other containers are added; volumes, "
                        "imagePullSecrets and env merge by name, tolerations are appended, scalars set. "
                        "What the operator owns is refused (see docs/resource.md).")


def block_yaml(doc: dict[str, Any]) -> str:
    """The lines of crd.yaml between the markers: the engine's pod-level fields outside the overlay
    (``env``, ``imagePullSecrets``, ``nodeSelector``, ``resources``, ``tolerations``: the PodSpec's own
    schemas, :func:`moe_eplb.api.podtemplate.engine_pod_fields`), then ``podTemplate:`` and its schema
    (the generated PodSpec inside the overlay's node and CEL rules, :func:`moe_eplb.api.podtemplate.crd_node`),
    indented."""
    spec = pod_spec_schema(doc)
    body = yaml.dump({**engine_pod_fields(spec), "podTemplate": crd_node(spec)}, Dumper=_NoAliases, sort_keys=False,
                     width=100000, allow_unicode=True)
    return "".join(INDENT + line + "\n" for line in body.splitlines())


def crd_block(text: str) -> str:
    """The generated block currently in ``text`` (a crd.yaml)."""
    start = text.index("\n", text.index(BEGIN)) + 1
    end = text.rindex("\n", 0, text.index(END)) + 1
    return text[start:end]


def regenerate(doc: dict[str, Any], path: Path = CRD_YAML) -> bool:
    text = path.read_text(encoding="utf-8")
    old, new = crd_block(text), block_yaml(doc)
    if old == new:
        return False
    path.write_text(text.replace(BEGIN + "\n" + old, BEGIN + "\n" + new, 1), encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openapi", type=Path, help="a saved /openapi/v3/api/v1 (default: ask the built apiserver)")
    ap.add_argument("--print", action="store_true", help="print the block instead of rewriting crd.yaml")
    args = ap.parse_args(argv)
    if args.openapi is not None and not args.openapi.is_file():
        print(f"{args.openapi}: not found; save the kube-apiserver's /openapi/v3/api/v1 there", file=sys.stderr)
        return 1
    doc = load_openapi(args.openapi) if args.openapi is not None else served_openapi()
    if args.print:
        sys.stdout.write(block_yaml(doc))
        return 0
    print(("updated " if regenerate(doc) else "unchanged ") + str(CRD_YAML))
    return 0


if __name__ == "__main__":
    sys.exit(main())
