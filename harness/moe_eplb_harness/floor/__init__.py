"""What both cluster backends (``emulated/``, ``real/``) stand on: ``client`` (the one apiserver
client, with the product's ``Connection``), ``pods`` (what the emulated kubelet and the real node
agent share: reading a pod spec, the poll loop), ``procs`` (child processes that never outlive the
program, ``free_port``, ``poll_ready``), ``prometheus`` (the one way to start a Prometheus server),
and the vendored CRDs (``lws_crd.yaml``, ``keda_scaledobject_crd.yaml``). Imports the product and
``engines/`` only."""
