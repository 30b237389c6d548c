"""The ``kube`` tier: tests against a REAL control plane (etcd, kube-apiserver,
kube-controller-manager of one Kubernetes release, built from Go modules by ``tools/kube/build.sh``;
``make kube``). See :mod:`moe_eplb_harness.real.controlplane`.

- ``control_plane`` (session): the running :class:`~moe_eplb_harness.real.controlplane.ControlPlane` of the
  session's ``real_control_plane`` (tests/conftest.py: shared with the real-API autotune scenarios; with
  kube-scheduler and, where built, the real LeaderWorkerSet controller), with the MoEInference CRD
  (``crds/``) installed and established. Started once (seconds); its logs stay in the session's
  temporary folder, and the tail of each is attached to a failing test's report.
- ``kube_ns``: a fresh namespace for one test, deleted afterwards.
- ``real``: ``async with real(token=None) as cluster`` -- the async client
  (:class:`~moe_eplb_harness.real.realapi.RealCluster`) with the emulation's calls.

Without the built binaries the tier is skipped with the reason, except in CI
(``MOE_EPLB_REQUIRE_KUBE=1``), where a missing binary fails every test here.
"""

from __future__ import annotations

import functools
import pathlib
import secrets
import urllib.error
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from moe_eplb_harness.real.controlplane import ControlPlane
from tests.example_manifests import seed, variant  # noqa: F401  (pytest fixtures)
from tests.polling import wait_until
from tests.require import missing

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "moeinferences.eplb.ai.yaml"


def pytest_collection_modifyitems(items: list) -> None:
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.kube)
            item.add_marker(pytest.mark.integration)


def tiny_resource(name: str, namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    """A MoEInference of the simulated tiny MoE (16 experts, 4 layers, top-2, EP 4), EPLB at vLLM's
    defaults, autotune off; ``spec`` adds or replaces top-level spec fields (``replicas``, ``autoscaling``)."""
    meta = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": meta, "spec": {
        "model": {"name": "example/tiny-moe", "architecture": "Qwen3MoeForCausalLM",
                  "moe": {"numExperts": 16, "numMoeLayers": 4, "topK": 2, "numExpertGroups": 1,
                          "bytesPerExpert": 1048576}},
        "engine": {"image": "vllm/vllm-openai:v0.12.0"},
        "parallelism": {"tensor": 1, "data": 4},
        "eplb": {"enabled": True, "windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0},
        "autotune": {"mode": "Off"},
        **spec}}


def not_found(exc: BaseException) -> bool:
    """A ``urllib`` 404: the object is not there yet (any other error ends a wait)."""
    return isinstance(exc, urllib.error.HTTPError) and exc.code == 404


#: ``wait_for(check, timeout=30, what=...)``: the one poller (:func:`tests.polling.wait_until`) with
#: 404s counting as "not yet"
wait_for = functools.partial(wait_until, timeout=30.0, interval=0.2, not_yet=not_found)


def install_crd(cp: ControlPlane, path: pathlib.Path = CRD_FILE) -> dict[str, Any]:
    """``kubectl apply --server-side`` a CRD file and wait until the apiserver serves it."""
    cp.install_crd(path)
    return next(d for d in yaml.safe_load_all(path.read_text()) if d)


@pytest.fixture(scope="session")
def control_plane(real_control_plane: Any) -> ControlPlane:
    """The session's control plane (``real_control_plane``, tests/conftest.py), with the MoEInference CRD of
    ``crds/`` (what a user installs) applied over the package's copy."""
    install_crd(real_control_plane.plane)
    return real_control_plane.plane


@pytest.fixture()
def kube_ns(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace (deleted, without waiting, afterwards)."""
    name = f"t-{secrets.token_hex(4)}"
    control_plane.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: control_plane.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default"),
             what=f"default ServiceAccount in {name}")
    yield name
    try:
        control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
    except urllib.error.HTTPError:
        pass


@pytest.fixture()
def real(control_plane: ControlPlane) -> Callable[..., Any]:
    from moe_eplb_harness.real.realapi import real_cluster

    return lambda token=None: real_cluster(control_plane, token=token)


@pytest.fixture(scope="module")
def hpa_adapter_parts() -> None:
    """The control plane, prometheus-adapter and Prometheus that the real HPA controller's tests
    need; skipped with the reason otherwise, except in CI (``MOE_EPLB_REQUIRE_KUBE=1``)."""
    from moe_eplb_harness.floor.prometheus import find_prometheus
    from moe_eplb_harness.real.controlplane import default_bin_dir, find_binaries
    from moe_eplb_harness.real.metricsadapter import default_adapter_binary, find_adapter

    absent = []
    if find_binaries() is None:
        absent.append(f"no control plane built in {default_bin_dir()} (run `make kube`)")
    if find_adapter() is None:
        absent.append(f"no prometheus-adapter built at {default_adapter_binary()} (run `make kube`)")
    if find_prometheus().problem:
        absent.append(find_prometheus().problem)
    if absent:
        missing("; ".join(absent))


@pytest.fixture(scope="module")
def keda_parts() -> None:
    """The control plane, KEDA (operator and metrics server, ``tools/keda``) and Prometheus that the
    real KEDA's tests need; skipped with the reason otherwise, except in CI (``MOE_EPLB_REQUIRE_KUBE=1``)."""
    from moe_eplb_harness.floor.prometheus import find_prometheus
    from moe_eplb_harness.real.controlplane import ControlPlaneError, default_bin_dir, find_binaries
    from moe_eplb_harness.real.keda import crd_files, default_keda_bin_dir, find_keda

    absent = []
    if find_binaries() is None:
        absent.append(f"no control plane built in {default_bin_dir()} (run `make kube`)")
    if find_keda() is None:
        absent.append(f"no KEDA built in {default_keda_bin_dir()} (run `make kube`)")
    try:
        crd_files()
    except ControlPlaneError as exc:
        absent.append(str(exc))
    if find_prometheus().problem:
        absent.append(find_prometheus().problem)
    if absent:
        missing("; ".join(absent))
