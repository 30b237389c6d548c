"""The REAL parts run on loopback: Kubernetes' own control plane, the LeaderWorkerSet controller,
prometheus-adapter, KEDA, the Prometheus Operator and the Helm CLI, built from their Go modules
(``make kube``), and simulated GPU nodes for them.

- ``controlplane``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler (``ControlPlane``);
- ``simplane``: that plane as a simulated cluster runs on it (``SimPlane``: CRDs, the LWS controller,
  namespaces of their own for tests sharing one plane);
- ``lwscontroller``: the real LeaderWorkerSet controller (sigs.k8s.io/lws) and its webhooks;
- ``aggregation``: serving an API through the aggregation layer (the loopback Service, the
  APIServices, waiting until they are Available), for prometheus-adapter and KEDA;
- ``metricsadapter``: prometheus-adapter serving vLLM's metrics as ``custom.metrics.k8s.io``;
- ``keda``: KEDA's operator and metrics API server (``external.metrics.k8s.io``) built from its Go module;
- ``promoperator``: the Prometheus Operator and the Prometheus configuration it generates, run by a
  Prometheus built from its Go module;
- ``helmcli``: the Helm CLI (``helm install|upgrade|test|uninstall``);
- ``nodeagent``: the simulated nodes' kubelet (``NodeAgent``, ``RealNodes``), with ``ft_groups`` (a
  fault-tolerant LeaderWorkerSet group serving on its survivors; fault injection);
- ``probes``: the kubelet's liveness probes of the pods the node agent runs;
- ``realapi``: the harness's API client on the plane (``real_cluster``, ``RealCluster``).

Never imports :mod:`moe_eplb_harness.emulated` (.importlinter); what both use is in
:mod:`moe_eplb_harness.floor` (``client``, ``pods``, ``procs``, ``prometheus``).
"""
