"""What the operator intends a rendered replica group to launch, checked against what a vLLM
release's own launch logic settles on (tests/launch_logic/vllm_launcher.py), and the summary the
tier reports (the LB mode and the ranks served).

The intent is :func:`moe_eplb.api.layout.layout` of the group's shape as rendered (``--data-parallel-size``,
the pods of the group, ``--enable-fault-tolerance``). Per pod: the serve path and API server count,
the load-balancing mode, each API server's port and the ranks it dispatches to, the ranks whose
engines the pod starts. Per group: every rank is served by some API server, every rank's engine runs
in exactly one pod, and every API server is reachable through what the operator rendered: a container
port of that number and name, a Service port targeting it whose selector picks the pod, a PodMonitor
endpoint scraping it (when there is a PodMonitor), and the multi-port supervisor's health port.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_eplb.api.layout import SUPERVISOR_PORT, SUPERVISOR_PORT_NAME, Layout, PodLaunch, layout
from tests.launch_logic.pods import Pod, pods_of, request, run_shell


@dataclass
class GroupOutcome:
    """What vLLM settled on for a group: per pod its answer, and the summary."""

    pods: list[Pod]
    answers: list[dict[str, Any]]
    intent: Layout

    @property
    def lb(self) -> str:
        """The LB modes of the group's API servers (``internal``, ``hybrid``, ``external``)."""
        modes = sorted({f["lb"] for a in self.answers for f in a.get("front_ends", []) if "port" in f})
        return "+".join(modes) or "none"

    @property
    def served(self) -> list[int]:
        return sorted({r for a in self.answers for f in a.get("front_ends", []) if "port" in f for r in f["ranks"]})

    @property
    def errors(self) -> list[str]:
        return [f"{p.role} {p.index}: {a['error']}" for p, a in zip(self.pods, self.answers) if "error" in a]

    def row(self) -> dict[str, Any]:
        leader = next((f for f in self.answers[0].get("front_ends", []) if "port" in f), None)
        return {"lb": self.lb, "ranks_served": f"{len(self.served)}/{self.intent.data}",
                "leader_dispatches_to": _span(leader["ranks"]) if leader else "-",
                "api_ports_per_pod": max(len([f for f in a.get("front_ends", []) if "port" in f])
                                         for a in self.answers if "error" not in a) if not self.errors else "-",
                "errors": self.errors}


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def _arg(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def intent_of(pods: list[Pod]) -> Layout:
    """The operator's layout for the group's shape as rendered."""
    data = int(_arg(pods[0].argv, "--data-parallel-size") or 1)
    nodes = len(pods)
    count = _arg(pods[0].argv, "--api-server-count")
    external = "--enable-fault-tolerance" in pods[0].argv or "--enable-elastic-ep" in pods[0].argv
    return layout(data, data // nodes, nodes, external=external, api_server_count=int(count) if count else None)


def launch_group(children: list[dict[str, Any]], launcher) -> GroupOutcome:
    """Run every pod of the rendered group through its shell and the release's launch logic."""
    pods = run_shell(pods_of(children))
    return GroupOutcome(pods, [launcher.ask(request(p)) for p in pods], intent_of(pods))


def problems(children: list[dict[str, Any]], out: GroupOutcome) -> list[str]:
    """Everything in which vLLM's launch, or what was rendered around it, differs from the intent
    ([] = the group launches as the operator means it to)."""
    bad = list(out.errors)
    if bad:
        return bad
    for pod, answer, plan in zip(out.pods, out.answers, out.intent.pods):
        bad += _pod_problems(pod, answer, plan, out.intent)
    want = list(range(out.intent.data))
    if out.served != want:
        bad.append(f"the group's API servers dispatch to ranks {out.served}, not every rank {want}")
    engines = sorted(r for a in out.answers for f in a["front_ends"] for r in f["engines"])
    if engines != want:
        bad.append(f"the engines the pods start are ranks {engines}, not each of {want} once")
    return bad + _reachability(children, out)


def _pod_problems(pod: Pod, answer: dict[str, Any], plan: PodLaunch, lay: Layout) -> list[str]:
    who = f"{pod.role} {pod.index}"
    fronts = [f for f in answer["front_ends"] if "port" in f]
    if plan.headless:
        path = "headless"
    elif plan.supervised:
        path = "dp_supervisor"
    else:
        path = "multi_api_server" if plan.api_servers[0].processes > 1 else "api_server"
    bad = []
    if answer["path"] != path:
        bad.append(f"{who}: vLLM runs {answer['path']}, the operator means {path}")
    got = [(f["port"], f["ranks"], f["lb"], f["processes"]) for f in fronts]
    want = [(a.port, list(a.ranks), lay.lb, a.processes) for a in plan.api_servers]
    if got != want:
        bad.append(f"{who}: API servers (port, ranks, LB, processes) {got}, the operator means {want}")
    engines = sorted(r for f in answer["front_ends"] for r in f["engines"])
    if engines != list(plan.ranks):
        bad.append(f"{who}: starts the engines of ranks {engines}, the operator means {list(plan.ranks)}")
    if plan.supervised and answer.get("supervisor_port") != SUPERVISOR_PORT:
        bad.append(f"{who}: the supervisor's health is on {answer.get('supervisor_port')}, not {SUPERVISOR_PORT}")
    return bad


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _reachability(children: list[dict[str, Any]], out: GroupOutcome) -> list[str]:
    service = next(c for c in children if c["kind"] == "Service")
    monitor = next((c for c in children if c["kind"] == "PodMonitor"), None)
    svc_ports = {p["targetPort"]: p for p in service["spec"]["ports"]}
    scraped = {e["port"] for e in (monitor or {}).get("spec", {}).get("podMetricsEndpoints", [])}
    bad = []
    for pod, answer in zip(out.pods, out.answers):
        who = f"{pod.role} {pod.index}"
        for f in [f for f in answer["front_ends"] if "port" in f]:
            name = next((p["name"] for p in pod.container.get("ports") or [] if p["containerPort"] == f["port"]), None)
            if name is None:
                bad.append(f"{who}: no container port {f['port']} (the API of ranks {f['ranks']})")
                continue
            if name not in svc_ports or not _selects(service["spec"]["selector"], pod.labels):
                bad.append(f"{who}: the Service does not reach port {f['port']} ({name}, ranks {f['ranks']})")
            if monitor is not None and name not in scraped:
                bad.append(f"{who}: the PodMonitor does not scrape port {f['port']} ({name})")
        if answer.get("path") == "dp_supervisor" and pod.port(SUPERVISOR_PORT_NAME) != answer.get("supervisor_port"):
            bad.append(f"{who}: no container port {SUPERVISOR_PORT_NAME} for the supervisor's health "
                       f"({answer.get('supervisor_port')})")
    return bad
