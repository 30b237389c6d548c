"""Per example: the load-balancing mode and the ranks served that a vLLM release's own launch logic
settles on for what the operator renders (a table; the launch-logic tier's machinery without its
assertions).

    python -m tests.launch_logic.report [--release 0.34.0] [--operator DIR]

``--operator DIR``: render with the ``moe_eplb`` package under DIR (e.g. an older checkout's
``operator/``) instead of this tree's, to compare before and after a change. Only what every version
of the operator has is used: ``check_for_operator``, ``render_children``, and the pods' own shell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def summarize(pods, answers, data: int) -> dict:
    """LB mode(s) of the group's API servers, ranks they dispatch to, API ports a pod."""
    fronts = [f for a in answers for f in a.get("front_ends", []) if "port" in f]
    served = sorted({r for f in fronts for r in f["ranks"]})
    errors = [a["error"] for a in answers if "error" in a]
    leader = [f for f in answers[0].get("front_ends", []) if "port" in f]
    span = (f"{leader[0]['ranks'][0]}-{leader[0]['ranks'][-1]}" if leader and len(leader) == 1 else
            f"{len(leader)} API servers, 1 rank each" if leader else "-")
    return {"lb": "+".join(sorted({f["lb"] for f in fronts})) or "-", "served": f"{len(served)}/{data}",
            "leader_api_dispatches_to": span, "errors": errors}


def reachable(children, pods, answers) -> str:
    """API servers the rendered Service reaches (a port of it targets theirs and it selects the pod)."""
    service = next(c for c in children if c["kind"] == "Service")
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    sel = service["spec"]["selector"]
    total = hit = 0
    for pod, answer in zip(pods, answers):
        names = {p["containerPort"]: p["name"] for p in pod.container.get("ports") or []}
        for f in (f for f in answer.get("front_ends", []) if "port" in f):
            total += len(f["ranks"]) if f["lb"] != "internal" else 0
            ok = names.get(f["port"]) in targets and all(pod.labels.get(k) == v for k, v in sel.items())
            if f["lb"] == "internal":
                return "all (internal LB)" if ok and f["ranks"] else "none"
            hit += len(f["ranks"]) if ok else 0
    return f"{hit}/{total}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default=None, help="a vLLM release of the tier (default: per example, the newest "
                    "release here at or below the version it asks for)")
    ap.add_argument("--operator", type=Path, default=REPO / "operator", help="the operator/ to render with")
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args()
    sys.path.insert(0, str(opts.operator))
    for name in [m for m in sys.modules if m == "moe_eplb" or m.startswith("moe_eplb.")]:
        del sys.modules[name]
    from moe_eplb.api.spec import OperatorDefaults
    from moe_eplb.api.validation import check_for_operator
    from moe_eplb.render.objects import render_children
    from tests.example_manifests import EXAMPLES, load_moeinferences
    from tests.launch_logic.conftest import RELEASES, Launcher, wheel_version
    from tests.launch_logic.pods import pods_of, request, run_shell
    from tests.vllm_sources import vllm_source_root

    launchers: dict[str, Launcher] = {}

    def launcher_for(version) -> Launcher:
        here = [r for r in RELEASES if r == wheel_version() or vllm_source_root(r)[0] is not None]
        fit = [r for r in here if version is None or tuple(int(x) for x in r.split(".")[:2]) <= tuple(version[:2])]
        release = opts.release or (fit or here)[-1]
        if release not in launchers:
            root = None if release == wheel_version() else vllm_source_root(release)[0]
            launchers[release] = Launcher(release, root)
        return launchers[release]

    rows = []
    try:
        for path in sorted(EXAMPLES.glob("*.yaml")):
            for resource in load_moeinferences(path):
                checked = check_for_operator(resource, OperatorDefaults(prometheus_url="http://prometheus:9090"))
                if checked.problems:
                    rows.append({"example": path.stem, "errors": [str(p) for p in checked.problems]})
                    continue
                launcher = launcher_for(checked.inference.engine.version)
                children = render_children(checked.inference)
                pods = run_shell(pods_of(children))
                answers = [launcher.ask(request(p)) for p in pods]
                data = checked.inference.parallelism.data
                row = {"example": path.stem, "release": launcher.version, "pods": len(pods),
                       **summarize(pods, answers, data), "service_reaches": reachable(children, pods, answers)}
                rows.append(row)
    finally:
        for launcher in launchers.values():
            launcher.close()
    if opts.json:
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    print(f"vLLM's launch logic on the rendered examples (operator: {opts.operator})")
    print("| example | vLLM | pods | LB mode | ranks served | leader's API dispatches to | ranks the Service reaches |")
    print("| --- | --- | ---: | --- | ---: | --- | --- |")
    for r in rows:
        if r.get("errors") and "lb" not in r:
            print(f"| {r['example']} | refused: {r['errors'][0][:80]} |")
            continue
        print(f"| {r['example']} | {r['release']} | {r['pods']} | {r['lb']} | {r['served']} | {r['leader_api_dispatches_to']} "
              f"| {r['service_reaches']} |" + (f" errors: {r['errors']}" if r["errors"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
