"""What the two simulated kubelets share -- :class:`~moe_eplb_harness.emulated.kubelet.FakeKubelet` (on the
emulation) and :class:`~moe_eplb_harness.real.nodeagent.NodeAgent` (on the real control plane). Not
Kubernetes.

- reading a pod spec as the kubelet does: Kubernetes' ``$(VAR)`` expansion (:func:`expand_vars`,
  :func:`container_env`, :func:`container_argv`) and the EPLB settings of its ``vllm serve``
  container (:func:`engine_settings`, :class:`PodSpecError`);
- what an engine factory is asked for (:class:`EngineRequest`);
- what every simulated kubelet of a world is given (:class:`KubeletSettings`);
- the poll loop, the trace and expert groups per MoEInference, the ready-pods notice and a crashing
  container's back-off (:class:`PollingKubelet`), and changing the deployment's truth while engines
  run (:meth:`PollingKubelet.set_true_cost`);
- the label selector of the pods moe-eplb manages (:data:`MANAGED_SELECTOR`).

Imports neither backend package (``emulated``, ``real``): both import this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moe_eplb.api.knobs import VLLM_DEFAULTS, Knobs, KnobsError
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb_harness.engines.engine import EngineFaults, EngineRun, EngineSettings, SimClock, SimulatedEngine
from moe_eplb_harness.engines.physics import TrueCost

log = logging.getLogger(__name__)

MANAGED_SELECTOR = "app.kubernetes.io/managed-by=moe-eplb"
CRASH_BACKOFF_SECONDS = 10.0  # simulated seconds before the first restart; doubles, capped at 300


class PodSpecError(ValueError):
    """The pod template does not say how to run the simulated engine."""


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in a container's ``command``, ``args`` and env values
    (k8s.io/kubernetes third_party/forked/golang/expansion): ``$(VAR)`` becomes VAR's value when VAR
    is in ``env``, else stays as written; ``$$`` becomes ``$``; a ``$`` before any other character,
    or a ``$(`` without a closing ``)``, stays as written. One pass: expanded values are not rescanned.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:close]
            out.append(env[name] if name in env else f"$({name})")
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def container_env(container: dict) -> dict[str, str]:
    """The literal env of a container as Kubernetes resolves it: in order, each ``value`` expanded
    with the variables defined before it (``valueFrom`` entries are skipped: no API here)."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if isinstance(e, dict) and "value" in e and isinstance(e.get("name"), str):
            env[e["name"]] = expand_vars(str(e["value"]), env)
    return env


def container_argv(container: dict, env: Mapping[str, str] | None = None) -> list[str]:
    """The argv a container runs: ``command`` + ``args`` after Kubernetes' ``$(VAR)`` expansion
    with ``env`` (default: :func:`container_env`)."""
    env = container_env(container) if env is None else env
    return [expand_vars(str(t), env) for t in list(container.get("command") or []) + list(container.get("args") or [])]


def _tokens(container: dict) -> list[str]:
    raw = container_argv(container)
    if len(raw) >= 3 and raw[0].rsplit("/", 1)[-1] in ("sh", "bash") and raw[1] == "-c":
        # `sh -c SCRIPT NAME ARGS...`: the script's words, its "$@" replaced by ARGS
        words = shlex.split(raw[2])
        params = raw[4:]
        out: list[str] = []
        for w in words:
            out += params if w == "$@" else [w]
        return out
    out = []
    for tok in raw:
        if isinstance(tok, str) and (tok.startswith(("vllm ", "exec vllm ")) or (" --" in tok and "{" not in tok)):
            out += shlex.split(tok)  # a `[exec] vllm serve ...` command line (a JSON arg is one token)
        else:
            out.append(str(tok))
    return out


def _flag(tokens: list[str], *flags: str) -> str | None:
    for i, tok in enumerate(tokens):
        for f in flags:
            if tok == f and i + 1 < len(tokens):
                return tokens[i + 1]
            if tok.startswith(f + "="):
                return tok[len(f) + 1:]
    return None


def vllm_flag(container: dict, *flags: str) -> str | None:
    """The value of one of ``flags`` in the ``vllm serve`` command a container runs (after Kubernetes'
    expansion and its ``sh -c`` script's ``"$@"``), or None."""
    return _flag(_tokens(container), *flags)


def runs_flag(container: dict, flag: str) -> bool:
    """Whether the container's ``vllm serve`` command has the bare ``flag``."""
    return flag in _tokens(container)


def engine_settings(pod_spec: dict, *, share: float = 1.0, num_groups: int = 1) -> EngineSettings:
    """EPLB settings of the vLLM container in ``pod_spec`` (a Pod template's ``spec``).

    Raises:
        PodSpecError: no container runs ``vllm serve``, or its EPLB arguments are malformed.
    """
    for c in pod_spec.get("containers") or []:
        toks = _tokens(c)
        if "serve" not in toks:
            continue
        i = toks.index("serve")
        model = _flag(toks, "--served-model-name") or _flag(toks, "--model") or (
            toks[i + 1] if i + 1 < len(toks) and not toks[i + 1].startswith("-") else "model")
        tp = int(_flag(toks, "--tensor-parallel-size", "-tp") or 1)
        dp = int(_flag(toks, "--data-parallel-size", "-dp") or 1)
        enabled = "--enable-eplb" in toks
        w, iv, r = VLLM_DEFAULTS.window_size, VLLM_DEFAULTS.step_interval, VLLM_DEFAULTS.num_redundant_experts
        cfg = _flag(toks, "--eplb-config")
        if cfg is not None:
            try:
                d = json.loads(cfg)
            except json.JSONDecodeError as exc:
                raise PodSpecError(f"--eplb-config: not JSON ({exc})") from exc
            w, iv, r = int(d.get("window_size", w)), int(d.get("step_interval", iv)), int(d.get("num_redundant_experts", r))
        w = int(_flag(toks, "--eplb-window-size") or w)
        iv = int(_flag(toks, "--eplb-step-interval") or iv)
        r = int(_flag(toks, "--num-redundant-experts") or r)
        try:
            knobs = Knobs(w, iv, r)
        except KnobsError as exc:
            raise PodSpecError(f"EPLB arguments: {exc}") from exc
        return EngineSettings(model=model, ep_size=tp * dp, knobs=knobs, eplb_enabled=enabled,
                              num_groups=num_groups, share=share)
    raise PodSpecError("no container runs `vllm serve`")


async def mount_engine(api: Any, engine: Any, namespace: str, instance: str, pod_spec: dict | None) -> None:
    """What a started pod mounts that a simulated engine reads, as the kubelet mounts it: the
    operator's control token (Secret ``<instance>-control``: the engine's live-apply route checks it)
    and the live settings (ConfigMap ``<instance>-eplb-live``): applied before the engine's first step
    when written for this pod's template (their ``configHash`` is the container's
    ``MOE_EPLB_CONFIG_HASH``), as each worker of a real pod applies them at start
    (:mod:`moe_eplb.exporter.live`). Objects that are missing are skipped (the pod volumes are optional)."""
    import base64

    from moe_eplb.contracts import k8s_names
    from moe_eplb.contracts import live_protocol as lp
    from moe_eplb.contracts.vllm_facts import first_rearrangement_step

    if not isinstance(engine, SimulatedEngine) or api is None:
        return
    base = f"/api/v1/namespaces/{namespace}"
    secret = await api.request("GET", f"{base}/secrets/{k8s_names.control_secret_name(instance)}", missing_ok=True)
    data = ((secret or {}).get("data") or {}).get(k8s_names.CONTROL_TOKEN_KEY)
    engine.control_token = base64.b64decode(data).decode() if data else None
    cm = await api.request("GET", f"{base}/configmaps/{k8s_names.live_configmap_name(instance)}", missing_ok=True)
    try:
        values = json.loads(((cm or {}).get("data") or {}).get(k8s_names.LIVE_FILE_KEY) or "{}")
    except ValueError:
        return
    own = next((container_env(c).get(k8s_names.CONFIG_HASH_ENV) for c in (pod_spec or {}).get("containers") or []
                if container_env(c).get(k8s_names.CONFIG_HASH_ENV)), None)
    if not values or own is None or values.get(lp.FILE_HASH) != own:
        return
    replay = engine.replay
    if replay.steps == 0:
        knobs = Knobs(int(values[lp.FILE_WINDOW]), int(values[lp.FILE_INTERVAL]), replay.s.knobs.num_redundant_experts)
        replay.s = dataclasses.replace(replay.s, knobs=knobs)
        replay.next_rearrange = first_rearrangement_step(knobs.step_interval)


@dataclass(frozen=True)
class EngineRequest:
    """What the kubelet asks an engine factory for: the engine of one Deployment pod, or of one
    LeaderWorkerSet group (``pods`` > 1: the leader's pod spec; every pod of it runs the same args).

    Attributes:
        settings: the EPLB settings parsed from the pod spec (:func:`engine_settings`).
        instance: the MoEInference (pod label ``eplb.ai/name``).
        namespace: the pod's namespace.
        pod_spec: the pod's spec as the workload's template has it (containers, command, args, env);
            a copy, the factory may keep it.
        pods: pods the engine spans.
        seed: a number distinct per engine the kubelet starts (the pods created so far).
    """

    settings: EngineSettings
    instance: str
    namespace: str
    pod_spec: dict
    pods: int = 1
    seed: int = 0


@dataclass(frozen=True)
class KubeletSettings:
    """What every simulated kubelet of a world is given -- the emulated one
    (:class:`~moe_eplb_harness.emulated.kubelet.FakeKubelet`) and the real control plane's node agent
    (:class:`~moe_eplb_harness.real.nodeagent.NodeAgent`): the load the engines replay, the clock, how
    they start and run, and the faults to inject."""

    workload: LoadTrace | Mapping[str, LoadTrace]
    """The trace every engine replays (following ``clock``), or MoEInference name -> trace (``"*"``:
    the default); ``bucket_seconds`` set."""

    clock: SimClock
    """The world's simulated time."""

    startup_seconds: float = 120.0
    """Simulated seconds of model loading before a pod is ready."""

    engine_tick: float = 0.1
    """Wall seconds between two passes of an engine's replay."""

    poll: float = 0.1
    """Wall seconds between two reconciliations of the kubelet."""

    num_groups: int | Mapping[str, int] = 1
    """Expert groups of the model (the hierarchical policy), or MoEInference name -> groups."""

    true_cost: TrueCost | None = None
    """The deployment's true costs the engines' telemetry comes from (hidden from the operator);
    None: ``TrueCost()``. Changed while engines run by :meth:`PollingKubelet.set_true_cost`."""

    crash_if: Callable[[EngineSettings], bool] | None = None
    """Engine settings -> True when every pod with them crash-loops (tests)."""

    crash_pod_if: Callable[[EngineSettings, int], bool] | None = None
    """(engine settings, worker index) -> True when that pod of a LeaderWorkerSet group crash-loops."""

    faults_for: Callable[[EngineSettings], EngineFaults] | None = None
    """Engine settings -> the faults its engines run with (none by default)."""

    on_change: Callable[[list[dict]], Any] | None = None
    """Called (awaited if a coroutine) with the ready pods' scrape targets whenever they change."""


class PollingKubelet:
    """What the two simulated kubelets share -- :class:`moe_eplb_harness.emulated.kubelet.FakeKubelet` (the
    emulation) and :class:`moe_eplb_harness.real.nodeagent.NodeAgent` (the real control plane): the trace and the expert
    groups per MoEInference, the poll loop around ``reconcile_once()`` (a failed pass is logged and
    retried, never fatal), the ``on_change(targets)`` notice when the ready pods change, and a crashing
    container's restarts with a doubling back-off (:meth:`advance_crash`)."""

    #: how the poll loop's task and warnings name it
    role = "kubelet"
    workload: LoadTrace | Mapping[str, LoadTrace]
    num_groups: int | Mapping[str, int]
    poll: float
    on_change: Callable[[list[dict]], Any] | None
    true_cost: Any = None
    _task: asyncio.Task | None = None
    _last_targets: list[dict] | None = None

    startup_seconds: float
    engine_tick: float
    crash_if: Callable[[EngineSettings], bool]
    crash_pod_if: Callable[[EngineSettings, int], bool]
    faults_for: Callable[[EngineSettings], EngineFaults]

    def _take(self, ks: KubeletSettings) -> None:
        """This kubelet's share of the world's :class:`KubeletSettings` (``true_cost`` may change later)."""
        self.workload, self.clock = ks.workload, ks.clock
        self.startup_seconds, self.engine_tick, self.poll = ks.startup_seconds, ks.engine_tick, ks.poll
        self.num_groups, self.true_cost, self.on_change = ks.num_groups, ks.true_cost, ks.on_change
        self.crash_if = ks.crash_if or (lambda s: False)
        self.crash_pod_if = ks.crash_pod_if or (lambda s, worker: False)
        self.faults_for = ks.faults_for or (lambda s: EngineFaults())

    def engine_run(self, settings: EngineSettings, seed: int, **where: Any) -> EngineRun:
        """How an engine with ``settings`` started now runs (``where``: its ``pods``, ``hosts``,
        ``port``, ``api_port``)."""
        return EngineRun(startup_seconds=self.startup_seconds, tick=self.engine_tick, faults=self.faults_for(settings),
                         seed=seed, true_cost=self.true_cost, **where)

    def trace_for(self, instance: str) -> LoadTrace:
        if isinstance(self.workload, LoadTrace):
            return self.workload
        return self.workload.get(instance) or self.workload["*"]

    def groups_for(self, instance: str) -> int:
        if isinstance(self.num_groups, Mapping):
            return int(self.num_groups.get(instance, self.num_groups.get("*", 1)))
        return int(self.num_groups)

    async def reconcile_once(self) -> None:
        raise NotImplementedError

    def targets(self) -> list[dict]:
        raise NotImplementedError

    def engines(self, instance: str | None = None) -> list[Any]:
        raise NotImplementedError

    def set_true_cost(self, true_cost: Any) -> None:
        """The deployment's truth (:class:`moe_eplb_harness.engines.physics.TrueCost`) from now on: engines started
        later start with it, and the running simulated ones (not those an engine factory built) produce
        their telemetry from it from their next step on."""
        self.true_cost = true_cost
        for engine in self.engines():
            if isinstance(engine, SimulatedEngine):
                engine.true = true_cost

    def _start_polling(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"sim-{self.role.replace(' ', '-')}")

    async def _stop_polling(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a transient API error must not kill the simulation
                log.warning("%s: %s: %s", self.role, type(exc).__name__, exc or "no message")
            await asyncio.sleep(self.poll)

    async def _notify_targets(self) -> None:
        """``on_change(targets)`` (awaited if a coroutine) when :meth:`targets` changed since the last pass."""
        targets = self.targets()
        if targets != self._last_targets:
            self._last_targets = targets
            if self.on_change:
                result = self.on_change(targets)
                if asyncio.iscoroutine(result):
                    await result

    @staticmethod
    def advance_crash(p: Any, now: float) -> None:
        """A crashing container (``p.crash``) restarts when due: ``p.restarts`` + 1, the next one after a
        back-off doubling from :data:`CRASH_BACKOFF_SECONDS` up to 300 s (clock seconds)."""
        if p.crash and now >= p.next_restart:
            p.restarts += 1
            p.next_restart = now + min(300.0, CRASH_BACKOFF_SECONDS * 2 ** p.restarts)

