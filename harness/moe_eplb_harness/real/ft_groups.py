"""SIMULATED GPU nodes, fault-tolerant groups: what the node agent (:mod:`moe_eplb_harness.real.nodeagent`)
does differently for a LeaderWorkerSet group whose pods run ``vllm serve --enable-fault-tolerance``.
Not Kubernetes, not vLLM.

Without fault tolerance a group restarts together when one of its pods goes. With it (the operator
renders such a LeaderWorkerSet with ``restartPolicy: None``) the group's engine keeps running for
the survivors and its :class:`~moe_eplb_harness.engines.fault_tolerance.GroupFaultTolerance` plays vLLM's
side of the recovery:

- a pod of the group that goes (deleted, e.g. a node lost) or whose engine process dies
  (:func:`kill_engine`: the container restarts in place) takes its ranks with it: the engine's
  fault tolerance loses them, the pod's API stops answering, and the pod that replaces it (or the
  restarted container) waits to join a group that no longer admits it -- it stays unready, as a
  vLLM rank started into a running data-parallel group does, until the group is restarted whole;
- when every pod the group started with is gone, or its engines gave up (no recovery in time, a
  failed ``scale_down``), the engine stops and the group starts again once it is whole, as the
  restarted vLLM containers would form it again;
- :func:`fault` injects a transient fault (tests).

The pods' args go through Kubernetes' ``$(VAR)`` expansion with their env, Secrets included (the
kubelet's ``secretKeyRef``), so vLLM's ``--api-key`` holds the operator's control token exactly when
the rendered pod gives it.
"""

from __future__ import annotations

import base64
import logging
import re
from typing import Any

import aiohttp

from moe_eplb_harness.engines.fault_tolerance import FtConfig, GroupFaultTolerance, config_from_argv
from moe_eplb_harness.floor.pods import _tokens

log = logging.getLogger(__name__)


async def _resolved_container(agent: Any, namespace: str, container: dict) -> dict:
    """``container`` with each ``secretKeyRef`` env value read from its Secret (as a kubelet does)."""
    env = []
    for e in container.get("env") or []:
        ref = ((e.get("valueFrom") or {}).get("secretKeyRef") or {}) if isinstance(e, dict) else {}
        if ref.get("name") and ref.get("key"):
            try:
                secret = await agent.cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
                value = base64.b64decode(((secret or {}).get("data") or {})[ref["key"]]).decode()
            except (aiohttp.ClientResponseError, KeyError) as exc:
                raise ValueError(f"env {e.get('name')}: secret {ref['name']}/{ref['key']} unreadable: {exc}") from None
            env.append({"name": e["name"], "value": value})
        else:
            env.append(e)
    return {**container, "env": env}


def _version(image: str) -> tuple[int, int, int]:
    m = re.search(r":v?(\d+)\.(\d+)\.(\d+)", image or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, 34, 0)


async def attach(agent: Any, engine: Any, pods: list[Any]) -> None:
    """Give a group's engine vLLM's fault tolerance when its leader runs ``--enable-fault-tolerance``."""
    leader = pods[0]
    vllm = next((c for c in leader.spec.get("containers") or [] if c.get("name") == "vllm"), None)
    if vllm is None or "--enable-fault-tolerance" not in _tokens(vllm):
        return  # (the Secrets are read only for a fault-tolerant group's --api-key)
    container = await _resolved_container(agent, leader.namespace, vllm)
    tokens = _tokens({**container, "env": [e for e in container["env"] if "value" in e]})
    cfg = config_from_argv(tokens, _version(vllm.get("image", "")), **agent.ft_timing)
    if cfg is None:
        return
    per = cfg.data // len(pods)
    if per != 1:
        raise ValueError(f"the simulated fault tolerance serves one data-parallel rank per pod (dataLocal {per})")
    engine.ft = GroupFaultTolerance(cfg, agent.clock.now, hosts={p.worker * per + i: p.ip for p in pods
                                                                  for i in range(per)})


async def keep_serving(agent: Any, key: tuple[str, str, int], group: Any, members: dict[int, str]) -> bool:
    """The node agent's reconcile of a fault-tolerant group whose pods changed; True when handled
    here (the group serves on, or was stopped to start again), False when nothing changed."""
    engine = group.engine
    ft: GroupFaultTolerance = engine.ft
    pods = {p.worker: p for p in agent.pods.values() if p.group == key}
    ft.advance()
    if ft.exited is not None or not any(members.get(w) == uid for w, uid in group.members.items()):
        why = ft.exited or "every pod of the group is gone"
        log.info("node agent: fault-tolerant group %s/%s-%d stops: %s", *key, why)
        await engine.stop()
        del agent.groups[key]
        for p in pods.values():
            if ft.exited is not None and members.get(p.worker) == p.uid:  # the container exits and restarts
                p.restarts += 1
                p.last_termination = {"terminated": {"reason": "Error", "exitCode": 1, "message": why[:200]}}
            p.engine, p.settings, p.crash, p.ready_since = None, None, False, ""
        return True
    gone = [w for w, uid in group.members.items() if members.get(w) != uid and w not in ft.lost_pods]
    for w in gone:
        _lose(engine, w, "pod gone")
    for w, p in pods.items():  # a replacement waits to join a group that does not admit it
        if w in ft.lost_pods and p.engine is not None:
            p.engine, p.ready_since = None, ""
    return bool(gone) or members != group.members


def _lose(engine: Any, worker: int, why: str) -> None:
    ft: GroupFaultTolerance = engine.ft
    per = ft.cfg.data // engine.pods
    ft.lost_pods.add(worker)
    ft.lose(list(range(worker * per, (worker + 1) * per)), why=f"{why} (pod {worker})")
    engine.stop_pod(worker)


def kill_engine(agent: Any, namespace: str, pod: str) -> None:
    """The engine process of pod ``pod`` of a fault-tolerant group dies: its container restarts in
    place (``restartCount`` + 1) and its ranks are lost to the group."""
    p = next(p for p in agent.pods.values() if (p.namespace, p.name) == (namespace, pod))
    if p.engine is None or p.engine.ft is None:
        raise ValueError(f"pod {namespace}/{pod} runs no fault-tolerant engine")
    _lose(p.engine, p.worker, "engine process died")
    p.engine, p.ready_since = None, ""
    p.restarts += 1
    p.last_termination = {"terminated": {"reason": "Error", "exitCode": 1, "message": "simulated engine crash"}}


def fault(agent: Any, namespace: str, instance: str, group: int = 0, **kw: Any) -> GroupFaultTolerance:
    """A transient fault of every rank of ``instance``'s group ``group`` (``suspect``, ``fail_retries``)."""
    p = next(p for p in agent.pods.values() if (p.namespace, p.instance) == (namespace, instance)
             and p.group is not None and p.group[2] == group and p.engine is not None and p.engine.ft is not None)
    p.engine.ft.transient(**kw)
    return p.engine.ft


__all__ = ["FtConfig", "attach", "keep_serving", "kill_engine", "fault"]
