"""An emulated Kubernetes API server over real HTTP, for tests, benchmarks and ``moe-eplb demo``.

It extends kmock's ``KubernetesEmulator`` (kmock 0.8, by kopf's author) with the apiserver behaviour
that a real kopf operator depends on and that kmock 0.8 lacks:

- server-set metadata: ``uid``, ``resourceVersion`` (one global counter, increasing with every
  write), ``generation`` (1 on create, +1 only when something outside ``metadata``/``status``
  changes), ``creationTimestamp``, ``apiVersion``/``kind``, ``namespace``, ``generateName``;
- PATCH as JSON patch (RFC 6902, via ``jsonpatch``; a failed ``test`` answers 422 like the
  apiserver), JSON merge patch (RFC 7386) and strategic merge patch (approximated as a merge patch:
  lists are replaced, not merged by key); PUT (replace); server-side apply answers 415;
- ``?dryRun=All`` on create, patch and replace (checked, answered, nothing kept);
- the ``/scale`` subresource (``autoscaling/v1`` Scale; the CRD's replica and selector paths), as
  HPA and KEDA use it;
- optimistic concurrency: a write that carries ``metadata.resourceVersion`` different from the
  stored one answers 409 Conflict;
- LIST and WATCH with label selectors (equality- and set-based) and ``metadata.name`` /
  ``metadata.namespace`` field selectors; LIST returns the current resourceVersion; WATCH resumes
  after a given resourceVersion (410 Gone when it is older than the kept history) and honours
  ``timeoutSeconds``;
- the status subresource isolated from the main resource (writes to one ignore the other);
- finalizers and ``deletionTimestamp``; garbage collection of dependents through
  ``ownerReferences`` (background cascade; ``propagationPolicy: Orphan`` keeps them);
- the resources the moe-eplb operator uses: the bundled built-ins (Deployments, Services,
  ConfigMaps, PodDisruptionBudgets, Pods, Events, ...), the MoEInference CRD (from ``crds/`` when
  the file exists, else a minimal declaration), LeaderWorkerSet (the published CRD of
  kubernetes-sigs/lws, pod templates trimmed: ``floor/lws_crd.yaml``, so ``/scale`` reports
  ``status.hpaPodSelector``), KEDA's ScaledObject (its published CRD, descriptions removed:
  ``floor/keda_scaledobject_crd.yaml``), PodMonitor and kopf's peering CRDs;
- admission of LeaderWorkerSets and ScaledObjects like the apiserver's for a CRD with a structural schema: every
  create, update and status write is defaulted from the CRD's ``openAPIV3Schema`` and refused with
  422 ``Invalid`` when it breaks the schema (types, enums, bounds, patterns, required fields) or has
  fields the schema does not declare (as strict field validation would);
- Event field selectors (``involvedObject.kind|name|namespace|uid|apiVersion``, ``reason``, ``type``);
- fault injection for tests: :attr:`KubeAPIEmulator.faults` may answer any request with an error
  (a 500 or 409 on status writes, say) before it is served;
- optionally, a stand-in for the workload controllers: ``workload_ready_delay`` seconds after a
  Deployment/StatefulSet/LeaderWorkerSet spec change, its status reports all replicas updated and
  ready (there are no pods or GPUs here).

Not emulated: admission/validation of other kinds, ``limit``/``continue`` paging, watch bookmarks,
watch events for objects that move in or out of a label selector, server-side apply.

Differences from a real apiserver, checked against kube-apiserver 1.36.3 built from Kubernetes' Go
modules (``tests/kube/test_shared_scenarios.py`` runs the same scenarios on both; server-set metadata,
generation, status and ``/scale`` subresources, 409 on a stale resourceVersion, 422 on a failed JSON
patch ``test``, dry-run, label selectors and garbage collection agree):

- the MoEInference is stored without admission: no CRD schema, CEL rules or strict field validation
  (the real apiserver refuses, e.g., experts + redundancy not divisible by the EP size with 422). The
  operator's own validation refuses such a resource (``SpecValid=False``) on both;
- no OpenAPI document: ``kubectl apply`` needs ``--validate=false`` here; no server-side apply (415);
- garbage collection is immediate here; the real collector learns a new CRD's kind at its next
  discovery resync (up to 30 s after the CRD was installed);
- no CEL cost budget at CRD install: a CRD this emulation serves may still be refused by a real
  apiserver (two such defects were found that way: ``tests/kube/test_kubectl.py``);
- there are no Pods, ReplicaSets or controllers but those of ``emulated/kubelet.py``.

kmock is used through its public API (``kmock.KubernetesEmulator``, ``kmock.RawHandler``,
``kmock.Request``, ``kmock.resource``, ...): no ``kmock._internal`` import and no patching of kmock's
modules. What it still relies on beyond the documented surface is the subclassing contract of
``KubernetesEmulator``: the emulator overrides ``_handle`` (bypassing the base's own object store,
which it replaces; the DSL dispatch is ``kmock.RawHandler._handle``) and reads kmock's request log
and registered reactions (``_requests``, ``_payloads``) to trim the one and to see whether a test
added any of the other, and serialises writes under kmock's ``_lock``. kmock has no public hook
for these; they are attributes of the class it extends, pinned with kmock's version in ``pyproject.toml``.

Public entry point: ``async with emulated_cluster() as cluster: ...`` (see :class:`EmulatedCluster`),
or ``python -m moe_eplb_harness.emulated.kubeapi --port 8001 --kubeconfig kubeconfig.yaml`` as a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import os
import pathlib
import re
import secrets
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import attrs
import jsonpatch
import kmock
import yaml

from moe_eplb.api.schema import fill_schema_defaults, schema_problems, unknown_field_problems
from moe_eplb.contracts.k8s_names import (
    API_GROUP,
    API_VERSION,
    KIND,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    PLURAL,
)
from moe_eplb_harness.floor.client import ClusterClient, Connection, open_session

__all__ = [
    "KubeAPIEmulator",
    "EmulatedCluster",
    "emulated_cluster",
    "parse_label_selector",
    "label_selector_matches",
]

ResourceRef = kmock.resource
Key = tuple[Any, str | None, str]  # (kmock.resource, namespace or None, name)

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
HISTORY_LIMIT = 2_000  # watch events kept per resource for resuming a watch (older: 410 Gone, relist)
REQUESTS_KEPT = 50_000  # kmock's request log is trimmed to the newest half beyond this (long demos)

#: (group, version, plural, kind, namespaced, subresources) of the non-built-in resources served.
EXTRA_RESOURCES: tuple[tuple[str, str, str, str, bool, tuple[str, ...]], ...] = (
    ("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor", True, ()),
    ("kopf.dev", "v1", "kopfpeerings", "KopfPeering", True, ()),
    ("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", False, ()),
)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: The LeaderWorkerSet CRD served (and enforced) by the emulator: see ``scripts/vendor_lws_crd.py``.
LWS_CRD_FILE = pathlib.Path(__file__).parent.parent / "floor" / "lws_crd.yaml"


def lws_crd() -> dict[str, Any]:
    """The LeaderWorkerSet CRD as published by kubernetes-sigs/lws (pod templates trimmed)."""
    return yaml.safe_load(LWS_CRD_FILE.read_text())


#: KEDA's ScaledObject CRD, served (and enforced) by the emulator: see ``scripts/vendor_keda_crd.py``.
KEDA_CRD_FILE = pathlib.Path(__file__).parent.parent / "floor" / "keda_scaledobject_crd.yaml"


def keda_crd() -> dict[str, Any]:
    """KEDA's ScaledObject CRD as published by kedacore/keda (descriptions removed)."""
    return yaml.safe_load(KEDA_CRD_FILE.read_text())


#: A fault injector: called with each request before it is served; an error to answer it with
#: ``(status, reason, message)``, or None to serve it.
Fault = Callable[[kmock.Request], "tuple[int, str, str] | None"]


def _error(status: int, reason: str, message: str, details: dict[str, Any] | None = None) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {})


# --------------------------------------------------------------------------------------------------
# kmock 0.8 cannot parse the Namespace objects' own URLs (/api/v1/namespaces[/x[/status]]): it takes
# "namespaces" for the namespace prefix (and fails with a 500 on the bare list URL). kopf lists and
# watches namespaces when it serves selected namespaces. So the emulator hands kmock those requests
# under a stand-in plural that kmock parses (:func:`_namespace_url`) and, before serving, puts the
# real resource back on the parsed request (:func:`_namespace_request`): kmock's public API only, and
# no other path is touched.
# --------------------------------------------------------------------------------------------------

_NS_STANDIN = "namespaces--emulated"  # not a valid plural, so never a real resource's
NAMESPACES = kmock.resource("", "v1", "namespaces")


def _namespace_url(path: str) -> str | None:
    """The stand-in path for a Namespace object URL, else None (every other path as it is)."""
    parts = [p for p in path.strip("/").split("/") if p]
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or parts[4] in ("status", "finalize")):
        return "/" + "/".join(["api", "v1", _NS_STANDIN, *parts[3:]])
    return None


def _namespace_request(request: kmock.Request) -> kmock.Request:
    """The request with the Namespace resource back in place of the stand-in (others unchanged)."""
    if request.resource is None or request.resource.plural != _NS_STANDIN:
        return request
    url = request.url.with_path(request.url.path.replace(f"/{_NS_STANDIN}", "/namespaces", 1)).with_query(request.url.query)
    return attrs.evolve(request, resource=NAMESPACES, namespace=None, url=url)

# --------------------------------------------------------------------------------------------------
# label selectors
# --------------------------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    """Split at commas that are not inside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str) -> list[tuple[str, str, frozenset[str]]]:
    """Parse a label selector string into ``[(key, op, values)]``; op is one of
    ``= != in notin exists !exists``. Raises ``ValueError`` on a malformed selector."""
    result: list[tuple[str, str, frozenset[str]]] = []
    for part in _split_selector(text or ""):
        if m := _SET_RE.match(part):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            result.append((m.group(1), m.group(2), values))
        elif "!=" in part:
            k, v = part.split("!=", 1)
            result.append((k.strip(), "!=", frozenset([v.strip()])))
        elif "==" in part or "=" in part:
            k, v = part.split("==", 1) if "==" in part else part.split("=", 1)
            result.append((k.strip(), "=", frozenset([v.strip()])))
        elif part.startswith("!"):
            result.append((part[1:].strip(), "!exists", frozenset()))
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", part):
            result.append((part, "exists", frozenset()))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return result


def label_selector_matches(selector: list[tuple[str, str, frozenset[str]]], labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy every requirement of a parsed selector."""
    for key, op, values in selector:
        present = key in labels
        value = labels.get(key)
        if op == "=" and not (present and value in values):
            return False
        if op in ("!=", "notin") and present and value in values:
            return False
        if op == "in" and not (present and value in values):
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
    return True


def _field_selector_matches(text: str | None, obj: Mapping[str, Any]) -> bool:
    if not text:
        return True
    meta = obj.get("metadata", {})
    for part in _split_selector(text):
        neg = "!=" in part
        key, value = part.split("!=" if neg else ("==" if "==" in part else "="), 1)
        key, value = key.strip(), value.strip()
        if key == "metadata.name":
            actual = meta.get("name")
        elif key == "metadata.namespace":
            actual = meta.get("namespace")
        elif key.startswith("involvedObject.") and obj.get("kind") == "Event":
            actual = (obj.get("involvedObject") or {}).get(key.split(".", 1)[1])
        elif key in ("reason", "type") and obj.get("kind") == "Event":
            actual = obj.get(key)
        else:
            raise _error(400, "BadRequest", f"field label not supported by the emulator: {key}")
        if (actual == value) == neg:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# patches
# --------------------------------------------------------------------------------------------------

def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``None`` removes a key; lists and scalars replace)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def _get_path(obj: Mapping[str, Any], path: str) -> Any:
    """``.spec.replicas`` -> obj['spec']['replicas'] (None when absent)."""
    cur: Any = obj
    for part in path.strip(".").split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Everything that bumps ``generation`` when it changes: all but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


# --------------------------------------------------------------------------------------------------
# the emulator
# --------------------------------------------------------------------------------------------------

@attrs.define(kw_only=True)
class KubeAPIEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with apiserver semantics the operator relies on (module doc).

    Objects live in :attr:`store`: ``{(resource, namespace|None, name): object dict}``.
    Every write appends to :attr:`writes` (``(verb, resource.plural, namespace, name, subresource)``),
    which tests use to prove that nothing was written (e.g. after an operator restart).
    """

    workload_ready_delay: float | None = None  # seconds; None: nothing makes workloads ready
    faults: Fault | None = None  # tests: answer some requests with an error before serving them
    store: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    writes: list[tuple[str, str, str | None, str, str | None]] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _history: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict, init=False)
    _first_rv: dict[Any, int] = attrs.field(factory=dict, init=False)
    _watchers: dict[Any, set[asyncio.Queue[tuple[int, dict[str, Any]]]]] = attrs.field(factory=dict, init=False)
    _tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)
    _dry: bool = attrs.field(default=False, init=False)
    _scale_paths: dict[Any, tuple[str, str, str | None]] = attrs.field(factory=dict, init=False)
    _schemas: dict[Any, dict[str, Any]] = attrs.field(factory=dict, init=False)  # enforced openAPIV3Schemas

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.resources.load_bundled()
        for group, version, plural, kind, namespaced, subresources in EXTRA_RESOURCES:
            self.declare(group, version, plural, kind=kind, namespaced=namespaced, subresources=subresources)
        self.install_crd(lws_crd(), enforce_schema=True)
        self.install_crd(keda_crd(), enforce_schema=True)
        self._builtin_payloads = len(self._payloads)

    # ---- declarations ---------------------------------------------------------------------------
    def declare(self, group: str, version: str, plural: str, *, kind: str, namespaced: bool = True,
                subresources: Iterable[str] = (), singular: str | None = None,
                shortnames: Iterable[str] = ()) -> None:
        """Serve a resource (shown in discovery, CRUD + watch)."""
        self.resources[f"{group}/{version}/{plural}" if group else f"{version}/{plural}"] = kmock.ResourceInfo(
            kind=kind, singular=singular or kind.lower(), namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
            shortnames=set(shortnames), subresources=set(subresources),
        )

    def install_crd(self, crd: Mapping[str, Any], *, enforce_schema: bool = False) -> None:
        """Serve every version of a CustomResourceDefinition and store the CRD object itself.

        ``enforce_schema``: default and validate every write against the version's
        ``openAPIV3Schema`` (admission, see :meth:`_admit`)."""
        spec = crd["spec"]
        names = spec["names"]
        for ver in spec["versions"]:
            if not ver.get("served", True):
                continue
            schema = (ver.get("schema") or {}).get("openAPIV3Schema")
            if enforce_schema and schema:
                self._schemas[kmock.resource(spec["group"], ver["name"], names["plural"])] = schema
            scale = (ver.get("subresources") or {}).get("scale")
            if scale:
                self._scale_paths[kmock.resource(spec["group"], ver["name"], names["plural"])] = (
                    scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
            self.declare(spec["group"], ver["name"], names["plural"], kind=names["kind"],
                         namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                         subresources=tuple(ver.get("subresources", {}) or {}),
                         singular=names.get("singular"), shortnames=names.get("shortNames", ()))
        res = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        body = copy.deepcopy(dict(crd))
        self._create_object(res, None, body)

    # ---- the /scale subresource ----------------------------------------------------------------
    def _scale_view(self, res: Any, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The ``autoscaling/v1`` Scale of ``obj`` (paths from the CRD; ``.spec.replicas`` for built-ins)."""
        spec_path, status_path, selector_path = self._scale_paths.get(res, (".spec.replicas", ".status.replicas", None))
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _get_path(obj, status_path) or 0}
        if selector_path and _get_path(obj, selector_path):
            status["selector"] = _get_path(obj, selector_path)
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": _get_path(obj, spec_path)}, "status": status}

    def _write_scale(self, key: Key, scale: Mapping[str, Any], verb: str) -> dict[str, Any]:
        res = key[0]
        spec_path = self._scale_paths.get(res, (".spec.replicas",))[0]
        new = copy.deepcopy(self.store[key])
        _set_path(new, spec_path, int((scale.get("spec") or {}).get("replicas", 0)))
        new["metadata"]["resourceVersion"] = (scale.get("metadata") or {}).get("resourceVersion")
        return self._scale_view(res, self._write_object(key, new, None, verb))

    def _admit(self, res: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """Admission of a custom resource with an enforced schema, as the apiserver does it: fill in
        the schema's defaults, then refuse (422 Invalid) what breaks the schema or is not in it."""
        schema = self._schemas.get(res)
        if schema is None:
            return obj
        obj = fill_schema_defaults(obj, schema)
        problems = unknown_field_problems(obj, schema) + schema_problems(obj, schema)
        if problems:
            kind = obj.get("kind") or res.plural
            name = (obj.get("metadata") or {}).get("name")
            text = "; ".join(f"{p.field}: {p.message}" for p in problems[:10])
            raise _error(422, "Invalid", f'{kind}.{res.group} "{name}" is invalid: {text}',
                         {"name": name, "group": res.group, "kind": kind,
                          "causes": [{"field": p.field, "message": p.message} for p in problems[:10]]})
        return obj

    def _info(self, res: Any) -> kmock.ResourceInfo | None:
        try:
            return self.resources[res]
        except KeyError:
            return None

    # ---- dispatching ----------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        standin = _namespace_url(raw_request.path)
        if standin is not None:
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.with_path(standin).with_query(raw_request.rel_url.query))
        return await super().__call__(raw_request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        fixed = _namespace_request(request)
        if fixed is not request:  # the request log (what tests iterate) shows the Namespace request too
            for i in range(len(self._requests) - 1, -1, -1):
                if self._requests[i] is request:
                    self._requests[i] = fixed
                    break
            request = fixed
        # Object requests go straight to our _serve_* methods. kmock's DSL dispatch (kept for
        # discovery, non-Kubernetes paths, and whenever a test added its own reactions, which then
        # come first) checks each request against every earlier one: quadratic, too slow for the
        # thousands of requests of a benchmark. KubernetesEmulator._handle is bypassed either way
        # (it mutates kmock's own store before dispatching).
        if len(self._requests) > REQUESTS_KEPT:
            del self._requests[: REQUESTS_KEPT // 2]
        fault = self.faults(request) if self.faults is not None else None
        if fault is not None:
            status, reason, message = fault
            return await kmock.Response(status=status, payload={
                "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status, "reason": reason,
                "message": message})(request)
        serve = None
        if request.resource is not None and request.resource.plural is not None \
                and len(self._payloads) <= self._builtin_payloads:
            if request.method == kmock.method.PUT and request.name is not None:
                serve = self._serve_replace
            else:
                serve = {
                    kmock.action.LIST: self._serve_list, kmock.action.WATCH: self._serve_watch,
                    kmock.action.FETCH: self._serve_fetch, kmock.action.CREATE: self._serve_create,
                    kmock.action.UPDATE: self._serve_update, kmock.action.DELETE: self._serve_delete,
                }.get(request.action)
        if serve is None:
            return await kmock.RawHandler._handle(self, request)
        return await kmock.Response(payload=serve(request))(request)

    async def _serve_version(self, request: kmock.Request) -> Any:
        # As the apiserver: the core group's groupVersion is "v1"; subresources (``x/status``) carry no short names or categories
        # (else kubectl warns that ``moe`` could also mean ``moeinferences/status``).
        doc = await super()._serve_version(request)
        doc["groupVersion"] = doc["groupVersion"].lstrip("/")  # core: "v1", not kmock's "/v1"
        for entry in doc.get("resources", []):
            if "/" in entry.get("name", ""):
                entry["shortNames"], entry["categories"] = [], []
        return doc

    def _require(self, request: kmock.Request) -> kmock.ResourceInfo:
        info = self._info(request.resource) if request.resource is not None else None
        if info is None or request.resource.plural is None:
            raise kmock.KubernetesResourceNotFoundError()
        return info

    def _key(self, request: kmock.Request, name: str | None = None) -> Key:
        info = self._require(request)
        namespace = request.namespace if info.namespaced else None
        if info.namespaced and namespace is None:
            raise _error(400, "BadRequest", "a namespaced resource needs a namespace in the URL")
        return (request.resource, namespace, name or request.name)

    # ---- writes (all under the lock) ------------------------------------------------------------
    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _emit(self, res: Any, kind: str, obj: dict[str, Any]) -> None:
        if self._dry:
            return
        rv = int(obj["metadata"]["resourceVersion"])
        event = {"type": kind, "object": copy.deepcopy(obj)}
        hist = self._history.setdefault(res, [])
        hist.append((rv, event))
        if len(hist) > HISTORY_LIMIT:
            dropped = hist[: len(hist) - HISTORY_LIMIT]
            del hist[: len(hist) - HISTORY_LIMIT]
            self._first_rv[res] = dropped[-1][0]
        for queue in self._watchers.get(res, ()):
            queue.put_nowait((rv, event))

    def _create_object(self, res: Any, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        info = self._info(res)
        if info is None:
            raise kmock.KubernetesResourceNotFoundError()
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + secrets.token_hex(3)[:5]
        if not name:
            raise _error(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        ns = (namespace or meta.get("namespace")) if info.namespaced else None
        if info.namespaced and not ns:
            raise _error(400, "BadRequest", "a namespaced resource needs a namespace")
        if namespace and meta.get("namespace") and meta["namespace"] != namespace:
            raise _error(400, "BadRequest", "the namespace of the object does not match the URL")
        key = (res, ns, name)
        if key in self.store:
            raise _error(409, "AlreadyExists", f'{res.plural} "{name}" already exists',
                         {"name": name, "kind": res.plural})
        if "status" in info.subresources:
            obj.pop("status", None)
        obj = self._admit(res, obj)
        meta = obj["metadata"]
        meta.update(name=name, uid=str(uuid.uuid4()), resourceVersion=str(self._next_rv()),
                    generation=1, creationTimestamp=_now())
        meta.pop("deletionTimestamp", None)
        if ns:
            meta["namespace"] = ns
        obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        obj["kind"] = info.kind
        self.store[key] = obj
        self.writes.append(("create", res.plural, ns, name, None))
        self._emit(res, "ADDED", obj)
        self._after_write(key, None, obj)
        return obj

    def _write_object(self, key: Key, new: dict[str, Any], subresource: str | None, verb: str) -> dict[str, Any]:
        res, ns, name = key
        info = self._info(res)
        old = self.store[key]
        sent_rv = (new.get("metadata") or {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict",
                         f'Operation cannot be fulfilled on {res.plural} "{name}": the object has been '
                         "modified; please apply your changes to the latest version and try again")
        if subresource == "status":
            obj = copy.deepcopy(old)
            if "status" in new:
                obj["status"] = copy.deepcopy(new["status"])
            else:
                obj.pop("status", None)
        elif subresource is None:
            obj = copy.deepcopy(new)
            obj["metadata"] = dict(obj.get("metadata") or {})
            if info is not None and "status" in info.subresources:
                if "status" in old:
                    obj["status"] = copy.deepcopy(old["status"])
                else:
                    obj.pop("status", None)
            for field in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "name", "namespace"):
                if field in old["metadata"]:
                    obj["metadata"][field] = old["metadata"][field]
                else:
                    obj["metadata"].pop(field, None)
            obj["apiVersion"], obj["kind"] = old["apiVersion"], old["kind"]
        else:
            raise _error(404, "NotFound", f"subresource {subresource!r} is not emulated")
        obj = self._admit(res, obj)
        obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if obj == old:
            return old  # a no-op write changes nothing, not even the resourceVersion
        if _spec_part(obj) != _spec_part(old):
            obj["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self.writes.append((verb, res.plural, ns, name, subresource))
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not self._dry:
            self.store[key] = obj
            self._delete_now(key)
            return obj
        self.store[key] = obj
        self._emit(res, "MODIFIED", obj)
        self._after_write(key, old, obj)
        return obj

    def _delete_now(self, key: Key, orphan: bool = False) -> None:
        res, ns, name = key
        obj = self.store.pop(key)
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self.writes.append(("delete", res.plural, ns, name, None))
        self._emit(res, "DELETED", obj)
        if not orphan:
            self._collect_garbage(obj["metadata"]["uid"])

    def _request_delete(self, key: Key, orphan: bool = False) -> dict[str, Any]:
        obj = self.store[key]
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["resourceVersion"] = str(self._next_rv())
                self.store[key] = new
                self.writes.append(("delete", key[0].plural, key[1], key[2], None))
                self._emit(key[0], "MODIFIED", new)
                return new
            return obj
        self._delete_now(key, orphan=orphan)
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascade: delete objects whose every owner is gone."""
        live_uids = {o["metadata"]["uid"] for o in self.store.values()}
        for key, obj in list(self.store.items()):
            if key not in self.store:
                continue
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs) and not any(r.get("uid") in live_uids for r in refs):
                self._request_delete(key)

    # ---- the workload-controller stand-in -------------------------------------------------------
    def _after_write(self, key: Key, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        if self._dry:
            return
        if self.workload_ready_delay is None or new.get("kind") not in WORKLOAD_KINDS:
            return
        if old is not None and old["metadata"].get("generation") == new["metadata"].get("generation"):
            return
        task = asyncio.get_running_loop().create_task(self._make_ready(key, new["metadata"]["generation"]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _make_ready(self, key: Key, generation: int) -> None:
        await asyncio.sleep(self.workload_ready_delay or 0)
        async with self._lock:
            obj = self.store.get(key)
            if obj is None or obj["metadata"].get("generation") != generation:
                return
            self._write_object(key, {"status": self.ready_status(obj)}, "status", "controller")

    @staticmethod
    def ready_status(obj: Mapping[str, Any]) -> dict[str, Any]:
        """The status a workload controller reports once every replica is updated and ready."""
        n = int((obj.get("spec") or {}).get("replicas", 1))
        gen = obj["metadata"].get("generation", 1)
        status: dict[str, Any] = {"observedGeneration": gen, "replicas": n, "readyReplicas": n,
                                  "updatedReplicas": n}
        if obj.get("kind") == "Deployment":
            status["availableReplicas"] = n
            status["conditions"] = [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ]
        elif obj.get("kind") == "LeaderWorkerSet":
            name = obj["metadata"]["name"]
            status["hpaPodSelector"] = f"{LWS_NAME_LABEL}={name},{LWS_WORKER_INDEX_LABEL}=0"
            status["conditions"] = [{"type": "Available", "status": "True", "reason": "AllGroupsReady",
                                     "message": "All replicas are ready", "lastTransitionTime": _now(),
                                     "observedGeneration": gen}]
        else:
            status["currentReplicas"] = n
            status["availableReplicas"] = n
        return status

    # ---- HTTP verbs (kmock fallbacks) -----------------------------------------------------------
    @staticmethod
    def _selectors(request: kmock.Request) -> tuple[Any, str | None]:
        """The request's label selector (parsed; 400 when malformed) and field selector."""
        try:
            selector = parse_label_selector(request.params.get("labelSelector", ""))
        except ValueError as exc:
            raise _error(400, "BadRequest", f"labelSelector: {exc}") from None
        return selector, request.params.get("fieldSelector")

    def _selected(self, request: kmock.Request) -> list[dict[str, Any]]:
        self._require(request)
        selector, fields = self._selectors(request)
        out = []
        for (res, ns, _), obj in self.store.items():
            if res != request.resource or (request.namespace is not None and ns != request.namespace):
                continue
            if label_selector_matches(selector, obj["metadata"].get("labels") or {}) \
                    and _field_selector_matches(fields, obj):
                out.append(obj)
        return out

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        async with self._lock:
            info = self._require(request)
            items = copy.deepcopy(self._selected(request))
            return {"apiVersion": f"{request.resource.group}/{request.resource.version}".lstrip("/"),
                    "kind": f"{info.kind}List", "metadata": {"resourceVersion": str(self._rv)},
                    "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now, even if no event comes
        res = request.resource
        queue: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        since = request.params.get("resourceVersion") or "0"
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        async with self._lock:
            self._require(request)
            selector, fields = self._selectors(request)
            if since == "0":
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in self._selected(request)]
            elif int(since) < self._first_rv.get(res, 0):
                initial = [{"type": "ERROR", "object": {
                    "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {since}"}}]
            else:
                initial = [e for rv, e in self._history.get(res, []) if rv > int(since)]
            self._watchers.setdefault(res, set()).add(queue)

        def wanted(event: dict[str, Any]) -> bool:
            obj = event["object"]
            if event["type"] == "ERROR":
                return True
            ns = obj.get("metadata", {}).get("namespace")
            if request.namespace is not None and ns != request.namespace:
                return False
            return label_selector_matches(selector, obj["metadata"].get("labels") or {}) \
                and _field_selector_matches(fields, obj)

        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            for event in initial:
                if wanted(event):
                    yield event
                if event["type"] == "ERROR":
                    return
            while True:
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return
                try:
                    _, event = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    return
                if wanted(event):
                    yield event
        finally:
            self._watchers.get(res, set()).discard(queue)

    async def _serve_fetch(self, request: kmock.Request) -> dict[str, Any]:
        async with self._lock:
            key = self._key(request)
            if key not in self.store:
                raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found',
                             {"name": request.name, "kind": request.resource.plural})
            if request.subresource == "scale":
                return self._scale_view(key[0], self.store[key])
            return copy.deepcopy(self.store[key])

    @contextlib.contextmanager
    def _maybe_dry(self, request: kmock.Request, key: Key | None) -> Any:
        """``?dryRun=All``: run the write's checks and return its result, but keep nothing
        (no store change, no resourceVersion, no watch event, no write record)."""
        if request.params.get("dryRun") != "All":
            yield
            return
        saved = (copy.deepcopy(self.store.get(key)) if key else None, self._rv, len(self.writes))
        self._dry = True
        try:
            yield
        finally:
            self._dry = False
            if key is not None:
                if saved[0] is None:
                    self.store.pop(key, None)
                else:
                    self.store[key] = saved[0]
            self._rv = saved[1]
            del self.writes[saved[2]:]

    async def _serve_create(self, request: kmock.Request) -> Any:
        if not isinstance(request.data, dict):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        async with self._lock:
            info = self._require(request)
            meta = request.data.get("metadata") or {}
            ns = (request.namespace or meta.get("namespace")) if info.namespaced else None
            key = (request.resource, ns, meta["name"]) if meta.get("name") else None
            with self._maybe_dry(request, key):
                obj = copy.deepcopy(self._create_object(request.resource, request.namespace, request.data))
            return kmock.Response(status=201, payload=obj)

    async def _serve_update(self, request: kmock.Request) -> dict[str, Any]:
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        async with self._lock:
            key = self._existing(request)
            current = self.store[key]
            if request.subresource == "scale":
                current = self._scale_view(key[0], current)
            if ctype == "application/json-patch+json":
                if not isinstance(request.data, list):
                    raise _error(400, "BadRequest", "a JSON patch must be a list of operations")
                try:
                    new = jsonpatch.apply_patch(current, request.data)
                except jsonpatch.JsonPatchTestFailed as exc:
                    raise _error(422, "Invalid",
                                 f"the server rejected our request due to an error in our request: {exc}") from None
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise _error(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from None
                new.setdefault("metadata", {}).pop("resourceVersion", None)
            elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json", "application/json", ""):
                if not isinstance(request.data, dict):
                    raise _error(400, "BadRequest", "a merge patch must be a JSON object")
                new = apply_merge_patch(copy.deepcopy(current), request.data)
                sent_rv = (request.data.get("metadata") or {}).get("resourceVersion")
                new["metadata"]["resourceVersion"] = sent_rv
            else:
                raise _error(415, "UnsupportedMediaType",
                             f"the emulator does not support PATCH with {ctype!r} (no server-side apply)")
            with self._maybe_dry(request, key):
                if request.subresource == "scale":
                    return self._write_scale(key, new, "patch")
                return copy.deepcopy(self._write_object(key, new, request.subresource, "patch"))

    async def _serve_replace(self, request: kmock.Request) -> dict[str, Any]:
        if not isinstance(request.data, dict):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        async with self._lock:
            key = self._existing(request)
            with self._maybe_dry(request, key):
                if request.subresource == "scale":
                    return self._write_scale(key, request.data, "update")
                return copy.deepcopy(self._write_object(key, request.data, request.subresource, "update"))

    async def _serve_delete(self, request: kmock.Request) -> dict[str, Any]:
        body = request.data if isinstance(request.data, dict) else {}
        orphan = (body.get("propagationPolicy") or request.params.get("propagationPolicy")) == "Orphan"
        async with self._lock:
            key = self._existing(request)
            return copy.deepcopy(self._request_delete(key, orphan=orphan))

    def _existing(self, request: kmock.Request) -> Key:
        key = self._key(request)
        if request.name is None:
            raise _error(405, "MethodNotAllowed", "collection writes are not emulated")
        if key not in self.store:
            raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found',
                         {"name": request.name, "kind": request.resource.plural})
        return key

    async def __aexit__(self, *exc: Any) -> None:
        for task in list(self._tasks):
            task.cancel()
        await super().__aexit__(*exc)


# --------------------------------------------------------------------------------------------------
# the public helper
# --------------------------------------------------------------------------------------------------

def _find_crd_file() -> pathlib.Path | None:
    here = pathlib.Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "crds" / f"{PLURAL}.{API_GROUP}.yaml"
        if candidate.is_file():
            return candidate
    return None


def minimal_moeinference_crd() -> dict[str, Any]:
    """A CRD with the MoEInference names, served version and subresources, without a schema."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {"group": API_GROUP, "scope": "Namespaced",
                 "names": {"kind": KIND, "plural": PLURAL, "singular": KIND.lower(), "shortNames": ["moe"]},
                 "versions": [{"name": API_VERSION, "served": True, "storage": True,
                               "subresources": {"status": {}, "scale": {
                                   "specReplicasPath": ".spec.replicas",
                                   "statusReplicasPath": ".status.replicas",
                                   "labelSelectorPath": ".status.selector"}}}]},
    }


def moeinference_crd() -> dict[str, Any]:
    """The project's CRD (``crds/moeinferences.eplb.ai.yaml``) when present, else the minimal one."""
    path = _find_crd_file()
    if path is not None:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if docs:
            return docs[0]
    return minimal_moeinference_crd()


def write_kubeconfig(path: str | os.PathLike[str], server: str, namespace: str = "default") -> None:
    """Write a kubeconfig that points at ``server`` (no TLS, a dummy token)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulated",
        "clusters": [{"name": "emulated", "cluster": {"server": server}}],
        "users": [{"name": "emulated", "user": {"token": "emulated"}}],
        "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "emulated",
                                                         "namespace": namespace}}],
    }
    pathlib.Path(path).write_text(yaml.safe_dump(config))


@attrs.define
class EmulatedCluster(ClusterClient):
    """A running emulated API server: the harness's client (:class:`moe_eplb_harness.floor.client.ClusterClient`:
    ``url``, ``kubeconfig``, the calls over real HTTP) and ``api``, the emulator itself (its store, its
    request log and :attr:`KubeAPIEmulator.faults`, for fault injection)."""

    api: KubeAPIEmulator


@contextlib.asynccontextmanager
async def emulated_cluster(*, workload_ready_delay: float | None = None, port: int | None = None,
                           host: str = "127.0.0.1", crd: Mapping[str, Any] | None = None,
                           namespaces: Iterable[str] = ("default",),
                           faults: Fault | None = None) -> AsyncIterator[EmulatedCluster]:
    """Start the emulated API server on ``host:port`` (a free port by default) with the MoEInference
    CRD installed and the given namespaces created; yield an :class:`EmulatedCluster`.
    ``faults``: see :attr:`KubeAPIEmulator.faults` (may also be set later on ``cluster.api``)."""
    api = KubeAPIEmulator(workload_ready_delay=workload_ready_delay, faults=faults)
    api.install_crd(dict(crd) if crd is not None else moeinference_crd())
    for ns in namespaces:
        api._create_object(NAMESPACES, None, {"metadata": {"name": ns}})
    with tempfile.TemporaryDirectory(prefix="moe-eplb-kubeapi-") as tmp:
        async with api, kmock.Server(api, host=host, port=port) as server:
            url = str(server.url).rstrip("/")
            kubeconfig = os.path.join(tmp, "kubeconfig.yaml")
            write_kubeconfig(kubeconfig, url)
            connection = Connection(server=url, token="emulated")
            async with open_session(connection, user_agent="emulated-cluster-client") as session:
                yield EmulatedCluster(api=api, url=url, kubeconfig=kubeconfig, session=session, connection=connection)


async def _serve_forever(port: int, kubeconfig: str | None, ready_delay: float | None) -> None:
    async with emulated_cluster(port=port, workload_ready_delay=ready_delay) as cluster:
        if kubeconfig:
            write_kubeconfig(kubeconfig, cluster.url)
        print(f"emulated Kubernetes API at {cluster.url}" + (f", kubeconfig {kubeconfig}" if kubeconfig else ""),
              flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    """``python -m moe_eplb_harness.emulated.kubeapi [--port N] [--kubeconfig PATH] [--ready-delay S]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--kubeconfig", help="write a kubeconfig pointing at the emulator here")
    parser.add_argument("--ready-delay", type=float, default=None,
                        help="seconds after which workloads report all replicas ready (default: never)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.port or None, args.kubeconfig, args.ready_delay))


if __name__ == "__main__":
    main()
