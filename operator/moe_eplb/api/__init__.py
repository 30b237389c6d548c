"""The MoEInference API: the CRD and the typed values every other package reads.

- ``crd.yaml`` (the CRD's single source) and ``crd`` (it, loaded); ``schema`` (the apiserver's
  handling of an object against its structural schema) and ``cel_rules`` (its CEL rules, evaluated
  as the apiserver does); ``cel_catalog`` (the CEL rules generated from the catalog); ``cel_fixes``
  (the one-edit fixes of the CEL refusals);
- ``spec`` (the typed model of a resource, parsed once: spec, effective EPLB settings),
  ``autotune_status`` (``status.autotune`` as typed records), ``recovery_status``
  (``status.faultTolerance`` as typed records), ``knobs`` (the one ``Knobs``/``Bounds``
  type), ``convert`` (camelCase objects <-> typed values), ``podtemplate`` (``spec.engine.podTemplate``:
  the typed overlay, the CEL rules for what the operator owns, the checks only ``validate`` makes);
- ``catalog`` (MoE models and vLLM's EPLB support), ``versions`` (vLLM versions and thresholds),
  ``wide_ep`` (all2all backends, the EPLB communicator, fault tolerance and the redundancy each needs),
  ``ft_protocol`` (vLLM's fault-tolerance routes, bodies, states and timeouts per release),
  ``vllm_cli`` (each release's all2all backends, EPLB config keys and communicators, generated from the
  releases' code), ``layout`` (how a replica group launches: each pod's ranks and API servers, the LB
  mode), ``memory`` (the per-GPU memory estimate, the GPU's memory), ``fit`` (the layout against the
  GPU, and the fault-tolerant layouts that fit), ``elastic`` (elastic groups: vLLM's resize facts, the
  redundancy after a resize, ``status.elastic``), ``imageref`` (image references), ``quantity``
  (Kubernetes quantities);
- ``validation`` (the one ``validate`` for the CLI, the operator and the tests: schema + CEL +
  catalog), ``advice`` (warnings a valid resource earns: the shared-expert overlap EPLB turns off),
  ``problem`` (one problem, naming the field and the fix), ``manifest`` (bounded reading of the
  manifests handed to the CLI).

Pure: no network, no cluster. Imports only the contracts.
"""
