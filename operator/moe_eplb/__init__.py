"""moe-eplb: run Mixture-of-Experts models on vLLM with EPLB on Kubernetes, and tune EPLB.

Packages follow the data flow (each only imports the ones before it):
``api`` (spec, catalog, validation) -> ``render`` (manifests) ;
``eplb`` (policy, trace, simulator, tuner) ; ``exporter`` (vLLM plugin) ->
``metrics`` (load reader) -> ``controller`` (kopf handlers, rollout) ; ``cli``.
"""

__version__ = "0.1.0"

API_GROUP = "eplb.ai"
API_VERSION = "v1alpha1"
KIND = "MoEInference"
PLURAL = "moeinferences"
