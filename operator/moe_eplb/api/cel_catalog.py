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

from moe_eplb.api import catalog
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
            "rule": f"!self.eplb.enabled || {MOE_OVERRIDE} || !{name_is(models)} || "
                    f"({experts} + self.eplb.numRedundantExperts) % {EP_SIZE} == 0",
            "fieldPath": ".eplb.numRedundantExperts",
            "message": f"spec.eplb.numRedundantExperts: this model has {experts} experts; ({experts} + "
                       "numRedundantExperts) must be divisible by the EP size (tensor x data)",
            "messageExpression": divisibility_message(str(experts)),
        })
    text_archs = [a.name for a in catalog.ARCHITECTURES.values() if not a.multimodal]
    for fld in ("limitMmPerPrompt", "mmEncoderTpMode"):
        out.append({
            "rule": f"!has(self.engine.{fld}) || !{arch_is(text_archs)}",
            "fieldPath": f".engine.{fld}",
            "message": f"spec.engine.{fld}: the model's architecture is not multimodal (vLLM rejects multimodal "
                       "options for it); remove the field",
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
