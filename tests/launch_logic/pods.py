"""The pods of a rendered replica group and the exact argv their ``vllm`` executable receives.

From the rendered children (``moe-eplb render``'s objects, or a golden file's): the Deployment's pod,
or the leader and every worker of a LeaderWorkerSet group with the env LeaderWorkerSet injects
(``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``). Each engine container's
``command`` + ``args`` go through Kubernetes' ``$(VAR)`` expansion with the container's env
(:func:`moe_eplb_harness.floor.pods.container_argv`), and then run for real: ``/bin/sh -c SCRIPT vllm ARGS``
with ``PATH`` holding only a recording ``vllm`` (it writes its argv) and a no-op ``rm`` (the script's
``/dev/shm`` clean must not touch this machine's), so every quote, ``$((...))`` and ``"$@"`` is the
shell's own doing.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_eplb.contracts import k8s_names
from moe_eplb_harness.floor.pods import container_argv, container_env

FAKE_VLLM = '#!/bin/sh\nprintf \'%s\\0\' "$@" > "$MOE_EPLB_TEST_ARGV"\n'
FAKE_RM = "#!/bin/sh\nexit 0\n"


@dataclass
class Pod:
    """One engine pod: its role in the group (``pod``, ``leader``, ``worker``), LWS worker index, the
    rendered engine container, the env it runs with and what its ``vllm`` got (``argv``, after
    :func:`run_shell`)."""

    role: str
    index: int
    container: dict[str, Any]
    labels: dict[str, str]
    env: dict[str, str]
    argv: list[str] = field(default_factory=list)

    def port(self, name: str) -> int | None:
        return next((int(p["containerPort"]) for p in self.container.get("ports") or [] if p.get("name") == name), None)


def _engine(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == k8s_names.ENGINE_CONTAINER)


def pods_of(children: list[dict[str, Any]]) -> list[Pod]:
    """The engine pods of one replica group of the workload among ``children``."""
    workload = next(c for c in children if c["kind"] in ("Deployment", "LeaderWorkerSet"))
    name, ns = workload["metadata"]["name"], workload["metadata"].get("namespace", "default")
    if workload["kind"] == "Deployment":
        tmpl = workload["spec"]["template"]
        c = _engine(tmpl)
        return [Pod("pod", 0, c, dict(tmpl["metadata"].get("labels") or {}), container_env(c))]
    lwt = workload["spec"]["leaderWorkerTemplate"]
    size = int(lwt["size"])
    # LWS's address of the leader: <leader>.<the pods' subdomain>.<ns>, the subdomain being the group's
    # headless Service (UniquePerReplica) or the LWS's (Shared, LWS's default)
    policy = (workload["spec"].get("networkConfig") or {}).get("subdomainPolicy") or "Shared"
    address = f"{name}-0.{name + '-0' if policy == 'UniquePerReplica' else name}.{ns}"
    out = []
    for i in range(size):
        tmpl = lwt["leaderTemplate"] if i == 0 else lwt["workerTemplate"]
        c = _engine(tmpl)
        lws = {k8s_names.LWS_LEADER_ADDRESS_ENV: address, k8s_names.LWS_GROUP_SIZE_ENV: str(size),
               k8s_names.LWS_WORKER_INDEX_ENV: str(i)}
        labels = {**(tmpl["metadata"].get("labels") or {}), k8s_names.LWS_WORKER_INDEX_LABEL: str(i)}
        out.append(Pod("leader" if i == 0 else "worker", i, c, labels, {**container_env(c), **lws}))
    return out


def run_shell(pods: list[Pod]) -> list[Pod]:
    """Run each pod's expanded command with the recording ``vllm``; fills ``Pod.argv`` (``vllm``'s
    arguments, ``serve`` first)."""
    with tempfile.TemporaryDirectory(prefix="launch-logic-") as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        for name, text in (("vllm", FAKE_VLLM), ("rm", FAKE_RM)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        for n, pod in enumerate(pods):
            out = Path(tmp) / f"argv-{n}"
            argv = container_argv(pod.container, pod.env)
            env = {**pod.env, "PATH": str(bin_dir), "MOE_EPLB_TEST_ARGV": str(out)}
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, cwd=tmp)
            if proc.returncode != 0 or not out.exists():
                raise AssertionError(f"{pod.role} {pod.index}: {argv[:3]} exited {proc.returncode}: {proc.stderr}")
            pod.argv = out.read_bytes().decode().split("\0")[:-1]
    return pods


def request(pod: Pod) -> dict[str, Any]:
    """The launcher request of a pod (its argv and env)."""
    return {"argv": pod.argv, "env": {k: v for k, v in pod.env.items() if isinstance(v, str)}}


def joiners_of(children: list[dict[str, Any]]) -> list[Pod]:
    """The pods of an elastic group's joiners' StatefulSet (``<name>-join-0`` ...), each with its own name
    in the env the downward API gives it (its first rank comes from it)."""
    sts = next((c for c in children if c["kind"] == "StatefulSet"), None)
    if sts is None:
        return []
    tmpl = sts["spec"]["template"]
    out = []
    for j in range(int(sts["spec"]["replicas"])):
        c = _engine(tmpl)
        env = {**container_env(c), k8s_names.POD_NAME_ENV: f"{sts['metadata']['name']}-{j}"}
        out.append(Pod("joiner", j, c, dict(tmpl["metadata"].get("labels") or {}), env))
    return out
