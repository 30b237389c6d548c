"""Admission parity on a REAL kube-apiserver: the CRD's schema and CEL rules as the apiserver runs
them, against ``moe-eplb validate`` (``validate``) and the project's offline model of the apiserver
(``apiserver_problems``, Python CEL), case by case on the apply-time table of tests/api.

Every example is accepted; every bad manifest is refused by both the apiserver and ``validate``, and
both name the same field. The table of which checks the apiserver makes itself and which only the
operator makes is in docs/resource.md ("Who checks what"); ``test_docs_table_matches`` keeps it honest.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.error
from typing import Any

import pytest

from moe_eplb.api.validation import apiserver_problems, validate
from tests.api.test_api_apply_time import BAD as CORE_BAD
from tests.api.test_api_apply_time import elastic
from tests.api.test_api_podtemplate import OVERLAY_BAD, OVERLAY_OPERATOR_ONLY
from tests.example_manifests import DELETE, EXAMPLES, load_moeinferences, set_path
from tests.kube.conftest import REPO

EXAMPLE_DOCS = [(p.name, i, d) for p in sorted(EXAMPLES.glob("*.yaml")) for i, d in enumerate(load_moeinferences(p))]

elastic_seed = elastic({})
#: DeepSeek-R1 at EP 16 over 2 pods with DeepEP low latency, on vLLM 0.34 (changes to the seed)
DEEPSEEK_R1: dict[str, Any] = {
    "spec.model": {"name": "deepseek-ai/DeepSeek-R1"}, "spec.engine.limitMmPerPrompt": DELETE,
    "spec.engine.mmEncoderTpMode": DELETE, "spec.engine.dtype": DELETE, "spec.engine.image": "vllm/vllm-openai:v0.34.0",
    "spec.eplb.numRedundantExperts": DELETE, "spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2,
                                                                 "all2allBackend": "deepep_low_latency"}}

#: What only ``validate`` (the CLI and the operator) refuses: the apiserver ADMITS these (no CEL
#: function parses a quantity or knows vLLM's flags), the operator then sets ``SpecValid=False`` and
#: changes nothing. (changes to the seed, field ``validate`` names)
OPERATOR_ONLY: dict[str, tuple[dict[str, Any], str]] = {
    "4bit-name-without-quantization": ({"spec.model.quantization": DELETE}, "spec.model.quantization"),
    "extra-arg-repeats-generated-flag": ({"spec.engine.extraArgs": ["--num-redundant-experts=16"]}, "spec.engine.extraArgs[0]"),
    "moe-backend-not-triton": ({"spec.engine.extraArgs": ["--moe-backend", "marlin"]}, "spec.engine.extraArgs"),
    "memory-budget-exceeded": ({"spec.autotune.mode": "Recommend", "spec.autotune.memoryBudgetPerGpu": "64Mi"},
                               "spec.eplb.numRedundantExperts"),
    "quantity-passes-pattern-only": ({"spec.engine.shmSize": "1.2.3"}, "spec.engine.shmSize"),
    "extra-arg-sets-parallelism": ({"spec.engine.extraArgs": ["--tensor-parallel-size", "8"]}, "spec.engine.extraArgs[0]"),
    "extra-arg-sets-shutdown-timeout": ({"spec.engine.extraArgs": ["--shutdown-timeout", "5"]},
                                        "spec.engine.extraArgs[0]"),
    # vLLM 0.34 (wide EP): what needs the catalog's hidden size, extraArgs or the version's defaults
    "deepep-ll-buffer-over-32gib": ({"spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "deepep_low_latency"},
                                     "spec.eplb.numRedundantExperts": 200,
                                     "spec.engine.extraArgs": ["--max-num-batched-tokens", "8192"]},
                                    "spec.eplb.numRedundantExperts"),
    "ft-moe-draft": ({"spec.engine.image": "vllm/vllm-openai:v0.34.0",
                      "spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "nixl_ep"},
                      "spec.faultTolerance": {"enabled": True},
                      "spec.engine.extraArgs": ["--speculative-config", '{"method":"mtp","num_speculative_tokens":1}']},
                     "spec.engine.extraArgs[0]"),
    "ft-ranks-not-whole-pods": ({"spec.engine.image": "vllm/vllm-openai:v0.34.0", "spec.eplb.numRedundantExperts": 24,
                                 "spec.parallelism": {"tensor": 1, "data": 8, "nodes": 2, "all2allBackend": "nixl_ep"},
                                 "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}},
                                "spec.faultTolerance.rankFailuresToSurvive"),
    "moonep-quantized": ({"spec.eplb.enabled": False, "spec.parallelism.all2allBackend": "moonep",
                          "spec.engine.dtype": "bfloat16"}, "spec.parallelism.all2allBackend"),
    # elastic groups: what needs extraArgs or the catalog's hidden size at the largest size
    "elastic-pipeline-parallel": ({**elastic_seed, "spec.engine.extraArgs": ["-pp", "2"]}, "spec.engine.extraArgs[0]"),
    "elastic-hybrid-lb": ({**elastic_seed, "spec.engine.extraArgs": ["--data-parallel-hybrid-lb"]},
                          "spec.engine.extraArgs[0]"),
    "elastic-deepep-buffer-at-max": ({**elastic_seed, "spec.parallelism.all2allBackend": "deepep_low_latency",
                                      "spec.engine.extraArgs": ["--max-num-batched-tokens", "10000"]},
                                     "spec.parallelism.elastic.maxData"),
    "omitted-redundancy-outside-bounds": ({"spec.engine.image": "vllm/vllm-openai:v0.34.0",
                                           "spec.eplb.numRedundantExperts": DELETE,
                                           "spec.parallelism": {"tensor": 1, "data": 6},
                                           "spec.autotune.bounds": {"numRedundantExperts": {"min": 8, "max": 16}}},
                                          "spec.autotune.bounds.numRedundantExperts"),
    "nccl-communicator-with-async": ({"spec.eplb.communicator": "torch_nccl"}, "spec.eplb.communicator"),
    # issue 37: the GPU's memory against the layout, the image against the GPU vendor, a vendor's backend
    # in extraArgs, a workload label key
    "gpu-memory-does-not-fit": ({"spec.engine.gpuMemory": "6Gi"}, "spec.engine.maxModelLen"),
    "ft-floor-does-not-fit": ({**DEEPSEEK_R1, "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 8},
                               "spec.engine.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                              "spec.eplb.numRedundantExperts"),
    "image-vendor-mismatch": ({"spec.engine.gpuResourceName": "amd.com/gpu"}, "spec.engine.image"),
    "vendor-backend-in-extra-args": ({"spec.engine.extraArgs": ["--all2all-backend", "mori"]}, "spec.engine.extraArgs[0]"),
    "workload-bad-label-key": ({"spec.workload": {"metadata": {"labels": {"team name": "x"}}}},
                               "spec.workload.metadata.labels['team name']"),
    # found by the launch-logic tier: vLLM refuses --api-server-count on a --headless worker
    "api-server-count-on-headless-workers": ({"spec.parallelism": {"tensor": 2, "data": 4, "nodes": 2},
                                             "spec.engine.extraArgs": ["--api-server-count", "4"]},
                                            "spec.engine.extraArgs[0]"),
    **OVERLAY_OPERATOR_ONLY,
}
#: the apply-time table of tests/api, and the pod-template overlay's (tests/api/test_api_podtemplate.py)
BAD = {**CORE_BAD, **OVERLAY_BAD}


def server_dry_run(cp: Any, namespace: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``obj`` with ``dryRun=All`` and strict field validation (what ``kubectl apply`` sends);
    (HTTP status, the answer: the object or the ``Status``)."""
    body = copy.deepcopy(obj)
    body.setdefault("metadata", {})["namespace"] = namespace
    path = f"/apis/eplb.ai/v1alpha1/namespaces/{namespace}/moeinferences?dryRun=All&fieldValidation=Strict"
    try:
        return 201, cp.request("POST", path, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


_UNKNOWN = re.compile(r'unknown field "([^"]+)"')


def status_fields(status: dict[str, Any]) -> set[str]:
    """The fields an apiserver ``Status`` names: ``details.causes[].field`` (``spec.x[0].y`` as the
    apiserver writes paths), and ``unknown field "spec.x"`` in a strict-validation message."""
    fields = {c.get("field", "") for c in (status.get("details") or {}).get("causes", [])}
    fields |= set(_UNKNOWN.findall(status.get("message", "")))
    return {f.removeprefix(".") for f in fields if f}


def check_kind(status: dict[str, Any], field: str) -> str:
    """Which apiserver check refused ``field``: ``strict`` (unknown field, strict decoding), ``schema``
    (OpenAPI types, bounds, enums, patterns, required: the apiserver's own wording, "in body should
    ...", "Unsupported value", "Required value") or ``CEL`` (one of the CRD's rules: the project's
    message)."""
    message = status.get("message", "")
    if "strict decoding error" in message:
        return "strict"
    causes = [c for c in (status.get("details") or {}).get("causes", []) if c.get("field", "").removeprefix(".") == field]
    texts = [c.get("message", "") for c in causes] or [message]
    schema_words = ("in body", "Unsupported value", "Required value", "must be of type", "Too long")
    return "schema" if any(w in t for t in texts for w in schema_words) else "CEL"


def seed_with(seed: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    res = copy.deepcopy(seed)
    for dotted, value in changes.items():
        set_path(res, dotted, value)
    return res


@pytest.mark.parametrize(("name", "index", "doc"), EXAMPLE_DOCS, ids=[f"{n}[{i}]" for n, i, _ in EXAMPLE_DOCS])
def test_examples_are_admitted(control_plane, kube_ns, name, index, doc) -> None:
    code, answer = server_dry_run(control_plane, kube_ns, doc)
    assert code == 201, (name, answer.get("message"))
    assert validate(doc) == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifests_refused_by_both_naming_the_same_field(control_plane, kube_ns, seed, case) -> None:
    changes, field, words = BAD[case]
    res = seed_with(seed, changes)
    code, status = server_dry_run(control_plane, kube_ns, res)
    ours = {p.field for p in validate(res)}
    assert field in ours, (case, validate(res))
    assert code in (400, 422), (case, code, status)
    message = status.get("message", "")
    # the apiserver names the field as a cause; a rule on the object's root (metadata.name) can only
    # name it in its message (CRD rules cannot point a fieldPath into metadata)
    assert field in status_fields(status) or (field.startswith("metadata.") and field in message), (case, message)
    kind = check_kind(status, field)
    if kind == "CEL":  # the project's own message reaches the user
        assert words in message, (case, message)
    assert kind == DOC_KINDS.get(case), (case, kind, message)
    # the offline model of the apiserver agrees with the real one on the field
    assert field in {p.field for p in apiserver_problems(res)}, case


@pytest.mark.parametrize("case", sorted(OPERATOR_ONLY))
def test_operator_only_checks_are_admitted_by_the_apiserver(control_plane, kube_ns, seed, case) -> None:
    changes, field = OPERATOR_ONLY[case]
    res = seed_with(seed, changes)
    code, status = server_dry_run(control_plane, kube_ns, res)
    assert code == 201, (case, status.get("message"))
    assert field in {p.field for p in validate(res)}, (case, validate(res))
    assert field not in {p.field for p in apiserver_problems(res)}, case


def _doc_rows() -> dict[str, list[str]]:
    text = (REPO / "docs" / "resource.md").read_text()
    if "### Who checks what" not in text:
        return {}
    table = text.split("### Who checks what", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


#: the apiserver's check per case, as docs/resource.md states it ("refused (CEL)" ...)
DOC_KINDS = {case: cells[1].split("(")[-1].rstrip(")") for case, cells in _doc_rows().items() if case in BAD}


def test_docs_table_matches() -> None:
    """docs/resource.md lists every case of both tables with where it is caught."""
    rows = _doc_rows()
    assert set(BAD) <= set(rows), sorted(set(BAD) - set(rows))
    assert set(OPERATOR_ONLY) <= set(rows), sorted(set(OPERATOR_ONLY) - set(rows))
    for case in BAD:
        assert rows[case][1].startswith("refused (") and rows[case][3].startswith("refused"), rows[case]
    for case in OPERATOR_ONLY:
        assert rows[case][1] == "admitted" and rows[case][3].startswith("refused"), rows[case]
