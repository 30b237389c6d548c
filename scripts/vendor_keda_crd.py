"""Write ``harness/moe_eplb_harness/floor/keda_scaledobject_crd.yaml``: KEDA's published ScaledObject CRD,
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

import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vendor_crd import vendor  # noqa: E402 - the shared reader/writer next to this script

OUT = pathlib.Path(__file__).resolve().parents[1] / "harness" / "moe_eplb_harness" / "floor" / "keda_scaledobject_crd.yaml"


def strip_descriptions(node: Any, *, in_properties: bool = False) -> Any:
    """``node`` without ``description`` keys (a property *named* description is kept)."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v, in_properties=(k == "properties"))
                for k, v in node.items() if in_properties or k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main() -> None:
    vendor(OUT, strip_descriptions, kind="KEDA ScaledObject", published_path="config/crd/bases/keda.sh_scaledobjects.yaml",
           what="descriptions removed", script="vendor_keda_crd.py", license_line="Apache-2.0, The KEDA Authors.",
           description=__doc__.splitlines()[0], source_example="kedacore/keda@<commit>")


if __name__ == "__main__":
    main()
