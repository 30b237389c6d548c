"""Does the layout fit the GPU, and which fault-tolerant layouts would (pure; validation's part that
needs the memory estimate of :mod:`moe_eplb.api.memory`).

* :func:`memory_problems`: a layout whose estimated memory per GPU exceeds what vLLM may use of the
  GPU (known from ``spec.engine.gpuMemory`` or the node selector's GPU product label) is refused,
  with a fix that fits: fewer redundant experts, a shorter ``maxModelLen``, or more GPUs.
* :func:`fault_tolerant_layouts`: for ``spec.faultTolerance.rankFailuresToSurvive`` k, each
  ``dataLocal`` d the group could use (ranks are lost a pod at a time, so k rounds up to whole pods
  of d ranks) with the redundancy floor it needs and its memory per GPU; the fault-tolerance
  refusals name them, and their fix is the one with the most ranks a pod that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moe_eplb.api import memory, wide_ep
from moe_eplb.api.problem import REMOVE, Problem
from moe_eplb.api.spec import MoEInference, MoeOverride
from moe_eplb.contracts import vllm_facts

GIB = memory.GIB


def arg_value(args: tuple[str, ...], flag: str) -> tuple[int, str] | None:
    """(index, value) of ``flag`` in ``args`` (``--flag v`` or ``--flag=v``), or None."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return i, arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return i, args[i + 1]
    return None


def all2all_backend(inf: MoEInference) -> tuple[str, str] | None:
    """(backend, the field that sets it): ``spec.parallelism.all2allBackend``, else an
    ``--all2all-backend`` in extraArgs; None when vLLM's default runs."""
    if inf.parallelism.all2all_backend:
        return inf.parallelism.all2all_backend, "spec.parallelism.all2allBackend"
    found = arg_value(inf.engine.extra_args, "--all2all-backend")
    return (found[1], f"spec.engine.extraArgs[{found[0]}]") if found else None


def tokens_per_rank(inf: MoEInference) -> int:
    """The tokens per data-parallel rank DeepEP low latency is sized for: ``--max-num-batched-tokens``
    from extraArgs, else vLLM's default with DeepEP low latency and data parallel (256)."""
    found = arg_value(inf.engine.extra_args, "--max-num-batched-tokens")
    if found and found[1].isdigit():
        return int(found[1])
    return wide_ep.BATCHED_DP_DEFAULT_TOKENS


def gpu(inf: MoEInference) -> memory.GpuMemory | None:
    return memory.gpu_memory(inf.engine.gpu_memory_bytes, dict(inf.engine.node_selector))


def estimate(inf: MoEInference, *, redundant: int | None = None, data_local: int | None = None,
             max_model_len: int | None = None, data: int | None = None) -> memory.Estimate | None:
    """The per-GPU estimate of ``inf`` (or of it with another redundancy, ranks a pod, context or
    data size); None for a model outside the catalog (or with its shape overridden). Without the
    GPU's memory, ``usable`` is 0."""
    model = inf.catalog_model
    if model is None or inf.model.moe != MoeOverride():
        return None
    p, g = inf.parallelism, gpu(inf)
    data = data or p.data
    local = data_local or p.data_local
    found = all2all_backend(inf)
    r = redundant if redundant is not None else (inf.eplb.num_redundant_experts if inf.eplb.enabled else 0)
    return memory.estimate(model, quantization=inf.quantization, tensor=p.tensor, data=data,
                           nodes=max(1, data // local), redundant=r, backend=found[0] if found else None,
                           tokens_per_rank=tokens_per_rank(inf), max_model_len=max_model_len or inf.engine.max_model_len,
                           gpu_bytes=g.nbytes if g else 0, utilization=inf.engine.gpu_memory_utilization)


@dataclass(frozen=True)
class FtLayout:
    """A ``dataLocal`` for surviving k lost ranks: the ranks a lost pod takes (k rounded up to whole
    pods), the redundancy floor that survives them, and the memory estimate at that floor."""

    data_local: int
    ranks_lost: int
    floor: int | None
    estimate: memory.Estimate | None

    @property
    def fits(self) -> bool | None:
        """True/False when the GPU's memory is known, else None."""
        if self.floor is None:
            return False
        if self.estimate is None or not self.estimate.usable:
            return None
        return self.estimate.fits

    def describe(self) -> str:
        if self.floor is None:
            return f"{self.data_local}: none survives"
        text = f"{self.data_local}: R {self.floor}"
        if self.estimate is not None:
            text += f", {self.estimate.total / GIB:.0f} GiB"
            text += {True: "", False: " (too much)", None: ""}[self.fits]
        return text


def fault_tolerant_layouts(inf: MoEInference) -> list[FtLayout]:
    """Every ``dataLocal`` up to the spec's (a divisor of ``data``, one pod left at least) that can
    survive ``rankFailuresToSurvive`` lost ranks, most ranks a pod first."""
    k, p, experts = inf.ranks_to_survive, inf.parallelism, inf.moe_shape.num_experts
    if not k or not experts:
        return []
    out = []
    for d in sorted((d for d in range(1, p.data_local + 1) if p.data % d == 0), reverse=True):
        lost = math.ceil(k / d) * d
        if lost >= p.data:
            continue
        floor = wide_ep.fault_tolerance_floor(experts, p.tensor, p.data, lost)
        est = estimate(inf, redundant=floor, data_local=d) if floor is not None else None
        out.append(FtLayout(d, lost, floor, est))
    return out


def layout_fix(inf: MoEInference, lay: FtLayout) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """The edits that move ``inf`` to ``lay``: its ranks a pod and pods, the ranks to survive in whole
    pods, and the redundancy floor (written where the spec sets it, else left for the operator to render)."""
    p = inf.parallelism
    fix: list[tuple[tuple[Any, ...], Any]] = [
        (("spec", "parallelism", "dataLocal"), lay.data_local), (("spec", "parallelism", "nodes"), p.data // lay.data_local),
        (("spec", "faultTolerance", "rankFailuresToSurvive"), lay.ranks_lost)]
    if inf.spec.eplb is not None and inf.spec.eplb.num_redundant_experts is not None:
        fix.append((("spec", "eplb", "numRedundantExperts"), lay.floor))
    return tuple(fix)


def best_layout(layouts: list[FtLayout]) -> FtLayout | None:
    """The layout a fix moves to: the one with the most ranks a pod that fits the GPU; with its memory
    unknown, the one with the smallest redundancy floor (the least memory per GPU)."""
    known = [lay for lay in layouts if lay.fits is not None]
    if known:
        return next((lay for lay in known if lay.fits), None)
    usable = [lay for lay in layouts if lay.floor is not None]
    return min(usable, key=lambda lay: (lay.floor, -lay.data_local)) if usable else None


def layouts_text(inf: MoEInference, layouts: list[FtLayout]) -> str:
    """Each layout's floor and per-GPU estimate, and the one to use (the fix)."""
    g, best = gpu(inf), best_layout(layouts)
    usable = f" of {layouts[0].estimate.usable / GIB:.0f} GiB usable" if g and layouts and layouts[0].estimate else ""
    shown: dict[int | None, FtLayout] = {}
    for lay in layouts:  # most ranks a pod first: one layout per floor
        shown.setdefault(lay.floor, lay)
    text = (f"per dataLocal, the redundancy that survives {inf.ranks_to_survive} lost rank(s) and the memory per "
            f"GPU{usable}: " + "; ".join(lay.describe() for lay in shown.values()))
    if best is not None:
        text += f"; use dataLocal {best.data_local} (nodes {inf.parallelism.data // best.data_local})"
    elif g is not None:
        text += f"; none fits: use more GPUs (data {inf.parallelism.data * 2})"
    return text


def memory_problems(inf: MoEInference) -> list[Problem]:
    """The layout against the GPU's memory (see the module doc); [] when it fits or either is unknown."""
    est = estimate(inf)
    if est is None or not est.usable or est.fits:
        return []
    said = f"{est.describe()} ({gpu(inf).source})"  # type: ignore[union-attr]
    if inf.ranks_to_survive:
        layouts = fault_tolerant_layouts(inf)
        best = best_layout(layouts)
        fix = layout_fix(inf, best) if best is not None and best.data_local != inf.parallelism.data_local else \
            _more_gpus(inf) if best is None else None
        return [Problem("spec.eplb.numRedundantExperts", f"{inf.eplb.num_redundant_experts} redundant experts (the "
                        f"fault-tolerance floor) need {said}; {layouts_text(inf, layouts)}", fix=fix)]
    return [_redundancy_or_context_fix(inf, est, said)]


def _more_gpus(inf: MoEInference) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """Twice the data-parallel ranks over twice the pods (the same ranks a pod); an explicit
    redundancy is left to the operator, which renders the new layout's minimum (or floor)."""
    p = inf.parallelism
    fix: list[tuple[tuple[Any, ...], Any]] = [(("spec", "parallelism", "data"), p.data * 2),
                                               (("spec", "parallelism", "nodes"), p.nodes * 2)]
    if inf.spec.eplb is not None and inf.spec.eplb.num_redundant_experts is not None:
        fix.append((("spec", "eplb", "numRedundantExperts"), REMOVE))
    return tuple(fix)


def _redundancy_or_context_fix(inf: MoEInference, est: memory.Estimate, said: str) -> Problem:
    """The memory refusal of a layout without fault tolerance, with the smallest change that fits:
    the most redundant experts that fit, else the longest context that fits, else twice the GPUs."""
    shape, ep = inf.moe_shape, inf.parallelism.ep_size
    if inf.eplb.enabled and shape.num_experts:
        r = wide_ep.smallest_valid_redundancy(shape.num_experts, ep)
        fitting = None
        while r <= min(inf.eplb.num_redundant_experts, vllm_facts.MAX_REDUNDANT_EXPERTS):
            e = estimate(inf, redundant=r)
            if e is None or not e.fits:
                break
            fitting, r = r, r + ep
        if fitting is not None and fitting < inf.eplb.num_redundant_experts:
            return Problem("spec.eplb.numRedundantExperts", f"{inf.eplb.num_redundant_experts} redundant experts need "
                           f"{said}; use numRedundantExperts {fitting} or less",
                           fix=((("spec", "eplb", "numRedundantExperts"), fitting),))
    rest = est.total - est.kv
    per_token = est.kv / max(1, inf.engine.max_model_len or inf.catalog_model.context_length)  # type: ignore[union-attr]
    if rest < est.usable and per_token > 0:
        tokens = int((est.usable - rest) / per_token) // 1024 * 1024
        if tokens >= 1024:
            return Problem("spec.engine.maxModelLen", f"a request of the full context needs {said}; set "
                           f"spec.engine.maxModelLen {tokens} or less (or use GPUs with more memory)",
                           fix=((("spec", "engine", "maxModelLen"), tokens),))
    p = inf.parallelism
    return Problem("spec.parallelism.data", f"the model does not fit: {said}; spread it over more GPUs (data "
                   f"{p.data * 2} over {p.nodes * 2} pod(s)) or use GPUs with more memory", fix=_more_gpus(inf))
