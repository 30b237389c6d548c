"""Structural schemas for the parts of two third-party CRDs the renderer writes.

Written from the LeaderWorkerSet v1 API (kubernetes-sigs/lws) and the Prometheus Operator
PodMonitor v1 API; only the fields moe-eplb sets are listed, with their types and enums, so that
the project's own strict checker (unknown fields + OpenAPI schema) rejects typos and wrong types.
Pod templates inside a LeaderWorkerSet are validated separately as core v1 PodTemplates.
"""

from __future__ import annotations

_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    },
}
_META = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_POD_TEMPLATE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}  # checked as v1 PodTemplate
_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

LEADER_WORKER_SET = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["leaderworkerset.x-k8s.io/v1"]},
        "kind": {"type": "string", "enum": ["LeaderWorkerSet"]},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"type": "string", "enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {
                    "type": "object",
                    "required": ["subdomainPolicy"],
                    "properties": {"subdomainPolicy": {"type": "string", "enum": ["Shared", "UniquePerReplica"]}},
                },
                "rolloutStrategy": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "properties": {"maxSurge": _INT_OR_STRING, "maxUnavailable": _INT_OR_STRING,
                                           "partition": {"type": "integer", "minimum": 0}},
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"type": "string",
                                          "enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                    },
                },
            },
        },
    },
}

_RELABEL = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "action": {"type": "string", "enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "labelmap",
                                              "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep"]},
    },
}

POD_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["monitoring.coreos.com/v1"]},
        "kind": {"type": "string", "enum": ["PodMonitor"]},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["selector"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                         "(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                        },
                    },
                },
            },
        },
    },
}
