"""moe-eplb: run Mixture-of-Experts models on vLLM with EPLB on Kubernetes, and tune EPLB.

Layers (docs/architecture.md; ``tests/test_layering.py`` checks every import, in-function ones too):

* ``contracts`` -- the package :mod:`.contracts`: names, facts and file formats several packages
  share (its folder is the one list of contract modules: the layering test and the exporter's
  injector read it); its modules import no project package but each other.
* packages, each importing only the ones named (and the contracts):
  ``api`` nothing; ``render`` api; ``eplb`` api; ``metrics`` api, eplb;
  ``controller`` api, render, eplb, metrics; ``exporter`` nothing (it runs inside vLLM pods);
  ``sim`` and ``cli`` anything.
"""

__version__ = "0.1.0"
