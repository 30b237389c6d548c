"""vLLM command-line arguments for a MoEInference, per engine version (pure).

EPLB flags by version (see /work/shared/notes/vllm-eplb.md):

* < 0.10.2: ``--enable-eplb --num-redundant-experts N --eplb-window-size W --eplb-step-interval I
  [--eplb-log-balancedness]``
* >= 0.10.2: ``--enable-eplb --eplb-config '{"window_size":W,"step_interval":I,
  "num_redundant_experts":N,"log_balancedness":B[,"use_async":A]}'`` (the flat flags are deprecated
  there and gone from 0.12.0).

``num_redundant_experts`` is always rendered, also where the spec omits it (the value in force,
:attr:`moe_eplb.api.spec.MoEInference.redundancy_in_force`), so a resource runs the same on every
version. ``spec.eplb.communicator`` goes into ``--eplb-config``; ``spec.parallelism.all2allBackend``
is ``--all2all-backend``.

Data-parallel wiring follows the group's launch layout (:mod:`moe_eplb.api.layout`): with vLLM's
internal load balancing the one API-serving pod (the Deployment's pod, a LeaderWorkerSet's leader)
gets no ``--data-parallel-start-rank`` (on a process that is not ``--headless`` it would make vLLM
infer hybrid load balancing, whose API dispatches to that pod's ranks only) and the workers run
``--headless --data-parallel-start-rank <first rank of the pod>``. Fault tolerance
(``spec.faultTolerance.enabled``: ``--enable-fault-tolerance``) needs external load balancing and one
API server per engine (``engine/arg_utils.py``, ``config/parallel.py``), so every data-parallel rank
then serves its own API: with more than one rank per pod vLLM's multi-port supervisor
(``--data-parallel-multi-port-external-lb``: ranks on ports 8000, 8001, ..., aggregated health on
``--data-parallel-supervisor-port``), with one ``--data-parallel-rank``; workers of a multi-node group
are then not headless. vLLM's multi-port supervisor stops all ranks of its pod when one becomes
unhealthy, so ranks are lost a pod at a time (validation asks ``rankFailuresToSurvive`` in whole pods).
"""

from __future__ import annotations

import dataclasses
import json

from moe_eplb.api import catalog, ft_protocol
from moe_eplb.api.layout import DP_RPC_PORT, dp_flags
from moe_eplb.api.spec import EplbSettings, MoEInference
from moe_eplb.api.versions import SHUTDOWN_TIMEOUT_FLAG, Version, uses_eplb_config_json
from moe_eplb.contracts.k8s_names import API_PORT, CHAT_TEMPLATE_DIR
from moe_eplb.render import control_key

# vLLM version assumed when none is known (EPLB off): the newest the project targets
LATEST_KNOWN = (0, 34, 0)
#: vLLM's own graceful shutdown after SIGTERM (``--shutdown-timeout``), on top of the preStop drain of
#: ``spec.engine.drainSeconds``: requests still running when the drain time ran out get this long more
SHUTDOWN_TIMEOUT_SECONDS = 30
#: what the kubelet allows beyond the drain and vLLM's shutdown before it kills the container
TERMINATION_MARGIN_SECONDS = 30
#: removes what a previous run of the container left in the pod's /dev/shm (an emptyDir that outlives
#: a container restart: vLLM's shared-memory segments, the exporter's directory), then runs vLLM.
#: Init containers do not run again on a container restart, so the engine container does it itself.
SHM_CLEAN = "rm -rf -- /dev/shm/* /dev/shm/.[!.]* /dev/shm/..?* 2>/dev/null"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def eplb_args(eplb: EplbSettings, version: Version) -> list[str]:
    """EPLB flags for ``version``; [] when EPLB is off (vLLM then rejects redundant experts)."""
    if not eplb.enabled:
        return []
    if uses_eplb_config_json(version):
        config: dict[str, object] = {
            "window_size": eplb.window_size,
            "step_interval": eplb.step_interval,
            "num_redundant_experts": eplb.num_redundant_experts,
            "log_balancedness": eplb.log_balancedness,
        }
        if eplb.use_async is not None:
            config["use_async"] = eplb.use_async
        if eplb.communicator is not None:
            config["communicator"] = eplb.communicator
        return ["--enable-eplb", "--eplb-config", _json(config)]
    args = [
        "--enable-eplb",
        "--num-redundant-experts", str(eplb.num_redundant_experts),
        "--eplb-window-size", str(eplb.window_size),
        "--eplb-step-interval", str(eplb.step_interval),
    ]
    if eplb.log_balancedness:
        args.append("--eplb-log-balancedness")
    return args


def elastic_eplb(eplb: EplbSettings) -> EplbSettings:
    """The EPLB settings an elastic group runs: vLLM refuses elastic EP with async EPLB unless NIXL is
    installed (``config/parallel.py``), which the operator cannot see in an image; so where
    ``spec.eplb.async`` is left out and the communicator is not ``nixl`` (the user's word that the image
    has NIXL), sync EPLB (``use_async: false``). An explicit ``async: true`` without ``nixl`` is refused by
    validation."""
    if eplb.use_async is None and eplb.communicator != "nixl":
        return dataclasses.replace(eplb, use_async=False)
    return eplb


def eplb_moe_backend(inf: MoEInference, eplb: EplbSettings, version: Version) -> str | None:
    """``--moe-backend`` value EPLB needs for this checkpoint and engine, when the operator must add it.

    Current vLLM supports EPLB for compressed-tensors WNA16 MoE only on the Triton backend, while
    its automatic choice is Marlin (startup then fails with ``EPLB is not supported``).
    None when not needed, or when the user set ``--moe-backend`` in extraArgs (validation checks it).
    """
    if not eplb.enabled or version < catalog.MOE_BACKEND_FLAG_SINCE:
        return None
    info = catalog.QUANTIZATIONS.get(inf.quantization or "")
    if info is None or not info.eplb_moe_backend or inf.engine.moe_backend_arg is not None:
        return None
    return info.eplb_moe_backend


def engine_args(inf: MoEInference, eplb: EplbSettings) -> list[str]:
    """Arguments after ``vllm serve`` shared by every pod of a replica group (model first).

    Multi-node data-parallel wiring is added by :func:`multinode_leader_args` /
    :func:`multinode_worker_args`. ``spec.engine.extraArgs`` come last.
    """
    e, p = inf.engine, inf.parallelism
    version = e.version or LATEST_KNOWN
    args = [inf.model.name]
    if inf.model.served_name:
        args += ["--served-model-name", inf.model.served_name]
    args += ["--port", str(API_PORT), "--tensor-parallel-size", str(p.tensor)]
    if p.data > 1:
        args += ["--data-parallel-size", str(p.data)]
        if p.nodes == 1 and not inf.elastic_enabled:  # an elastic group's pods are wired as a LeaderWorkerSet's
            lay = inf.layout
            flags = dp_flags(lay, lay.pods[0])
            args += (["--data-parallel-size-local", str(p.data)] if flags else []) + flags
    if p.expert and p.ep_size > 1:
        args.append("--enable-expert-parallel")
    if p.all2all_backend:
        args += ["--all2all-backend", p.all2all_backend]
    if inf.fault_tolerance.enabled:
        args.append("--enable-fault-tolerance")
        if inf.fault_tolerance.recovery_timeout_s is not None:
            args += ft_protocol.recovery_timeout_arg(inf.fault_tolerance.recovery_timeout_s)
    if inf.elastic_enabled:
        args += ["--enable-elastic-ep", "--elastic-ep-max-dp-size", str(p.max_data)]
        eplb = elastic_eplb(eplb)
    args += eplb_args(eplb, version)
    backend = eplb_moe_backend(inf, eplb, version)
    if backend:
        args += ["--moe-backend", backend]
    if e.dtype:
        args += ["--dtype", e.dtype]
    if e.max_model_len:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", repr(float(e.gpu_memory_utilization))]
    if e.limit_mm_per_prompt is not None:
        args += ["--limit-mm-per-prompt", _json(e.limit_mm_per_prompt)]
    if e.mm_encoder_tp_mode:
        args += ["--mm-encoder-tp-mode", e.mm_encoder_tp_mode]
    if e.chat_template:
        args += ["--chat-template", f"{CHAT_TEMPLATE_DIR}/{e.chat_template.key}"]
    args += shutdown_args(inf, version)
    return args + control_key.extra_args(inf)  # extraArgs (the control token among vLLM's API keys, if any)


def shutdown_seconds(inf: MoEInference) -> int:
    """vLLM's ``--shutdown-timeout``: what still runs after the exporter's preStop drain gets
    :data:`SHUTDOWN_TIMEOUT_SECONDS`; without the exporter (``spec.engine.exporter.inject: false`` on a
    stock image) vLLM's own graceful shutdown is the whole drain, so it gets ``drainSeconds``."""
    return SHUTDOWN_TIMEOUT_SECONDS if inf.exporter_in_pod else inf.engine.drain_seconds


def shutdown_args(inf: MoEInference, version: Version) -> list[str]:
    """``--shutdown-timeout`` when the pod drains (``drainSeconds > 0``) and the version has the flag
    (vLLM >= 0.18.0; before it, vLLM aborts what runs on SIGTERM and the preStop drain is all)."""
    if inf.engine.drain_seconds <= 0 or version < SHUTDOWN_TIMEOUT_FLAG:
        return []
    return ["--shutdown-timeout", str(shutdown_seconds(inf))]


def termination_grace_seconds(inf: MoEInference) -> int:
    """The pod's ``terminationGracePeriodSeconds``: the preStop drain, vLLM's own shutdown and a
    margin (60 s without a drain). Without the exporter there is no preStop drain: vLLM's shutdown
    timeout (``drainSeconds``) and the margin."""
    drain = inf.engine.drain_seconds
    if drain <= 0:
        return 60
    if not inf.exporter_in_pod:
        return drain + TERMINATION_MARGIN_SECONDS
    return drain + SHUTDOWN_TIMEOUT_SECONDS + TERMINATION_MARGIN_SECONDS


def engine_script() -> str:
    """The ``sh -c`` script of a pod that serves the API (a Deployment pod, an LWS leader):
    :data:`SHM_CLEAN`, then ``exec vllm serve "$@"`` with the container ``args`` verbatim. Fixed
    text (no user-derived part), ``$`` escaped for Kubernetes' ``$(VAR)`` expansion."""
    return k8s_escape(f'{SHM_CLEAN}; exec vllm serve "$@"')


def _dp_args(inf: MoEInference) -> list[str]:
    return ["--data-parallel-size-local", str(inf.parallelism.data_local), "--data-parallel-rpc-port", str(DP_RPC_PORT)]


def multinode_leader_args(inf: MoEInference) -> list[str]:
    """Extra args of the LeaderWorkerSet leader (rank 0 pod), after the common ones.

    ``$(LWS_LEADER_ADDRESS)`` is expanded by Kubernetes from the env LeaderWorkerSet injects. With
    vLLM's internal load balancing the leader gets no ``--data-parallel-start-rank``, so its API
    dispatches to every rank of the group; with fault tolerance each data-parallel rank serves its own
    API (see the module's docstring and :mod:`moe_eplb.api.layout`).
    """
    lay = inf.layout
    return _dp_args(inf) + ["--data-parallel-address", "$(LWS_LEADER_ADDRESS)"] + dp_flags(lay, lay.pods[0])


def multinode_worker_args(inf: MoEInference) -> list[str]:
    """Extra args of a LeaderWorkerSet worker passed as container ``args`` (no shell):
    ``$(LWS_LEADER_ADDRESS)`` is expanded by Kubernetes, as for the leader. The first DP rank (and
    ``--headless`` or the API flags) come from the fixed :func:`multinode_worker_script`."""
    return _dp_args(inf) + ["--data-parallel-address", "$(LWS_LEADER_ADDRESS)"]


def multinode_worker_script(inf: MoEInference) -> str:
    """The worker's ``sh -c`` script: :data:`SHM_CLEAN`, then ``exec vllm serve "$@"`` (the container
    ``args``, verbatim) then the worker's data-parallel flags of the layout (:func:`moe_eplb.api.layout.dp_flags`)
    with ``--data-parallel-start-rank`` / ``--data-parallel-rank`` ``$((LWS_WORKER_INDEX x dataLocal))``:
    ``--headless`` with vLLM's internal load balancing, the API flags with fault tolerance.

    No user-derived text is in it (``dataLocal`` is an int), and every ``$`` is written ``$$`` so
    that Kubernetes' ``$(VAR)`` expansion of ``command`` leaves the script exactly as the shell
    must see it, whatever env the pod has.
    """
    lay = inf.layout
    rank = f'"$((LWS_WORKER_INDEX * {int(inf.parallelism.data_local)}))"'
    tail = " ".join(dp_flags(lay, lay.pods[1], start_rank=rank))
    return k8s_escape(f'{SHM_CLEAN}; exec vllm serve "$@" {tail}')


def k8s_escape(text: str) -> str:
    """``text`` with every ``$`` doubled, so that Kubernetes' ``$(VAR)`` expansion of a container's
    ``command``/``args``/env gives ``text`` back unchanged."""
    return text.replace("$", "$$")
