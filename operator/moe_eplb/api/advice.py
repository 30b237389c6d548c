"""Advice at admission: what a valid resource may cost without being wrong (warnings, never refusals).

:func:`advice` returns :class:`~moe_eplb.api.problem.Problem` records that ``moe-eplb validate`` and
``moe-eplb render`` print as ``warning:`` lines on stderr without changing the exit status, and that the
reconciler reports once per generation as a Warning Event ``Advice``.

* **EPLB and the shared-expert overlap.** vLLM runs a model's shared experts overlapped with the routed
  experts' dispatch and combine, and turns that overlap off with EPLB on every all2all backend but the
  few it knows to be safe (:func:`moe_eplb.api.wide_ep.eplb_drops_shared_overlap`, read from each
  release's ``SharedExperts._disable_shared_experts_overlap``). For a catalog model with shared experts
  (DeepSeek-V2/V3, GLM-4.5, Llama 4) on such a backend, every step pays the shared experts' compute
  that the overlap used to hide, whether EPLB's balancing pays it back or not: the warning names the
  field that sets the backend and the overlap-safe backends this vLLM version offers on these GPUs
  (``spec.engine.gpuResourceName``: NVIDIA or AMD). Silent for models without shared experts (Qwen3-MoE,
  Qwen3-VL-MoE, Mixtral), for models outside the catalog (unknown), with EPLB off, and on backends that
  keep the overlap or lose it whatever EPLB does.
"""

from __future__ import annotations

from moe_eplb.api import wide_ep
from moe_eplb.api.problem import Problem
from moe_eplb.api.spec import MoEInference
from moe_eplb.api.versions import format_version

__all__ = ["advice", "overlap_advice", "BACKEND_FIELD"]

BACKEND_FIELD = "spec.parallelism.all2allBackend"


def advice(inf: MoEInference) -> list[Problem]:
    """Every warning for a valid, parsed resource (module docstring)."""
    return overlap_advice(inf)


def overlap_advice(inf: MoEInference) -> list[Problem]:
    """The shared-expert overlap EPLB turns off on this backend, for a model with shared experts."""
    from moe_eplb.api.validation import all2all_backend

    entry = inf.catalog_model
    if not inf.eplb.enabled or entry is None or not entry.shared_experts:
        return []
    found = all2all_backend(inf)
    backend, fld = found if found is not None else (None, BACKEND_FIELD)
    version, par = inf.engine.version, inf.parallelism
    if not wide_ep.eplb_drops_shared_overlap(backend, version, data_parallel=int(par.data or 1)):
        return []
    vendor = wide_ep.gpu_vendor(inf.engine.gpu_resource_name)
    alts = wide_ep.overlap_safe_backends(version, vendor, nodes=int(par.nodes or 1))
    ft = inf.fault_tolerance.enabled
    if ft:  # fault tolerance needs a backend that can mask a lost rank; none of them keeps the overlap
        alts = [(b, c) for b, c in alts if b in wide_ep.FT_ALL2ALL_BACKENDS]
    names = "; ".join(b + (f" ({cond})" if cond else "") for b, cond in alts)
    gpus = {"nvidia": "NVIDIA", "amd": "AMD"}.get(vendor or "", "any GPU")
    ver = f"vLLM {format_version(version)}" if version is not None else "vLLM"
    where = "" if fld == BACKEND_FIELD else f" (set {BACKEND_FIELD}, not the argument)"
    fix = (f"Backends that keep it ({ver}, {gpus}): {names}{where}" if names else
           f"fault tolerance needs {' or '.join(wide_ep.FT_ALL2ALL_BACKENDS)}, which both drop it" if ft else
           f"no backend keeps it ({ver}, {gpus})")
    return [Problem(fld, (
        f"EPLB on {backend or wide_ep.ALL2ALL_DEFAULT} turns off the shared-expert overlap: every step pays "
        f"{inf.model.name}'s {entry.shared_experts} shared expert(s) ({entry.shared_expert_ratio:.1%} of the "
        f"routed compute), repaid only by balancing. {fix}. Or let the tuner price it "
        "(spec.autotune.allowDisable)"))]
