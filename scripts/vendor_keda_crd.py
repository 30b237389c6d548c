"""Write ``operator/moe_eplb/sim/keda_scaledobject_crd.yaml``: KEDA's published ScaledObject CRD,
trimmed of its descriptions.

The published CRD (``config/crd/bases/keda.sh_scaledobjects.yaml`` of kedacore/keda) is kept field
for field -- names, types, enums, defaults, bounds, patterns, required lists, the CEL rule of
``spec`` (minReplicaCount <= maxReplicaCount) and the status -- with only the ``description`` texts
removed. The emulated API server serves ScaledObjects from this file and validates every one
written to it, and ``tests/render/test_autoscaler.py`` validates the rendered ScaledObject against
it (schema, unknown fields and CEL).

Usage::

    git -C <keda checkout> show HEAD:config/crd/bases/keda.sh_scaledobjects.yaml > /tmp/keda-so.yaml
    python scripts/vendor_keda_crd.py /tmp/keda-so.yaml --source "kedacore/keda@<commit>"
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import yaml

OUT = pathlib.Path(__file__).resolve().parents[1] / "operator" / "moe_eplb" / "sim" / "keda_scaledobject_crd.yaml"


def strip_descriptions(node: Any, *, in_properties: bool = False) -> Any:
    """``node`` without ``description`` keys (a property *named* description is kept)."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v, in_properties=(k == "properties"))
                for k, v in node.items() if in_properties or k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crd", help="the published CRD file")
    ap.add_argument("--source", required=True, help="where it came from, e.g. kedacore/keda@<commit>")
    args = ap.parse_args()
    docs = [d for d in yaml.safe_load_all(pathlib.Path(args.crd).read_text()) if d]
    crd = strip_descriptions(docs[0])
    header = (f"# KEDA ScaledObject CRD from {args.source}\n"
              "# (config/crd/bases/keda.sh_scaledobjects.yaml), descriptions removed by\n"
              "# scripts/vendor_keda_crd.py. Apache-2.0, The KEDA Authors. Do not edit by hand.\n")
    OUT.write_text(header + yaml.safe_dump(crd, sort_keys=False, width=120))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
