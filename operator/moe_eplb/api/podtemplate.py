"""``spec.engine.podTemplate``: the user's pod-template overlay, and what in it the operator owns.

The overlay has Kubernetes' own shape: ``metadata.labels``, ``metadata.annotations`` and ``spec``, a
``core/v1`` PodSpec fragment (its schema in the CRD is generated from the Kubernetes release the
project builds, ``scripts/gen_podspec_schema.py``). It is merged into every engine pod
(:mod:`moe_eplb.render.overlay`), so it reaches what the resource has no field for: RDMA devices and
capabilities, network annotations, security contexts, sidecars, affinity, priority classes.

What the operator owns cannot be overlaid; it is refused at apply time with the field and the fix:

* by the CRD's CEL rules (:func:`pod_spec_rules`, :func:`container_rules`, :func:`metadata_rules`;
  put into the CRD with the generated schema, run by the apiserver and by ``moe-eplb validate``):
  the engine container's ``command``, ``args`` and ``image`` (they carry the EPLB arguments), its
  GPU limit (``spec.engine.resources``), the ports the operator names, the environment that the
  rendered command expands or the exporter plugin needs, the operator's volumes, mount paths and
  init container, the labels the Service and workload select on, the EPLB config-hash annotation;
* by :func:`overlay_problems` (``validate`` and the operator only; the CRD cannot see across the
  resource, or the check is past the CEL cost budget): ``PYTHONPATH`` while the exporter is
  injected, a mount over the model PVC, duplicate names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.layout import SUPERVISOR_PORT, SUPERVISOR_PORT_NAME
from moe_eplb.api.problem import Problem
from moe_eplb.contracts.k8s_names import (
    API_PORT,
    API_PORT_NAME,
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_VOLUME,
    COMPONENT_LABEL,
    CONFIG_HASH_ANNOTATION,
    CONFIG_HASH_ENV,
    CONTROL_MOUNT_DIR,
    CONTROL_TOKEN_FILE_ENV,
    CONTROL_VOLUME,
    ENGINE_CONTAINER,
    EXPORTER_INIT_CONTAINER,
    EXPORTER_INJECT_DIR,
    EXPORTER_PORT,
    EXPORTER_PORT_NAME,
    EXPORTER_VOLUME,
    LIVE_FILE_ENV,
    LIVE_MOUNT_DIR,
    LIVE_VOLUME,
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    MAX_API_SERVERS_PER_POD,
    MODEL_VOLUME,
    NAME_LABEL,
    SHM_MOUNT_PATH,
    SHM_VOLUME,
)

FIELD = "spec.engine.podTemplate"
#: the rule, at ``spec`` level (it reads ``spec.engine.gpuResourceName``), that keeps the GPU count out of
#: the engine container's overlay; in crd.yaml beside the rules on ``spec.engine.resources``
GPU_RULES = tuple(
    {"rule": "!has(self.engine.podTemplate) || !has(self.engine.podTemplate.spec) || "
             "!has(self.engine.podTemplate.spec.containers) || self.engine.podTemplate.spec.containers.all(c, "
             f"c.name != '{ENGINE_CONTAINER}' || !has(c.resources) || !has(c.resources.{kind}) || "
             f"!(self.engine.gpuResourceName in c.resources.{kind}))",
     "fieldPath": ".engine.podTemplate.spec.containers",
     "message": f"{FIELD}.spec.containers[{ENGINE_CONTAINER}].resources.{kind}: the GPU count "
                "(spec.engine.gpuResourceName, default nvidia.com/gpu) is the operator's (tensor x dataLocal); "
                "remove it here (other resources such as rdma/ib are fine)"}
    for kind in ("limits", "requests"))
#: labels the workload, Service, PDB and PodMonitor select on (render.labels.selector_labels)
SELECTOR_LABELS = (COMPONENT_LABEL, NAME_LABEL)
#: labels and annotations LeaderWorkerSet sets on every pod of a group
LWS_PREFIX = "leaderworkerset.sigs.k8s.io/"
OWNED_PORTS = (API_PORT, SUPERVISOR_PORT, EXPORTER_PORT)
OWNED_PORT_NAMES = (API_PORT_NAME, SUPERVISOR_PORT_NAME, EXPORTER_PORT_NAME)
#: environment of the engine container the overlay may not set: the plugin list (the exporter is
#: always in it; ``spec.engine.env`` adds plugins) and the variables the rendered command expands
OWNED_ENV = ("VLLM_PLUGINS", LWS_LEADER_ADDRESS_ENV, LWS_WORKER_INDEX_ENV, CONTROL_TOKEN_FILE_ENV, LIVE_FILE_ENV,
             CONFIG_HASH_ENV)
#: set by the operator while the exporter is injected (``spec.engine.env`` appends to it)
EXPORTER_ENV = "PYTHONPATH"
OWNED_VOLUMES = (SHM_VOLUME, MODEL_VOLUME, EXPORTER_VOLUME, CHAT_TEMPLATE_VOLUME, CONTROL_VOLUME, LIVE_VOLUME)
OWNED_MOUNT_PATHS = (SHM_MOUNT_PATH, EXPORTER_INJECT_DIR, CHAT_TEMPLATE_DIR, CONTROL_MOUNT_DIR, LIVE_MOUNT_DIR)
MAX_LABELS = 64
MAX_ANNOTATIONS = 64


@dataclass(frozen=True)
class PodTemplateOverlay:
    """``spec.engine.podTemplate`` as written: labels and annotations of the engine pods, and the
    PodSpec fragment (kept raw, a Kubernetes object like ``env``)."""

    labels: dict[str, str] = field(default_factory=dict, metadata={"key": "metadata.labels"})
    annotations: dict[str, str] = field(default_factory=dict, metadata={"key": "metadata.annotations"})
    spec: dict[str, Any] = field(default_factory=dict, metadata={"raw": True})

    def containers(self, key: str = "containers") -> list[dict[str, Any]]:
        items = self.spec.get(key) or []
        return [c for c in items if isinstance(c, Mapping)]

    @property
    def engine_container(self) -> dict[str, Any] | None:
        """The overlay's container named ``vllm`` (merged into the engine container), if any."""
        return next((c for c in self.containers() if c.get("name") == ENGINE_CONTAINER), None)


# --- CEL rules (put into the CRD by scripts/gen_podspec_schema.py) ---------------------------------


def _list(values: tuple[Any, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in values) + "]"


def _engine(cond: str) -> str:
    return f"self.name != '{ENGINE_CONTAINER}' || {cond}"


def container_rules() -> list[dict[str, Any]]:
    """Rules on each container of ``podTemplate.spec.containers`` (self = a Container)."""
    where = f"{FIELD}.spec.containers[{ENGINE_CONTAINER}]"
    out = [{"rule": _engine(f"!has(self.{fld})"), "fieldPath": f".{fld}",
            "message": f"{where}.{fld}: the operator sets the engine's {fld} (it carries the EPLB arguments); "
                       f"remove it ({fix})"}
           for fld, fix in (("command", "add vLLM flags with spec.engine.extraArgs"),
                            ("args", "add vLLM flags with spec.engine.extraArgs"),
                            ("image", "set spec.engine.image"))]
    out += [{"rule": _engine(f"!has(self.{fld})"), "fieldPath": f".{fld}",
             "message": f"{where}.{fld}: the operator sets the engine's {fld} ({why}); remove it ({fix})"}
            for fld, why, fix in (
                ("lifecycle", "its preStop hook drains the pod", "size the drain with spec.engine.drainSeconds"),
                ("startupProbe", "the health of a pod or a group's worker",
                 "size model loading with spec.engine.startupTimeoutSeconds"),
                ("livenessProbe", "the health of a pod or a group's worker", "the operator's probe fails a stuck or "
                 "dead engine; spec.engine.startupTimeoutSeconds sizes loading"),
                ("readinessProbe", "the drain turns it unready first", "spec.engine.drainSeconds sizes the drain"))]
    out.append({"rule": f"self.name == '{ENGINE_CONTAINER}' || has(self.image)", "fieldPath": ".image",
                "message": f"{FIELD}.spec.containers: a container other than {ENGINE_CONTAINER} is a sidecar "
                           "and needs an image; set image (or name it vllm to merge into the engine container)"})
    last_api = API_PORT + MAX_API_SERVERS_PER_POD - 1
    out.append({
        "rule": f"!has(self.ports) || self.ports.all(p, !(p.containerPort in {_list(OWNED_PORTS)}) && "
                f"!(p.containerPort >= {API_PORT} && p.containerPort <= {last_api}) && "
                f"(!has(p.name) || !(p.name in {_list(OWNED_PORT_NAMES)} || p.name.startsWith('{API_PORT_NAME}-'))))",
        "fieldPath": ".ports",
        "message": f"{FIELD}.spec.containers[].ports: ports {API_PORT}-{last_api} ({API_PORT_NAME}, "
                   f"{API_PORT_NAME}-*: one per API server of a pod), {SUPERVISOR_PORT} ({SUPERVISOR_PORT_NAME}) "
                   f"and {EXPORTER_PORT} ({EXPORTER_PORT_NAME}) are the operator's; use another port number and name"})
    out.append({
        "rule": _engine(f"!has(self.env) || self.env.all(e, !(e.name in {_list(OWNED_ENV)}))"),
        "fieldPath": ".env",
        "message": f"{where}.env: {', '.join(OWNED_ENV)} are set by the operator (the plugin list, the "
                   "variables its command expands, the control token's and live settings' paths, the template's "
                   "config hash); add plugins with spec.engine.env "
                   "VLLM_PLUGINS, remove the rest"})
    out.append({
        "rule": _engine(f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in "
                        f"{_list(OWNED_MOUNT_PATHS)}))"),
        "fieldPath": ".volumeMounts",
        "message": f"{where}.volumeMounts: {', '.join(OWNED_MOUNT_PATHS)} are mounted by the operator "
                   "(spec.engine.shmSize, the exporter, spec.engine.chatTemplate, the control token, the live "
                   "settings); mount elsewhere"})
    return out


def pod_spec_rules() -> list[dict[str, Any]]:
    """Rules on ``podTemplate.spec`` itself (self = the PodSpec fragment)."""
    return [
        {"rule": f"!has(self.volumes) || self.volumes.all(v, !(v.name in {_list(OWNED_VOLUMES)}))",
         "fieldPath": ".volumes",
         "message": f"{FIELD}.spec.volumes: {', '.join(OWNED_VOLUMES)} are the operator's volumes "
                    "(spec.engine.shmSize, spec.model.storage.pvc, the exporter, spec.engine.chatTemplate, the control token, "
                    "the live settings); "
                    "use those fields or another volume name"},
        {"rule": f"!has(self.initContainers) || self.initContainers.all(c, c.name != '{EXPORTER_INIT_CONTAINER}')",
         "fieldPath": ".initContainers",
         "message": f"{FIELD}.spec.initContainers: {EXPORTER_INIT_CONTAINER} is the operator's exporter init "
                    "container (spec.engine.exporter); use another name"},
        {"rule": "!has(self.ephemeralContainers)", "fieldPath": ".ephemeralContainers",
         "message": f"{FIELD}.spec.ephemeralContainers: a pod template cannot have ephemeral containers (they are "
                    "added to a running pod with kubectl debug); use containers for a sidecar"},
        {"rule": "!has(self.terminationGracePeriodSeconds)", "fieldPath": ".terminationGracePeriodSeconds",
         "message": f"{FIELD}.spec.terminationGracePeriodSeconds: the operator derives it from "
                    "spec.engine.drainSeconds (the drain plus vLLM's shutdown); set spec.engine.drainSeconds"},
        {"rule": "!has(self.restartPolicy) || self.restartPolicy == 'Always'", "fieldPath": ".restartPolicy",
         "message": f"{FIELD}.spec.restartPolicy: engine pods belong to a Deployment or LeaderWorkerSet, which "
                    "allow only Always; remove it"},
    ]


def metadata_rules() -> dict[str, list[dict[str, Any]]]:
    """Rules on ``podTemplate.metadata.labels`` and ``.annotations`` (self = the map)."""
    selected = " && ".join(f"!('{k}' in self)" for k in SELECTOR_LABELS)
    lws = f"self.all(k, !k.startsWith('{LWS_PREFIX}'))"
    return {
        "labels": [
            {"rule": selected, "message": f"{FIELD}.metadata.labels: {', '.join(SELECTOR_LABELS)} are the labels the "
                                          "operator selects its pods on; remove them"},
            {"rule": lws, "message": f"{FIELD}.metadata.labels: {LWS_PREFIX}* labels are LeaderWorkerSet's; "
                                     "remove them"},
        ],
        "annotations": [
            {"rule": f"!('{CONFIG_HASH_ANNOTATION}' in self)",
             "message": f"{FIELD}.metadata.annotations: {CONFIG_HASH_ANNOTATION} is the operator's (it rolls the "
                        "pods when the EPLB settings change); remove it"},
            {"rule": lws, "message": f"{FIELD}.metadata.annotations: {LWS_PREFIX}* annotations are "
                                     "LeaderWorkerSet's; remove them"},
        ],
    }


#: the engine's pod-level fields outside ``podTemplate`` (``spec.engine.<field>``): where each one's
#: Kubernetes schema is in the PodSpec, its description, and a bound on its size
ENGINE_POD_FIELDS: dict[str, tuple[tuple[str, ...], str, dict[str, Any]]] = {
    "env": (("containers", "[]", "env"), "Extra environment variables of the vLLM container (Kubernetes EnvVar, "
            "value or valueFrom), appended to the operator's.", {"maxItems": 128}),
    "imagePullSecrets": (("imagePullSecrets",), "Secrets for pulling the image from a private registry (pod "
                         "imagePullSecrets).", {"maxItems": 16}),
    "nodeSelector": (("nodeSelector",), "Node labels the engine pods must run on (e.g. the GPU product label "
                     "nvidia.com/gpu.product, which also tells the operator the GPU memory).", {"maxProperties": 64}),
    "resources": (("containers", "[]", "resources"), "Container resources (Kubernetes ResourceRequirements). The GPU "
                  "count (resource gpuResourceName, default nvidia.com/gpu) is set to tensor x dataLocal when left "
                  "out; when given it must equal that.", {}),
    "tolerations": (("tolerations",), "Tolerations of the engine pods (Kubernetes Toleration), e.g. for tainted GPU "
                    "nodes.", {"maxItems": 64}),
}


def _at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for part in path:
        schema = schema["items"] if part == "[]" else schema["properties"][part]
    return schema


def engine_pod_fields(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The CRD schemas of ``spec.engine.env``, ``imagePullSecrets``, ``nodeSelector``, ``resources`` and
    ``tolerations``: the generated PodSpec's own (so the API server and ``moe-eplb validate`` check their
    types, enums and unknown fields, with the overlay's "did you mean"), with descriptions and size
    bounds. An image pull secret needs its name; resource maps are bounded for the CEL rules that read them."""
    out: dict[str, Any] = {}
    for name, (path, description, bounds) in ENGINE_POD_FIELDS.items():
        node = {k: v for k, v in _at(pod_spec, path).items() if k != "description"}
        node = {"description": description, **node, **bounds}
        if name == "imagePullSecrets":
            item = dict(node["items"])
            item["required"] = ["name"]
            item["properties"] = {**item["properties"], "name": {"type": "string", "minLength": 1, "maxLength": 253}}
            node["items"] = item
        if name == "resources":
            props = dict(node["properties"])
            for key in ("limits", "requests"):
                props[key] = {**props[key], "maxProperties": 32,
                              "additionalProperties": {**props[key]["additionalProperties"], "maxLength": 64}}
            node["properties"] = props
        if name == "nodeSelector":
            node["additionalProperties"] = {**node["additionalProperties"], "maxLength": 63}
        out[name] = node
    return out


def crd_node(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema of ``spec.engine.podTemplate`` around the generated PodSpec schema."""
    spec = dict(pod_spec)
    items = dict(spec["properties"]["containers"]["items"])
    items["x-kubernetes-validations"] = container_rules()
    spec["properties"] = {**spec["properties"], "containers": {**spec["properties"]["containers"], "items": items}}
    spec["x-kubernetes-validations"] = pod_spec_rules()
    meta_rules = metadata_rules()

    def string_map(what: str, most: int, value_len: int) -> dict[str, Any]:
        return {"type": "object", "maxProperties": most, "description": f"{what} of every engine pod.",
                "additionalProperties": {"type": "string", "maxLength": value_len},
                "x-kubernetes-validations": meta_rules[what.lower()]}

    return {
        "type": "object",
        "description": "Pod-template overlay of the engine pods (Deployment pods, and leader and workers of a "
                       "LeaderWorkerSet group), in Kubernetes' own shape. The operator's parts (the engine's "
                       "command, args, image, GPU limit, ports, selector labels) are refused.",
        "properties": {
            "metadata": {"type": "object", "description": "Labels and annotations added to the engine pods.",
                         "properties": {"labels": string_map("Labels", MAX_LABELS, 63),
                                        "annotations": string_map("Annotations", MAX_ANNOTATIONS, 65536)}},
            "spec": spec,
        },
    }


# --- checks the CRD cannot make ------------------------------------------------------------------


def overlay_problems(overlay: PodTemplateOverlay | None, *, exporter_injected: bool,
                     model_mount_path: str | None) -> list[Problem]:
    """What only ``validate`` and the operator refuse in the overlay: the exporter's ``PYTHONPATH``
    while it is injected, a mount over the model volume, and a name used twice in a list the
    overlay merges by name (the apiserver refuses that too, as a schema error)."""
    if overlay is None:
        return []
    problems: list[Problem] = []
    for key in ("containers", "initContainers", "volumes"):
        seen: set[str] = set()
        for i, item in enumerate(overlay.spec.get(key) or []):
            name = item.get("name") if isinstance(item, Mapping) else None
            if name in seen:
                problems.append(Problem(f"{FIELD}.spec.{key}[{i}]", f"name {name!r} is used twice; give each entry "
                                        "its own name (entries merge by name)"))
            seen.add(name)
    for i, c in enumerate(overlay.spec.get("containers") or []):
        if not isinstance(c, Mapping) or c.get("name") != ENGINE_CONTAINER:
            continue
        where = f"{FIELD}.spec.containers[{i}]"
        if exporter_injected and any(isinstance(e, Mapping) and e.get("name") == EXPORTER_ENV
                                     for e in c.get("env") or []):
            problems.append(Problem(f"{where}.env", f"{EXPORTER_ENV} is set by the operator while the exporter is "
                                    "injected (spec.engine.exporter.inject); add paths with spec.engine.env "
                                    f"{EXPORTER_ENV}, which the operator appends"))
        if model_mount_path and any(isinstance(m, Mapping) and m.get("mountPath") == model_mount_path
                                    for m in c.get("volumeMounts") or []):
            problems.append(Problem(f"{where}.volumeMounts", f"{model_mount_path} is where the operator mounts "
                                    "spec.model.storage.pvc; mount elsewhere"))
    return problems
