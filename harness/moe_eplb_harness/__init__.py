"""The harness: the simulated cluster, the simulated engines, the demo and the real-engine rig, for
``moe-eplb demo``, the tests and the benchmarks. A distribution of its own (``moe-eplb-harness``,
``harness/pyproject.toml``), installed beside the product by ``make setup``; the product
(``moe_eplb``) never imports it, and its image does not hold it. Nothing here talks to a real
cluster or a GPU.

Its folders, each importing only the ones listed before it (``.importlinter`` checks it):

- ``engines/``: the simulated engines: ``engine`` (a vLLM engine pod's stand-in), ``physics`` (a
  deployment's true costs), ``recording`` (a trace one simulated engine served);
- ``floor/``: what both cluster backends stand on: ``client`` (the one apiserver client, with the
  product's ``Connection``), ``pods`` (reading a pod spec into engine settings, the poll loop),
  ``procs`` (child processes that never outlive the program, ``free_port``, ``poll_ready``),
  ``prometheus`` (the one way to start a Prometheus server), and the vendored CRDs the emulation
  serves and the real plane falls back to (``lws_crd.yaml``, ``keda_scaledobject_crd.yaml``);
- ``emulated/``: the kmock-based Kubernetes API and its emulated controllers (kubelet, Deployment,
  LeaderWorkerSet, HPA). Frozen: kept for the demo without a Go build and for fault injection;
- ``real/``: the real control plane, LeaderWorkerSet controller and prometheus-adapter, KEDA, the
  Prometheus Operator and the Helm CLI built from Go modules, run on loopback, with simulated GPU
  nodes. ``emulated/`` and ``real/`` never import each other;
- ``cluster/``: ``backend`` (``ClusterBackend``: which of the two a world runs on, chosen once; the
  one module that imports both) and ``world`` (a whole simulated cluster in one event loop:
  ``SimWorld``);
- ``demo/``: ``moe-eplb demo`` (``tuning``, ``autoscale``; ``command``: the click command the
  product's CLI finds through the entry point group ``moe_eplb.commands``);
- ``vllm_engine/``: the REAL vLLM engine on CPU with the test bridge (the real-engine tests,
  ``make e2e-vllm``, ``make demo-vllm-cpu``, ``bench/bench_exporter_real.py``).
"""
