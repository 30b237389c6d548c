"""The simulated cluster and the real parts run locally: for ``moe-eplb demo``, the tests and the
benchmarks. Nothing here talks to a real cluster or a GPU.

- simulated (not Kubernetes, not vLLM): ``kubeapi`` (an emulated Kubernetes API over real HTTP),
  ``kubelet`` (kubelet, Deployment and LeaderWorkerSet controllers; ``lws``: the LeaderWorkerSet
  decisions), ``engine`` (a vLLM engine pod's stand-in), ``physics`` (a deployment's true costs),
  ``recording`` (a trace one simulated engine served), ``hpa`` (an HPA controller where the real one
  cannot read vLLM's metrics), ``nodeagent`` (GPU nodes for the real control plane), ``probes``
  (the kubelet's liveness probes of the pods the node agent runs);
- real parts on loopback: ``controlplane`` (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler built by ``make kube``), ``simplane`` (that plane as a simulated cluster runs on
  it), ``lwscontroller`` (the real LeaderWorkerSet controller), ``metricsadapter``
  (prometheus-adapter), ``promoperator`` (the Prometheus Operator and the configuration it
  generates), ``helmcli`` (the Helm CLI), ``prometheus`` (the one way to start a Prometheus server), ``realapi`` (the
  async client on the real plane), ``procs`` (child processes that never outlive the program, and
  ``free_port``);
- ``world`` (a whole simulated cluster in one event loop: ``SimWorld``), ``demo`` and
  ``demo_autoscale`` (``moe-eplb demo``).

May import every other package.
"""
