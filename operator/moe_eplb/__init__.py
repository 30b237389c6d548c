"""moe-eplb: run Mixture-of-Experts models on vLLM with EPLB on Kubernetes, and tune EPLB.

Layers (docs/architecture.md; the import-linter contracts in ``.importlinter``, run by ``make lint``,
check every import, in-function ones too):

* ``contracts`` -- the package of names, facts and formats several packages share, importing no
  other project package: :mod:`.contracts.k8s_names` (API group, kinds, labels, annotations,
  ports), :mod:`.contracts.metric_names` (every exported series and label),
  :mod:`.contracts.vllm_facts` (vLLM's EPLB limits, defaults, rearrangement schedule,
  balancedness), :mod:`.contracts.trace_format` (the trace file format) and
  :mod:`.contracts.bounded_read` (bounded readers of untrusted files).
* packages, each importing only the ones named (and the contracts):
  ``api`` nothing; ``render`` api; ``eplb`` api (inside it: ``workload`` <- ``replay`` <- ``tuning``);
  ``metrics`` api, eplb; ``controller`` api, render, eplb, metrics; ``exporter`` nothing (it runs
  inside vLLM pods); ``cli`` anything of the product.

The simulated cluster, the demo and the test rigs are the harness, a distribution of its own
(``harness/``, ``moe_eplb_harness``) that this package never imports; ``moe-eplb demo`` is its
command, found through the entry point group ``moe_eplb.commands``.
"""

__version__ = "0.1.0"
