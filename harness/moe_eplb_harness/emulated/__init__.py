"""The EMULATED Kubernetes: a kmock-based API server over real HTTP and stand-ins for the controllers
that act on it. Not Kubernetes. Frozen (no new emulated controllers: the real ones run in
:mod:`moe_eplb_harness.real`); kept for ``moe-eplb demo`` without a Go build and for fault injection.
``tests/kube/test_shared_scenarios.py`` runs the same scenarios here and on the real control plane:
its contract.

- ``kubeapi``: the emulated API server (``emulated_cluster``, ``EmulatedCluster``), kmock's public
  API plus the apiserver semantics the operator relies on;
- ``kubelet``: ``FakeKubelet``, the kubelet, Deployment and LeaderWorkerSet controllers in one;
- ``lws``: the LeaderWorkerSet controller's decisions (pure), applied by ``kubelet``;
- ``hpa``: an HPA controller that scales on the pods' vLLM metrics itself.

Never imports :mod:`moe_eplb_harness.real` (.importlinter).
"""
