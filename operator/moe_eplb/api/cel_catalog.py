"""CEL rules generated from the catalog, so the API server refuses at apply time what
:mod:`moe_eplb.api.validation` refuses with the catalog (EPLB support per architecture,
quantization and vLLM version; unknown models; divisibility with the catalog's expert count;
multimodal options on text models; unknown engine version).

The rules live in ``crd.yaml`` (the CRD stays the single source of truth) between the markers
``# BEGIN generated catalog rules`` and ``# END generated catalog rules``; a test checks that block
equals :func:`rules_yaml`. After changing the catalog, regenerate it with
``python -m moe_eplb.api.cel_catalog`` (rewrites ``crd.yaml`` in the source tree) and copy the CRD
to ``crds/`` with ``moe-eplb crd > crds/moeinferences.eplb.ai.yaml``.

Version comparisons are regexes over the version string (Kubernetes' CEL has no semver type in
every supported release): ``engine.version`` when set, else a tag that starts with ``v?X.Y.Z``
(the same reading as :attr:`moe_eplb.api.imageref.ImageRef.version`). Regexes use ``[.]`` for a
literal dot so that no CEL escape is needed, and are RE2 (no look-around).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from moe_eplb.api import catalog, elastic, wide_ep
from moe_eplb.api.versions import EPLB_FIRST, Version, format_version

BEGIN = "# BEGIN generated catalog rules"
END = "# END generated catalog rules"
_INDENT = " " * 16  # list items of spec.x-kubernetes-validations in crd.yaml


def _below(n: int) -> str | None:
    """Regex alternative matching the decimal integers 0 .. n-1 (no leading zeros)."""
    return "|".join(str(i) for i in range(n)) if n > 0 else None


def version_below_regex(v: Version) -> str:
    """Unanchored regex group matching ``X.Y.Z`` strictly below ``v`` (components compared numerically)."""
    a, b, c = v
    alts = []
    if _below(a):
        alts.append(f"({_below(a)})[.][0-9]+[.][0-9]+")
    if _below(b):
        alts.append(f"{a}[.]({_below(b)})[.][0-9]+")
    if _below(c):
        alts.append(f"{a}[.]{b}[.]({_below(c)})")
    return "(" + "|".join(alts) + ")"


def engine_version_below(v: Version) -> str:
    """CEL: the engine's version is known and below ``v``."""
    inner = version_below_regex(v)
    return (
        f"(has(self.engine.version) ? self.engine.version.matches('^v?{inner}([^0-9].*)?$') : "
        f"self.engine.image.matches(':v?{inner}([^0-9/:@][^/:@]*)?(@[^@]+)?$'))"
    )


ENGINE_VERSION_KNOWN = (
    "(has(self.engine.version) || "
    "self.engine.image.matches(':v?[0-9]+[.][0-9]+[.][0-9]+([^0-9/:@][^/:@]*)?(@[^@]+)?$'))"
)


def _name_regex(models: list[catalog.ModelInfo], which: str = "name_patterns") -> str:
    pats = sorted({p for m in models for p in getattr(m, which)})
    return "(?i)(^|/)[^/]*(" + "|".join(pats) + ")[^/]*/?$"


def name_is(models: list[catalog.ModelInfo]) -> str:
    """CEL: ``spec.model.name`` is one of ``models`` by catalog lookup (patterns minus excludes)."""
    inc = f"self.model.name.matches('{_name_regex(models)}')"
    excludes = [m for m in models if m.exclude_patterns]
    if not excludes:
        return inc
    parts = []
    for m in models:
        one = f"self.model.name.matches('{_name_regex([m])}')"
        if m.exclude_patterns:
            one = f"({one} && !self.model.name.matches('{_name_regex([m], 'exclude_patterns')}'))"
        parts.append(one)
    return "(" + " || ".join(parts) + ")"


def arch_is(names: list[str]) -> str:
    """CEL: the architecture (spec, else the catalog's for the model name) is one of ``names``."""
    models = [m for m in catalog.MODELS if m.architecture in names]
    listed = "[" + ", ".join(f"'{n}'" for n in names) + "]"
    by_name = name_is(models) if models else "false"
    return f"(has(self.model.architecture) ? self.model.architecture in {listed} : {by_name})"


MOE_OVERRIDE = "(has(self.model.moe) && has(self.model.moe.numExperts))"
EP_SIZE = "(self.parallelism.tensor * self.parallelism.data)"


def divisibility_message(experts: str) -> str:
    """CEL ``messageExpression`` naming the nearest valid numRedundantExperts (``experts`` is a CEL
    int expression).

    Built with the Kubernetes CEL strings library's ``format`` (``'%d'.format([...])``), not with
    ``'...' + string(n)``: a real kube-apiserver estimates the size of ``string(int)`` as unbounded,
    so every concatenation with it "exceeds budget by factor of more than 100x" and the CRD is
    refused at install (seen on kube-apiserver 1.36; tests/kube). ``format`` has a bounded estimate.
    """
    r, ep = "self.eplb.numRedundantExperts", EP_SIZE
    below = f"({r} - ({experts} + {r}) % {ep})"
    return ("'spec.eplb.numRedundantExperts: experts (%d) + numRedundantExperts (%d) is not divisible by the "
            "EP size %d (tensor x data); use numRedundantExperts %s'.format("
            f"[{experts}, {r}, {ep}, {below} >= 0 ? '%d or %d'.format([{below}, {below} + {ep}]) "
            f": '%d'.format([{below} + {ep}])])")


def rules() -> list[dict[str, Any]]:
    """The generated ``x-kubernetes-validations`` entries for ``spec`` (self = spec)."""
    out: list[dict[str, Any]] = []
    known_archs = "[" + ", ".join(f"'{a}'" for a in catalog.ARCHITECTURES) + "]"
    out.append({
        "rule": f"!self.eplb.enabled || {MOE_OVERRIDE} || (has(self.model.architecture) ? "
                f"self.model.architecture in {known_archs} : {name_is(list(catalog.MODELS))})",
        "fieldPath": ".model.moe",
        "message": "spec.model: the model is not in the catalog, so EPLB cannot be checked: set "
                   "spec.model.architecture (a catalog architecture) or spec.model.moe.numExperts "
                   "(with numMoeLayers, topK), or set spec.eplb.enabled: false",
    })
    out.append({
        "rule": f"!self.eplb.enabled || {ENGINE_VERSION_KNOWN}",
        "fieldPath": ".engine.version",
        "message": "spec.engine.version: the image tag does not start with the vLLM version (e.g. v0.12.0); "
                   "set spec.engine.version to the vLLM version in the image",
    })
    out.append({
        "rule": f"!self.eplb.enabled || !{engine_version_below(EPLB_FIRST)}",
        "fieldPath": ".eplb.enabled",
        "message": f"spec.eplb.enabled: EPLB needs vLLM >= {format_version(EPLB_FIRST)}: use a newer image "
                   "(spec.engine.image) or set spec.eplb.enabled: false",
    })
    by_since: dict[Version | None, list[str]] = {}
    for arch in catalog.ARCHITECTURES.values():
        by_since.setdefault(arch.eplb_since, []).append(arch.name)
    for since, names in sorted(by_since.items(), key=lambda kv: (kv[0] is None, kv[0] or (0, 0, 0))):
        if since is not None and since <= EPLB_FIRST:
            continue  # covered by the rule above
        if since is None:
            rule = f"!self.eplb.enabled || !{arch_is(names)}"
            msg = f"spec.eplb.enabled: vLLM has no EPLB for {', '.join(names)}; set spec.eplb.enabled: false"
        else:
            rule = f"!self.eplb.enabled || !{arch_is(names)} || !{engine_version_below(since)}"
            msg = (f"spec.eplb.enabled: EPLB for {', '.join(names)} needs vLLM >= {format_version(since)}: use a "
                   "newer image (spec.engine.image) or set spec.eplb.enabled: false")
        out.append({"rule": rule, "fieldPath": ".eplb.enabled", "message": msg})
    q_since: dict[Version | None, list[str]] = {}
    for q in catalog.QUANTIZATIONS.values():
        q_since.setdefault(q.eplb_since, []).append(q.name)
    for since, names in sorted(q_since.items(), key=lambda kv: (kv[0] is None, kv[0] or (0, 0, 0))):
        if since is not None and since <= EPLB_FIRST:
            continue
        listed = "[" + ", ".join(f"'{n}'" for n in names) + "]"
        is_q = f"(has(self.model.quantization) && self.model.quantization in {listed})"
        if since is None:
            rule = f"!self.eplb.enabled || !{is_q}"
            msg = (f"spec.model.quantization: vLLM has no EPLB for MoE weights in {', '.join(names)}; use another "
                   "checkpoint format (llm-compressor AWQ/GPTQ checkpoints are compressed-tensors-wna16) or set "
                   "spec.eplb.enabled: false")
        else:
            rule = f"!self.eplb.enabled || !{is_q} || !{engine_version_below(since)}"
            msg = (f"spec.model.quantization: EPLB with {', '.join(names)} MoE weights needs vLLM >= "
                   f"{format_version(since)}: use a newer image (spec.engine.image) or set spec.eplb.enabled: false")
        out.append({"rule": rule, "fieldPath": ".model.quantization", "message": msg})
    by_experts: dict[int, list[catalog.ModelInfo]] = {}
    for m in catalog.MODELS:
        by_experts.setdefault(m.num_experts, []).append(m)
    for experts, models in sorted(by_experts.items(), reverse=True):
        out.append({
            "rule": f"!self.eplb.enabled || !has(self.eplb.numRedundantExperts) || {MOE_OVERRIDE} || "
                    f"!{name_is(models)} || ({experts} + self.eplb.numRedundantExperts) % {EP_SIZE} == 0",
            "fieldPath": ".eplb.numRedundantExperts",
            "message": f"spec.eplb.numRedundantExperts: this model has {experts} experts; ({experts} + "
                       "numRedundantExperts) must be divisible by the EP size (tensor x data)",
            "messageExpression": divisibility_message(str(experts)),
        })
    out += redundancy_rules(by_experts)
    out += wide_ep_rules()
    text_archs = [a.name for a in catalog.ARCHITECTURES.values() if not a.multimodal]
    for fld in ("limitMmPerPrompt", "mmEncoderTpMode"):
        out.append({
            "rule": f"!has(self.engine.{fld}) || !{arch_is(text_archs)}",
            "fieldPath": f".engine.{fld}",
            "message": f"spec.engine.{fld}: the model's architecture is not multimodal (vLLM rejects multimodal "
                       "options for it); remove the field",
        })
    return out


FT_K = "self.faultTolerance.rankFailuresToSurvive"
FT_ON = f"(has(self.faultTolerance) && self.faultTolerance.enabled && {FT_K} > 0 && {FT_K} < self.parallelism.data)"
BACKEND = "self.parallelism.all2allBackend"


def ft_floor_expr(experts: str) -> str:
    """CEL int: the smallest valid R with ``R x (data - k) >= k x experts`` (the fault-tolerance
    floor, :func:`moe_eplb.api.wide_ep.fault_tolerance_floor`); only evaluated when k < data."""
    k, dp = FT_K, "self.parallelism.data"
    f = f"(({k} * {experts} + {dp} - {k} - 1) / ({dp} - {k}))"
    return f"({f} + ({EP_SIZE} - ({experts} + {f}) % {EP_SIZE}) % {EP_SIZE})"


def ft_floor_message(experts: str) -> str:
    r, floor = "self.eplb.numRedundantExperts", ft_floor_expr(experts)
    return ("'spec.eplb.numRedundantExperts: %d is below the fault-tolerance floor %d for surviving %d lost "
            "data-parallel rank(s) (R >= k x (experts + R) / data, experts %d, data %d); set numRedundantExperts "
            "to at least %d, or lower spec.faultTolerance.rankFailuresToSurvive'.format("
            f"[{r}, {floor}, {FT_K}, {experts}, self.parallelism.data, {floor}])")


def omitted_message(experts: str) -> str:
    below = wide_ep.REDUNDANCY_AUTO_MIN_SINCE
    return (f"'spec.eplb.numRedundantExperts: omitted, and vLLM before {format_version(below)} then runs 0 "
            "redundant experts, but the EP size %d does not divide the experts (%d) (vLLM refuses to start): "
            f"set numRedundantExperts %d (or use vLLM >= {format_version(below)}, which picks it)'.format("
            f"[{EP_SIZE}, {experts}, ({EP_SIZE} - {experts} % {EP_SIZE}) % {EP_SIZE}])")


def redundancy_rules(by_experts: dict[int, list[catalog.ModelInfo]]) -> list[dict[str, Any]]:
    """Per expert count (catalog models, and ``spec.model.moe.numExperts``): an omitted
    numRedundantExperts on vLLM < 0.34 where the experts do not divide (vLLM runs 0 and refuses to
    start), and an explicit one below the fault-tolerance floor."""
    old = engine_version_below(wide_ep.REDUNDANCY_AUTO_MIN_SINCE)
    out: list[dict[str, Any]] = []
    groups = [(str(e), f"!{MOE_OVERRIDE} && {name_is(ms)}") for e, ms in sorted(by_experts.items(), reverse=True)]
    groups.append(("self.model.moe.numExperts", MOE_OVERRIDE))
    for experts, which in groups:
        out.append({
            "rule": f"!self.eplb.enabled || has(self.eplb.numRedundantExperts) || !({which}) || !{old} || "
                    f"{experts} % {EP_SIZE} == 0",
            "fieldPath": ".eplb.numRedundantExperts",
            "message": f"spec.eplb.numRedundantExperts: omitted, and vLLM before "
                       f"{format_version(wide_ep.REDUNDANCY_AUTO_MIN_SINCE)} then runs 0 redundant experts, which "
                       "the experts do not divide over the EP size: set numRedundantExperts",
            "messageExpression": omitted_message(experts),
        })
        if experts != "self.model.moe.numExperts":  # the hand-written rule covers the override
            out.append({
                "rule": f"!{FT_ON} || !has(self.eplb.numRedundantExperts) || !({which}) || "
                        f"self.eplb.numRedundantExperts * (self.parallelism.data - {FT_K}) >= {FT_K} * {experts}",
                "fieldPath": ".eplb.numRedundantExperts",
                "message": "spec.eplb.numRedundantExperts is below the fault-tolerance floor: surviving k lost "
                           "data-parallel ranks needs R >= k x (experts + R) / data; raise numRedundantExperts or "
                           "lower spec.faultTolerance.rankFailuresToSurvive",
                "messageExpression": ft_floor_message(experts),
            })
    return out


def wide_ep_rules() -> list[dict[str, Any]]:
    """vLLM versions of the all2all backends, the EPLB communicator and fault tolerance."""
    out: list[dict[str, Any]] = []
    by_since: dict[Version, list[str]] = {}
    for name, since in wide_ep.ALL2ALL_SINCE.items():
        by_since.setdefault(since, []).append(name)
    for since, names in sorted(by_since.items()):
        listed = "[" + ", ".join(f"'{n}'" for n in names) + "]"
        out.append({
            "rule": f"!has({BACKEND}) || !({BACKEND} in {listed}) || !{engine_version_below(since)}",
            "fieldPath": ".parallelism.all2allBackend",
            "message": f"spec.parallelism.all2allBackend: {', '.join(names)} needs vLLM >= {format_version(since)} "
                       "(the oldest release whose --all2all-backend choices the operator checked): use a newer "
                       "image or leave the field out",
        })
    for vendor, names, domain, other in (("NVIDIA", wide_ep.NVIDIA_ONLY, "amd.com", "AMD (amd.com/gpu)"),
                                         ("AMD", wide_ep.AMD_ONLY, "nvidia.com", "NVIDIA (nvidia.com/gpu)")):
        listed = "[" + ", ".join(f"'{n}'" for n in names) + "]"
        theirs = "deepep_low_latency, nixl_ep" if vendor == "AMD" else "mori"
        out.append({
            "rule": f"!has({BACKEND}) || !({BACKEND} in {listed}) || "
                    f"!self.engine.gpuResourceName.startsWith('{domain}/')",
            "fieldPath": ".parallelism.all2allBackend",
            "message": f"spec.parallelism.all2allBackend: {', '.join(names)} run on {vendor} GPUs only, and "
                       f"spec.engine.gpuResourceName asks for {other} ones: use allgather_reducescatter (any "
                       f"vendor) or one of that vendor's backends ({theirs}), or "
                       f"change spec.engine.gpuResourceName",
        })
    comm_since = wide_ep.COMMUNICATOR_SINCE[wide_ep.SYMM_MEM]
    out.append({
        "rule": f"!has(self.eplb.communicator) || self.eplb.communicator != '{wide_ep.SYMM_MEM}' || "
                f"!{engine_version_below(comm_since)}",
        "fieldPath": ".eplb.communicator",
        "message": f"spec.eplb.communicator: symm_mem needs vLLM >= {format_version(comm_since)}: use a newer image "
                   "or another communicator",
    })
    out.append({
        "rule": f"!has(self.faultTolerance) || !self.faultTolerance.enabled || "
                f"!{engine_version_below(wide_ep.FAULT_TOLERANCE_SINCE)}",
        "fieldPath": ".faultTolerance.enabled",
        "message": f"spec.faultTolerance.enabled: --enable-fault-tolerance needs vLLM >= "
                   f"{format_version(wide_ep.FAULT_TOLERANCE_SINCE)} (the oldest release the operator checked): use "
                   "a newer image or set spec.faultTolerance.enabled: false",
    })
    out.append({
        "rule": f"!has(self.faultTolerance) || {FT_K} == 0 || !{engine_version_below(wide_ep.FT_SCALE_DOWN_SINCE)}",
        "fieldPath": ".faultTolerance.rankFailuresToSurvive",
        "message": f"spec.faultTolerance.rankFailuresToSurvive: re-hosting a lost rank's experts (scale_down) needs "
                   f"vLLM >= {format_version(wide_ep.FT_SCALE_DOWN_SINCE)} (older versions only retry): use a newer "
                   "image or set it to 0",
    })
    out.append({
        "rule": f"!has(self.parallelism.elastic) || !self.parallelism.elastic.enabled || "
                f"!{engine_version_below(elastic.ELASTIC_EXTERNAL_SINCE)}",
        "fieldPath": ".parallelism.elastic.enabled",
        "message": f"spec.parallelism.elastic.enabled: resizing a running group from outside (external elastic EP, "
                   f"one API server per rank) needs vLLM >= {format_version(elastic.ELASTIC_EXTERNAL_SINCE)}: use a "
                   "newer image or set spec.parallelism.elastic.enabled: false",
    })
    return out


def rules_yaml() -> str:
    """The block of ``crd.yaml`` between the markers (each line indented as a list item of
    ``spec.x-kubernetes-validations``)."""
    body = yaml.safe_dump(rules(), sort_keys=False, width=100000, allow_unicode=True)
    return "".join(_INDENT + line + "\n" for line in body.splitlines())


def crd_block(text: str) -> str:
    """The generated block currently in ``text`` (a crd.yaml)."""
    start = text.index(BEGIN)
    start = text.index("\n", start) + 1
    end = text.rindex("\n", 0, text.index(END)) + 1
    return text[start:end]


def regenerate(path: Path) -> bool:
    """Rewrite the generated block of the crd.yaml at ``path``; True when it changed."""
    text = path.read_text(encoding="utf-8")
    old = crd_block(text)
    new = rules_yaml()
    if old == new:
        return False
    path.write_text(text.replace(BEGIN + "\n" + old, BEGIN + "\n" + new, 1), encoding="utf-8")
    return True


if __name__ == "__main__":  # python -m moe_eplb.api.cel_catalog
    target = Path(__file__).with_name("crd.yaml")
    print(("updated " if regenerate(target) else "unchanged ") + str(target))
