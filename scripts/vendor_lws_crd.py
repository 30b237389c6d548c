"""Write ``harness/moe_eplb_harness/floor/lws_crd.yaml``: the LeaderWorkerSet CRD published by
kubernetes-sigs/lws, with its pod templates trimmed.

The published CRD (``config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml``, 1.3 MB) is
mostly three copies of the core v1 PodTemplateSpec / PersistentVolumeClaim schemas. This keeps every
LeaderWorkerSet field as published -- names, types, enums, defaults, bounds, required lists, the
status and the ``scale`` subresource paths -- and replaces only the schemas of
``spec.leaderWorkerTemplate.{leaderTemplate,workerTemplate}`` and ``volumeClaimTemplates`` items by
``x-kubernetes-preserve-unknown-fields`` objects (the renderer's pod templates are validated as core
v1 PodTemplates with ``kubernetes-validate`` instead). The emulated API server serves the
LeaderWorkerSet from this file and validates every LWS object and status written to it.

Usage::

    git -C <lws checkout> show HEAD:config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml \\
        > /tmp/lws-crd.yaml
    python scripts/vendor_lws_crd.py /tmp/lws-crd.yaml --source "kubernetes-sigs/lws@<commit>"
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vendor_crd import vendor  # noqa: E402 - the shared reader/writer next to this script

OUT = pathlib.Path(__file__).resolve().parents[1] / "harness" / "moe_eplb_harness" / "floor" / "lws_crd.yaml"
TRIMMED = ("leaderTemplate", "workerTemplate")


def _opaque(what: str, description: str | None) -> dict:
    text = (description or "").strip()
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "description": (text + "\n" if text else "") + f"(schema trimmed by moe-eplb: a core v1 {what})"}


def trim(crd: dict) -> dict:
    for version in crd["spec"]["versions"]:
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        lwt = spec["properties"]["leaderWorkerTemplate"]["properties"]
        for key in TRIMMED:
            lwt[key] = _opaque("PodTemplateSpec", lwt[key].get("description"))
        if "volumeClaimTemplates" in lwt:
            items = lwt["volumeClaimTemplates"]
            items["items"] = _opaque("PersistentVolumeClaim", items["items"].get("description"))
    return crd


def main() -> None:
    vendor(OUT, trim, kind="LeaderWorkerSet", published_path="config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
           what="pod templates trimmed", script="vendor_lws_crd.py", license_line="Apache-2.0, The Kubernetes Authors.",
           description=__doc__.splitlines()[0], source_example="kubernetes-sigs/lws@<commit>")


if __name__ == "__main__":
    main()
