"""Every API call the operator makes, as Kubernetes RBAC ``PolicyRule`` data (a ClusterRole's rules).

The Helm chart renders its ClusterRole from :data:`RBAC_RULES`. ``tests/controller/test_rbac.py``
runs the real operator (kopf included, with peering) against the emulated API server, records
every request it sends, and proves both directions: each request is allowed by these rules, and
each (group, resource, verb) granted here is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from moe_eplb.contracts.k8s_names import API_GROUP, PLURAL

#: ClusterRole rules: kopf's own needs (resource discovery via CRDs, peering, Events, its
#: finalizer/annotation patches on MoEInference) plus the controller's child management.
RBAC_RULES: list[dict[str, list[str]]] = [
    # MoEInference: kopf watches and patches (finalizer, progress annotations); the controller
    # reads one for coalesced refreshes and writes the status subresource.
    {"apiGroups": [API_GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    # Children: created, patched back to the rendered spec, deleted; watched for readiness/drift.
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["podmonitors"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # Autoscalers (spec.autoscaling): the KEDA ScaledObject or the HorizontalPodAutoscaler is a
    # child like the others; the autotune loop also reads KEDA's HPA (its status: replica count
    # changing, at maxReplicas) by name.
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # The live-settings ConfigMap (window and interval applied live, for pods that restart): a child.
    {"apiGroups": [""], "resources": ["configmaps"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # The control token's Secret (controller.control): created once per resource, read by the code
    # that sends control requests to engine pods, deleted with the resource.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]},
    # An elastic group's joining pods (a StatefulSet) and the NetworkPolicy of its ports: children too.
    {"apiGroups": ["apps"], "resources": ["statefulsets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # Engine pods: the autotune loop lists them (readiness, crash loops, exporter ports to scrape); the
    # elastic loop takes a shrink's retiring pods out of the Service (their eplb.ai/serving label) and
    # deletes the founding pods of a group vLLM left paused after a failed resize (a restart); the
    # fault-recovery loop deletes a degraded group's leader to restart the group at a planned moment.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch", "delete"]},
    # Engine pods' logs: with spec.faultTolerance on vLLM >= 0.34 the autotune loop reads them for
    # vLLM's "scale_down complete" line (vLLM reports a scale-down nowhere else; EPLB then stops).
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    # Events on MoEInference (controller and kopf); the autotune loop lists a LeaderWorkerSet's
    # RecreateGroupOnPodRestart Events (a group recreated on every pod restart is a crash loop).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list"]},
    # kopf: discovers served resources by watching CRDs (cluster-wide mode).
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    # kopf peering (one active operator replica among several).
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["list", "watch", "patch"]},
]


#: Extra cluster-scoped rules for namespaced mode (``moe-eplb run --namespace ...``): kopf lists and
#: watches Namespace objects to match the served namespaces (seen in the namespaced RBAC test).
#: In that mode the namespaced rules above go into a Role per namespace, with ``kopfpeerings``
#: instead of ``clusterkopfpeerings``; CRDs and these stay in a ClusterRole.
NAMESPACED_MODE_CLUSTER_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def grants(rules: Iterable[dict[str, list[str]]] = RBAC_RULES) -> Iterator[tuple[str, str, str]]:
    """Every ``(apiGroup, resource, verb)`` the rules grant (``resource`` may be ``x/status``)."""
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    yield (group, resource, verb)


def allows(group: str, resource: str, verb: str, rules: Iterable[dict[str, list[str]]] = RBAC_RULES) -> bool:
    """Whether ``verb`` on ``group``/``resource`` (``x`` or ``x/sub``) is granted."""
    return (group, resource, verb) in set(grants(rules))


def request_verb(method: str, *, named: bool, watch: bool) -> str:
    """The RBAC verb of an HTTP request to a resource URL."""
    method = method.upper()
    if method == "GET":
        return "watch" if watch else ("get" if named else "list")
    return {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if named else "deletecollection"}[method]
