"""Names of the Kubernetes API surface that several packages share (a contract: imports nothing).

The custom resource, the labels and annotations put on its children, the ports of the engine pods
and the names the operator uses for its own objects. Users' selectors, dashboards and other tools
depend on every name here.
"""

# --- the custom resource ----------------------------------------------------------------------
API_GROUP = "eplb.ai"
API_VERSION = "v1alpha1"
API = f"{API_GROUP}/{API_VERSION}"  # apiVersion of a MoEInference
KIND = "MoEInference"
PLURAL = "moeinferences"
SHORT_NAME = "moe"

# --- labels and annotations on every child object and engine pod --------------------------------
NAME_LABEL = "eplb.ai/name"  # the MoEInference a pod or child belongs to
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "moe-eplb"
COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "engine"
#: pod-template annotation: hash of the EPLB settings the pods run (a change rolls the pods)
CONFIG_HASH_ANNOTATION = "eplb.ai/eplb-config-hash"
#: which arm of an experiment a pod serves in: the trial workload's pods carry ``trial`` (a
#: Deployment's trial is a second Deployment ``<name>-trial`` behind the same Service); the other
#: pods are the control arm (a LeaderWorkerSet's trial group is told by its config hash instead)
ARM_LABEL = "eplb.ai/arm"
ARM_TRIAL, ARM_CONTROL = "trial", "control"
TRIAL_SUFFIX = "-trial"

# --- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, multi-node replica groups) --------------------
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_TEMPLATE_REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
#: the same value on every pod of one group (a hash of the leader pod's namespace/name)
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"  # pods per group, on every pod
LWS_LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"  # on worker pods
#: env vars the LWS webhook injects into every container of a group
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
#: ``spec.networkConfig.subdomainPolicy`` of the LeaderWorkerSet the operator renders. With LWS's
#: default (``Shared``) the controller makes one headless Service named after the LWS -- ``<name>``,
#: the name of the operator's own ClusterIP Service, so it skips it (sigs.k8s.io/lws v0.8.0
#: ``CreateHeadlessServiceIfNotExists``) and the pods' subdomain, which LWS_LEADER_ADDRESS names, has
#: no pod records: rank 0 never resolves. ``UniquePerReplica``: one headless Service per group, named
#: after its leader pod (:func:`lws_group_service`), the subdomain of every pod of the group.
LWS_SUBDOMAIN_POLICY = "UniquePerReplica"
#: Event reason of the LWS pod controller when a pod of a group failed (a container restarted or a
#: pod was deleted) and it deleted the leader to recreate the whole group (restartPolicy
#: RecreateGroupOnPodRestart); the message names the failed pod: "Worker pod <pod> failed, ...".
#: The reason is the restart policy's name (sigs.k8s.io/lws v0.8.0 pod_controller.go, checked
#: against the real controller in tests/kube/test_lws_real.py).
LWS_RECREATE_GROUP_REASON = "RecreateGroupOnPodRestart"

# --- elastic groups (spec.parallelism.elastic) ------------------------------------------------------
#: the StatefulSet of the pods that join a running elastic group (``<name>-join``): pod ``<name>-join-j``
#: runs the ranks ``data + j x dataLocal ...`` (the founding pods are the LeaderWorkerSet's group 0)
ELASTIC_SUFFIX = "-join"
#: on an elastic group's pods: ``founder`` (the LeaderWorkerSet's) or ``joiner`` (the StatefulSet's, its selector)
ELASTIC_ROLE_LABEL = "eplb.ai/elastic-role"
ELASTIC_FOUNDER, ELASTIC_JOINER = "founder", "joiner"
#: on an elastic group's pods: ``true`` while the Service may route to them; the operator sets
#: ``false`` on the pods a shrink retires, so they finish what they serve before vLLM retires them
SERVING_LABEL = "eplb.ai/serving"
#: env of a joining pod: its own name (the downward API), whose ordinal gives its first rank
POD_NAME_ENV = "MOE_EPLB_POD_NAME"
#: the exporter's relay of an elastic resize (moe_eplb.exporter.elastic_relay): POST (control token)
#: forwards ``/scale_elastic_ep`` to every API server of the pod on loopback; GET reports each one's
#: ``/is_scaling_elastic_ep``, whether it serves, and the forwarded request's outcome
ELASTIC_SCALE_PATH = "/control/elastic/scale"
ELASTIC_STATUS_PATH = "/control/elastic/status"


def lws_group_service(lws_name: str, group: int) -> str:
    """The headless Service LeaderWorkerSet makes for group ``group`` under :data:`LWS_SUBDOMAIN_POLICY`:
    named after the group's leader pod ``<lws>-<group>``; it selects the group's pods and is their
    ``spec.subdomain``."""
    return f"{lws_name}-{group}"


def lws_leader_address(lws_name: str, group: int, namespace: str | None = None) -> str:
    """The DNS name of group ``group``'s leader (rank 0 of its engine) under :data:`LWS_SUBDOMAIN_POLICY`:
    ``<lws>-<group>.<lws>-<group>[.<namespace>]`` -- what LWS puts in ``LWS_LEADER_ADDRESS`` (with the
    namespace); without one, the name relative to the pod's own namespace."""
    leader = f"{lws_name}-{group}"
    host = f"{leader}.{lws_group_service(lws_name, group)}"
    return host if namespace is None else f"{host}.{namespace}"


def elastic_name(resource_name: str) -> str:
    """The StatefulSet of the pods that join the elastic group of MoEInference ``resource_name``."""
    return f"{resource_name}{ELASTIC_SUFFIX}"


# --- monitoring objects (Prometheus Operator) -----------------------------------------------------
PODMONITOR_API_VERSION = "monitoring.coreos.com/v1"

# --- autoscalers (spec.autoscaling) ----------------------------------------------------------------
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_KIND = "ScaledObject"
HPA_API_VERSION = "autoscaling/v2"
HPA_KIND = "HorizontalPodAutoscaler"
#: the HorizontalPodAutoscaler KEDA makes for a ScaledObject: this prefix + the ScaledObject's name
#: (KEDA's default, spelled out in the ScaledObject's advanced.horizontalPodAutoscalerConfig.name)
KEDA_HPA_PREFIX = "keda-hpa-"

# --- ports of an engine pod -----------------------------------------------------------------------
API_PORT = 8000  # vLLM's OpenAI API and its own /metrics
API_PORT_NAME = "http"
#: a pod with several API servers (vLLM's multi-port supervisor: one per data-parallel rank of the
#: pod, on API_PORT + i) names the i-th one's port API_PORT_NAME + "-" + i (``http-1``, ``http-2``, ...)
MAX_API_SERVERS_PER_POD = 64


def api_port_name(index: int) -> str:
    """The container/Service port name of a pod's ``index``-th API server (``http``, ``http-1``, ...)."""
    return API_PORT_NAME if index == 0 else f"{API_PORT_NAME}-{index}"


EXPORTER_PORT = 9400  # the exporter plugin's /metrics
EXPORTER_PORT_NAME = "eplb-metrics"
EXPORTER_PATH = "/metrics"
#: how often the rendered PodMonitor/ServiceMonitor has Prometheus scrape the pods (seconds)
SCRAPE_INTERVAL_SECONDS = 15
#: the exporter's health endpoints on the same port (moe_eplb.exporter.health): liveness (the
#: engine's processes alive, no worker stuck in a forward), readiness (not draining, vLLM's /health
#: answers), and the drain the preStop hook starts (POST from loopback only; blocks until no request
#: is in flight): the hook is an exec of DRAIN_COMMAND in the engine container
EXPORTER_LIVE_PATH = "/livez"
EXPORTER_READY_PATH = "/readyz"
EXPORTER_DRAIN_PATH = "/drain"
DRAIN_COMMAND = ("python3", "-m", "moe_eplb.exporter.drain")
#: env of the engine container the exporter's health endpoints read (values rendered by the operator)
ENGINE_ROLE_ENV = "MOE_EPLB_ROLE"  # "api" (serves the API: a Deployment pod, an LWS leader) or "worker"
DRAIN_SECONDS_ENV = "MOE_EPLB_DRAIN_SECONDS"
#: the ports of every API server of the pod, comma-separated, where it has several (``8000,8001``)
API_PORTS_ENV = "MOE_EPLB_API_PORTS"
ROLE_API, ROLE_WORKER = "api", "worker"
#: the vLLM general plugin of the exporter (entry point in pyproject.toml, VLLM_PLUGINS value)
EXPORTER_PLUGIN = "moe_eplb_exporter"
#: the vLLM entry-point group of general plugins
VLLM_PLUGIN_GROUP = "vllm.general_plugins"

# --- exporter injection into stock vLLM images (spec.engine.exporter.inject) --------------------
#: images of the project: the operator (also the source of the injected plugin) and vLLM + plugin
OPERATOR_IMAGE_REPOSITORY = "ghcr.io/moe-eplb/operator"
PLUGIN_IMAGE_REPOSITORY = "ghcr.io/moe-eplb/vllm"
EXPORTER_INIT_CONTAINER = "moe-eplb-exporter"  # the init container copying the plugin
EXPORTER_VOLUME = "moe-eplb-exporter"  # the emptyDir shared with the engine container
EXPORTER_INJECT_DIR = "/opt/moe-eplb/plugin"  # where it is mounted; on the engine's PYTHONPATH

# --- the engine pod's parts the operator owns (spec.engine.podTemplate may not replace them) -----
ENGINE_CONTAINER = "vllm"  # the engine container; podTemplate's container of this name merges into it
SHM_VOLUME = "dshm"  # the /dev/shm memory volume (spec.engine.shmSize)
SHM_MOUNT_PATH = "/dev/shm"
MODEL_VOLUME = "model-storage"  # spec.model.storage.pvc
CHAT_TEMPLATE_VOLUME = "chat-template"  # spec.engine.chatTemplate
CHAT_TEMPLATE_DIR = "/etc/moe-eplb/chat-template"

# --- the operator's control channel to its engine pods ------------------------------------------
#: A Secret per resource (``<name>-control``, key ``token``), made by the reconciler when absent and
#: never overwritten (delete it to rotate). It is mounted read-only into every engine container, and a
#: request that changes a running engine (through the exporter) must carry ``Authorization: Bearer
#: <token>``: only the operator, which reads the Secret, can send one. The exporter reads the file at
#: each request, so a rotated Secret takes effect once the kubelet has refreshed the mount.
CONTROL_SECRET_SUFFIX = "-control"
CONTROL_TOKEN_KEY = "token"
CONTROL_VOLUME = "eplb-control"
CONTROL_MOUNT_DIR = "/var/run/moe-eplb/control"
CONTROL_TOKEN_FILE = f"{CONTROL_MOUNT_DIR}/{CONTROL_TOKEN_KEY}"
CONTROL_TOKEN_FILE_ENV = "MOE_EPLB_CONTROL_TOKEN_FILE"  # env of the engine container: the token file's path
#: env of the engine container holding the token itself (from the Secret), only where vLLM's own
#: ``--api-key`` guard is on: the operator adds ``$(MOE_EPLB_CONTROL_TOKEN)`` to vLLM's keys so that
#: its calls to vLLM's guarded routes (0.34's /v1/fault_tolerance/*) pass (moe_eplb.render.control_key)
CONTROL_TOKEN_ENV = "MOE_EPLB_CONTROL_TOKEN"
CONTROL_AUTH_HEADER = "Authorization"
CONTROL_AUTH_SCHEME = "Bearer"


def control_secret_name(resource_name: str) -> str:
    """The control Secret of the MoEInference ``resource_name``."""
    return f"{resource_name}{CONTROL_SECRET_SUFFIX}"


# --- window and interval applied live, kept for pods that restart ---------------------------------
#: A ConfigMap per resource (``<name>-eplb-live``, key ``settings.json``) holding the window and
#: interval the operator applied live over the pod template's (``status.autotune.live``, JSON keys of
#: moe_eplb.contracts.live_protocol: windowSize, stepInterval, configHash, step), mounted read-only
#: into every engine container. Each worker reads it once at start and applies the values when they
#: were applied on its own template (configHash == MOE_EPLB_CONFIG_HASH): a pod that restarts comes
#: back with the values in force. The kubelet refreshes the mount; the pod template never changes.
LIVE_CONFIGMAP_SUFFIX = "-eplb-live"
LIVE_FILE_KEY = "settings.json"
LIVE_VOLUME = "eplb-live"
LIVE_MOUNT_DIR = "/var/run/moe-eplb/live"
LIVE_FILE = f"{LIVE_MOUNT_DIR}/{LIVE_FILE_KEY}"
LIVE_FILE_ENV = "MOE_EPLB_LIVE_FILE"  # env of the engine container: the file's path
CONFIG_HASH_ENV = "MOE_EPLB_CONFIG_HASH"  # env of the engine container: its template's eplb-config-hash


def live_configmap_name(resource_name: str) -> str:
    """The live-settings ConfigMap of the MoEInference ``resource_name``."""
    return f"{resource_name}{LIVE_CONFIGMAP_SUFFIX}"


# --- the operator's own endpoints -----------------------------------------------------------------
OPERATOR_METRICS_PORT = 8080
