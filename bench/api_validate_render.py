"""Cost of validating and rendering MoEInference resources (what the operator does per reconcile).

    python bench/api_validate_render.py [--repeat N]

Prints, per example manifest: milliseconds per call of ``validate()`` (CRD schema + CEL + catalog
checks), of ``apiserver_problems()`` (CRD schema + CEL only, the apply-time path) and of
``render_children_of()``; then the wall time of ``moe-eplb validate -f`` as a fresh process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import yaml

from moe_eplb.api.spec import parse
from moe_eplb.api.validation import apiserver_problems, validate
from moe_eplb.render.objects import render_children

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def per_call_ms(fn, arg, repeat: int) -> float:
    fn(arg)  # warm caches (CRD load, compiled CEL programs, validators)
    start = time.perf_counter()
    for _ in range(repeat):
        fn(arg)
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "MoEInference":
                continue
            rows.append((path.name, per_call_ms(validate, doc, args.repeat),
                         per_call_ms(apiserver_problems, doc, args.repeat),
                         per_call_ms(render_children, doc, args.repeat), len(render_children_of(doc))))
    print(f"{'example':42} {'validate ms':>12} {'CRD-only ms':>12} {'render ms':>10} {'children':>9}")
    for name, v, a, r, n in rows:
        print(f"{name:42} {v:12.2f} {a:12.2f} {r:10.2f} {n:9d}")
    seed = EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moe_eplb", "validate", "-f", str(seed)], check=True, capture_output=True)
    print(f"\n`moe-eplb validate -f {seed.name}` as a new process: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()


def render_children_of(resource):
    """``render_children`` of a resource dict (parsed once)."""
    return render_children(parse(resource))
