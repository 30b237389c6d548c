"""What ``scripts/vendor_lws_crd.py`` and ``scripts/vendor_keda_crd.py`` share: read a published CRD
file (its first YAML document), transform it, and write it with a header naming where it came from.

``vendor(out, transform, kind=..., published_path=..., what=..., license_line=...)`` parses the
command line (``<crd file> --source <repo>@<commit>``), so each script only says what it keeps.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable, Sequence


def header(*, kind: str, source: str, published_path: str, what: str, script: str, license_line: str) -> str:
    """The comment block at the top of a vendored CRD (its first line names the source commit)."""
    return (f"# {kind} CRD from {source}\n"
            f"# ({published_path}), {what} by\n"
            f"# scripts/{script}. {license_line} Do not edit by hand.\n")


def vendor(out: pathlib.Path, transform: Callable[[dict], dict], *, kind: str, published_path: str, what: str,
           script: str, license_line: str, description: str, source_example: str,
           argv: Sequence[str] | None = None) -> None:
    """The command line of a vendoring script: read the CRD, ``transform`` it, write ``out``."""
    import yaml

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("crd", help="the published CRD file")
    ap.add_argument("--source", required=True, help=f"where it came from, e.g. {source_example}")
    args = ap.parse_args(argv)
    docs = [d for d in yaml.safe_load_all(pathlib.Path(args.crd).read_text()) if d]
    crd = transform(docs[0])
    out.write_text(header(kind=kind, source=args.source, published_path=published_path, what=what, script=script,
                          license_line=license_line) + yaml.safe_dump(crd, sort_keys=False, width=120))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
