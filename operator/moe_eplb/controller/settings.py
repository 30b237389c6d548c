"""The operator process's settings (``moe-eplb run``), built purely from CLI/env values.

Each setting has one command-line option and one environment variable (:data:`OPTIONS`); the Helm
chart sets the environment variables. :func:`build` checks the values and returns a frozen
:class:`OperatorSettings`; a bad value raises :class:`SettingsError` naming the option, its
environment variable and the fix. Nothing here touches the network, files or logging.

Env contract (chart -> operator):

- ``MOE_EPLB_PROMETHEUS_URL``: http(s) base URL; empty = none (the tuner scrapes the pods'
  exporters directly for MoEInferences without ``spec.monitoring.prometheusUrl``);
- ``MOE_EPLB_NAMESPACES``: comma-separated namespaces (globs allowed); empty = all namespaces;
- ``MOE_EPLB_PEERING``: kopf peering object name; set but empty = standalone (no peering);
- ``MOE_EPLB_PRIORITY``: peering priority; unset = random in [1, 2**31 - 1] per process;
- ``MOE_EPLB_METRICS_PORT`` (0 = off), ``MOE_EPLB_HEALTH_PORT`` (``/healthz``, 0 = off);
- ``MOE_EPLB_LOG_LEVEL`` (DEBUG|INFO|WARNING|ERROR), ``MOE_EPLB_LOG_FORMAT`` (text|json);
- ``MOE_EPLB_RESYNC_SECONDS``, ``MOE_EPLB_STANDALONE``, ``MOE_EPLB_KUBECONFIG``;
- ``MOE_EPLB_POD_MONITOR_LABELS``: labels every rendered PodMonitor carries (a JSON object, or
  ``key=value,key=value``), e.g. ``{"release": "kube-prometheus-stack"}`` so that
  kube-prometheus-stack's Prometheus selects them; a resource's ``spec.monitoring.podMonitor.labels``
  win over them;
- ``MOE_EPLB_EXPORTER_IMAGE``: the image the exporter-injection init container runs when a
  resource leaves ``spec.engine.exporter.image`` empty (the chart sets the operator's own image);
- ``POD_NAME``, ``POD_NAMESPACE`` (downward API): the replica's identity (kopf peering id, logs).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from moe_eplb.api.imageref import parse_image
from moe_eplb.api.spec import OperatorDefaults
from moe_eplb.api.validation import label_problems
from moe_eplb.contracts import bounded_read, k8s_names

PEERING_NAME = "moe-eplb"
DEFAULT_HEALTH_PORT = 8081
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
#: Range of the per-process peering priority (whole numbers JSON carries exactly). kopf pauses every
#: operator that sees a live peer with the same priority (and a higher one pauses the lower), so
#: replicas must differ: see :func:`seniority_priority`.
PRIORITY_RANGE = (1, 2**53)

#: setting -> (command-line option, environment variable).
OPTIONS: dict[str, tuple[str, str]] = {
    "kubeconfig": ("--kubeconfig", "MOE_EPLB_KUBECONFIG"),
    "prometheus_url": ("--prometheus-url", "MOE_EPLB_PROMETHEUS_URL"),
    "namespaces": ("--namespace", "MOE_EPLB_NAMESPACES"),
    "standalone": ("--standalone", "MOE_EPLB_STANDALONE"),
    "peering_name": ("--peering", "MOE_EPLB_PEERING"),
    "priority": ("--priority", "MOE_EPLB_PRIORITY"),
    "health_port": ("--health-port", "MOE_EPLB_HEALTH_PORT"),
    "liveness": ("--liveness", "MOE_EPLB_LIVENESS"),
    "metrics_port": ("--metrics-port", "MOE_EPLB_METRICS_PORT"),
    "resync_seconds": ("--resync-seconds", "MOE_EPLB_RESYNC_SECONDS"),
    "log_level": ("--log-level", "MOE_EPLB_LOG_LEVEL"),
    "log_format": ("--log-format", "MOE_EPLB_LOG_FORMAT"),
    "pod_monitor_labels": ("--pod-monitor-labels", "MOE_EPLB_POD_MONITOR_LABELS"),
    "exporter_image": ("--exporter-image", "MOE_EPLB_EXPORTER_IMAGE"),
}

#: No longer read: spec.autotune's fields are defaulted by the CRD (per MoEInference).
RETIRED_ENV = ("MOE_EPLB_AUTOTUNE_DEFAULTS",)

_URL = re.compile(r"^https?://[^\s/]+\S*$")  # the CRD's spec.monitoring.prometheusUrl pattern, host required
# A namespace name (DNS-1123 label) or a kopf namespace pattern (globs, leading ! to exclude).
_NAMESPACE = re.compile(r"^!?[a-z0-9*?\[\]]([-a-z0-9*?\[\]]{0,61}[a-z0-9*?\[\]])?$")


class SettingsError(ValueError):
    """A setting has a bad value; the message names the option, the env variable and the fix."""

    def __init__(self, setting: str, message: str) -> None:
        option, env = OPTIONS[setting]
        super().__init__(f"{env} / {option}: {message}")
        self.setting, self.option, self.env = setting, option, env


@dataclass(frozen=True)
class OperatorSettings:
    """Process-wide settings of the operator (what the Controller and kopf are started with).

    ``prometheus_url``: default Prometheus base URL for MoEInferences without
    ``spec.monitoring.prometheusUrl`` (None: read the pods' exporters directly);
    ``namespaces``: served namespaces (empty: all, cluster-wide); ``priority``: kopf peering
    priority; ``liveness_endpoint``: kopf's liveness URL or None; ``metrics_port``: 0 = off;
    ``resync_seconds``: drift/status timer period (s); ``log_level``/``log_format``: logging;
    ``pod_monitor_labels`` / ``exporter_image``: defaults for resources that leave them unset
    (:attr:`defaults`).
    """

    prometheus_url: str | None = None
    namespaces: tuple[str, ...] = ()
    standalone: bool = False
    peering_name: str = PEERING_NAME
    #: peering named explicitly (``--peering NAME`` / ``MOE_EPLB_PEERING``, as the chart sets it): kopf's
    #: *mandatory* peering -- nothing is processed until the peering object has been read, so replicas
    #: started together never both act (seen on a real apiserver: with auto-detected peering both
    #: replicas reconciled for ~0.3 s before the lower priority paused). Needs the peering object.
    peering_required: bool = False
    priority: int = 0
    liveness_endpoint: str | None = f"http://0.0.0.0:{DEFAULT_HEALTH_PORT}/healthz"
    metrics_port: int = k8s_names.OPERATOR_METRICS_PORT
    resync_seconds: float = 60.0
    log_level: str = "INFO"
    log_format: str = "text"
    pod_name: str | None = None
    pod_namespace: str | None = None
    pod_monitor_labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    exporter_image: str | None = None

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def defaults(self) -> OperatorDefaults:
        """What this operator fills in where a MoEInference leaves it unset."""
        return OperatorDefaults(prometheus_url=self.prometheus_url, pod_monitor_labels=dict(self.pod_monitor_labels),
                                exporter_image=self.exporter_image)


def process_start_time() -> float:
    """When this process started, POSIX seconds, as the kernel records it (psutil): not when it got
    as far as drawing its priority, which two replicas started 50 ms apart can reach in either order
    (their imports take seconds on a busy node; seen on a loaded 2-core machine)."""
    import psutil  # the operator extra; imported here so that the base CLI does not need it

    return float(psutil.Process().create_time())


def seniority_priority(now: float | None = None) -> int:
    """The default peering priority: the earlier a process started (``now``, default
    :func:`process_start_time`), the higher (millisecond start time, plus a random tie-break of 10
    bits from OS entropy, so processes started in the same millisecond still differ). The replica
    that already acts keeps acting while a newer one waits: a newer replica never takes over (and
    never acts for a moment before it sees the older one, which a random priority allowed when the
    newer drew the higher number; seen on a real apiserver). Within :data:`PRIORITY_RANGE` until the
    year 2248."""
    ms = int((process_start_time() if now is None else now) * 1000)
    return max(PRIORITY_RANGE[0], PRIORITY_RANGE[1] - (ms * 1024 + random.SystemRandom().randrange(1024)))


def split_namespaces(values: Iterable[str]) -> tuple[str, ...]:
    """``("a,b", " c ")`` -> ``("a", "b", "c")``: comma lists flattened, blanks dropped, order kept,
    duplicates removed; each must be a namespace name or a kopf glob pattern."""
    out: list[str] = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if not item or item in out:
                continue
            if not _NAMESPACE.match(item):
                raise SettingsError("namespaces", f"{item!r} is not a namespace name (lowercase letters, digits "
                                                  "and '-', at most 63; globs * ? [] and a leading ! allowed)")
            out.append(item)
    return tuple(out)


#: Labels the operator sets on what it renders: not to be given as operator-wide PodMonitor labels.
OWN_LABEL_PREFIX = k8s_names.API_GROUP + "/"
OWN_LABELS = (k8s_names.MANAGED_BY_LABEL, k8s_names.COMPONENT_LABEL)


def parse_labels(text: str | Mapping[str, str] | None) -> dict[str, str]:
    """``'{"release": "kps"}'`` or ``"release=kps,team=ml"`` (or a mapping) -> checked labels."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}
    if isinstance(text, Mapping):
        labels: Any = dict(text)
    elif text.lstrip().startswith(("{", "[")):
        try:  # bounded: depth, size, duplicate keys (moe_eplb.contracts.bounded_read)
            labels = bounded_read.parse_json(text.encode("utf-8", "replace"), "labels", max_depth=2, max_values=10_000,
                                            need_depth=1)
        except bounded_read.InputError as exc:
            labels = str(exc).removeprefix("labels: ")
        if not isinstance(labels, dict):
            problem = labels if isinstance(labels, str) else "expected a JSON object"
            raise SettingsError("pod_monitor_labels", f"{text[:200]!r}: {problem}; give e.g. "
                                                      '{"release": "kube-prometheus-stack"}')
    else:
        labels = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            key = key.strip()
            if not sep or not key:
                raise SettingsError("pod_monitor_labels", f"{item.strip()[:80]!r} is not key=value; give e.g. "
                                                          "release=kube-prometheus-stack,team=ml")
            if key in labels:
                raise SettingsError("pod_monitor_labels", f"label {key[:80]!r} is given twice")
            labels[key] = value.strip()
    own = [k for k in labels if k.startswith(OWN_LABEL_PREFIX) or k in OWN_LABELS]
    if own:
        raise SettingsError("pod_monitor_labels", f"{own[0][:80]!r} is set by the operator itself (it selects "
                                                  "the pods); leave it out")
    problems = label_problems(labels, "labels")
    if problems:
        shown = text if isinstance(text, str) else json.dumps(labels)
        raise SettingsError("pod_monitor_labels", f"{shown[:200]!r}: {problems[0]}")
    return labels


def build(*, prometheus_url: str | None = None, namespaces: Iterable[str] = (), standalone: bool = False,
          peering_name: str | None = None, priority: int | None = None, health_port: int | None = None,
          liveness: str | None = None, metrics_port: int = k8s_names.OPERATOR_METRICS_PORT, resync_seconds: float = 60.0,
          log_level: str = "INFO", log_format: str = "text", pod_name: str | None = None,
          pod_namespace: str | None = None, pod_monitor_labels: str | Mapping[str, str] | None = None,
          exporter_image: str | None = None, peering_required: bool = False,
          draw_priority: Callable[[], int] = seniority_priority) -> OperatorSettings:
    """Check raw option values and return the settings.

    ``peering_name`` None means the default name, ``""`` means standalone; ``peering_required``: see
    :attr:`OperatorSettings.peering_required` (ignored when standalone); ``priority`` None draws
    one with ``draw_priority``; ``liveness`` (a full URL, ``""`` = off) wins over ``health_port``
    (``http://0.0.0.0:<port>/healthz``, 0 = off; None = :data:`DEFAULT_HEALTH_PORT`).
    """
    url = (prometheus_url or "").strip() or None
    if url is not None and not _URL.match(url):
        raise SettingsError("prometheus_url", f"{url!r} is not an http(s) URL; give e.g. "
                                              "http://prometheus-operated.monitoring.svc:9090, or leave it empty to "
                                              "read the pods' exporters directly")
    for setting, port in (("metrics_port", metrics_port), ("health_port", health_port)):
        if port is not None and not 0 <= port <= 65535:
            raise SettingsError(setting, f"{port} is not a port number (1-65535, or 0 to turn it off)")
    if not resync_seconds > 0:
        raise SettingsError("resync_seconds", f"{resync_seconds} must be > 0 seconds")
    level = str(log_level).upper()
    if level not in LOG_LEVELS:
        raise SettingsError("log_level", f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    fmt = str(log_format).lower()
    if fmt not in LOG_FORMATS:
        raise SettingsError("log_format", f"{log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if peering_name is not None and peering_name.strip() == "":
        standalone = True
        peering_name = PEERING_NAME
    if liveness is not None:
        endpoint = liveness.strip() or None
        if endpoint is not None and not _URL.match(endpoint):
            raise SettingsError("liveness", f"{liveness!r} is not an http URL like http://0.0.0.0:8081/healthz "
                                            "(empty turns it off)")
    else:
        port = DEFAULT_HEALTH_PORT if health_port is None else health_port
        endpoint = f"http://0.0.0.0:{port}/healthz" if port else None
    if priority is None:
        priority = draw_priority()
    labels = parse_labels(pod_monitor_labels)
    image = (exporter_image or "").strip() or None
    if image is not None and parse_image(image) is None:
        raise SettingsError("exporter_image", f"{image[:200]!r} is not an image reference; give e.g. "
                                              "ghcr.io/moe-eplb/operator:0.3.0 (the operator's own image)")
    return OperatorSettings(
        prometheus_url=url, namespaces=split_namespaces(namespaces), standalone=bool(standalone),
        peering_name=(peering_name or PEERING_NAME).strip(), peering_required=bool(peering_required) and not standalone,
        priority=int(priority), liveness_endpoint=endpoint,
        metrics_port=int(metrics_port), resync_seconds=float(resync_seconds), log_level=level, log_format=fmt,
        pod_name=pod_name or None, pod_namespace=pod_namespace or None,
        pod_monitor_labels=MappingProxyType(labels), exporter_image=image)
