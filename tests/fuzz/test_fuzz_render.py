"""Property-based tier over ``moe-eplb render``: on any resource, ``render`` either prints the
children (exit 0, a YAML stream of objects) or refuses it exactly as ``validate`` does (exit 1, the
same lines on stderr) -- never a traceback; and a resource ``validate`` accepts always renders
(``spec: cannot render the children`` would be a case validation missed).

Resources: the examples with up to six fields changed to values of the CRD's types (enums, bounds,
plausible strings, images, versions, quantities, lists) or removed, and the operator's defaults
(``--prometheus-url``, ``--exporter-image``, ``--pod-monitor-labels``) given or not. Most of them are
valid to the CRD's schema, so the operator's own checks (CEL, catalog, vLLM facts) decide.
"""

from __future__ import annotations

import copy

import yaml
from click.testing import CliRunner
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moe_eplb.api.crd import openapi_schema
from moe_eplb.cli import main
from tests.example_manifests import EXAMPLES, load_moeinferences

SEEDS = [doc for path in sorted(EXAMPLES.glob("*.yaml")) for doc in load_moeinferences(path)]
DELETE = object()

IMAGES = ["vllm/vllm-openai:v0.12.0", "vllm/vllm-openai:v0.32.0", "vllm/vllm-openai:v0.10.2", "vllm/vllm-openai:latest",
          "vllm/vllm-openai:v0.33.1", "registry.local:5000/team/vllm:v0.20.1", "ghcr.io/moe-eplb/vllm:v0.32.0",
          "vllm/vllm-openai@sha256:" + "a" * 64, "vllm/vllm-openai:v0.8.5", "vllm/vllm-openai:nightly-2025"]
STRINGS = {
    "spec.model.name": ["Qwen/Qwen3-30B-A3B-Instruct-2507", "deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-235B-A22B",
                        "Qwen/Qwen3-VL-30B-A3B-Instruct", "someone/unknown-moe", "/models/local", "x"],
    "spec.model.servedName": ["m", "my-model", "Qwen/Qwen3", "a b"],
    "spec.model.architecture": ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Qwen3VLMoeForConditionalGeneration",
                                "MixtralForCausalLM", "Unknown"],
    "spec.engine.image": IMAGES,
    "spec.engine.exporter.image": ["ghcr.io/moe-eplb/operator:0.1.0", "registry.local/op:dev", "op@sha256:" + "b" * 64],
    "spec.engine.version": ["0.12.0", "0.10.2", "0.32.1", "0.33.0", "v0.20.0", "0.8.5", "1.0.0", "0.34.0rc1"],
    "spec.model.storage.pvc.mountPath": ["/models", "/", "/mnt/weights"],
    "spec.model.storage.pvc.subPath": ["", "a/b", "qwen"],
    "spec.autoscaling.hpa.metricName": ["vllm_waiting", "a:b", "_x"],
    "spec.monitoring.prometheusUrl": ["http://prometheus-operated.monitoring:9090", "https://p.example/prom"],
}
QUANTITIES = [0, 1, 1024, "0", "1Gi", "16Gi", "500Mi", "1.5Gi", "64G", "2Ti", "100m"]
OBJECTS = {
    "spec.engine.limitMmPerPrompt": [{}, {"image": 2}, {"image": 0, "video": 1}],
    "spec.engine.resources.limits": [{}, {"nvidia.com/gpu": 4}, {"nvidia.com/gpu": 8, "memory": "64Gi"},
                                     {"cpu": "4", "memory": "32Gi"}, {"nvidia.com/gpu": 1}],
    "spec.engine.resources.requests": [{}, {"cpu": "2"}, {"nvidia.com/gpu": 4}],
    "spec.engine.nodeSelector": [{}, {"gpu": "h100"}],
    "spec.monitoring.podMonitor.labels": [{}, {"release": "kube-prometheus-stack"}, {"team": "ml", "a.b/c": "d"}],
    "spec.engine.extraArgs": [[], ["--enforce-eager"], ["--max-num-seqs", "8"], ["--tensor-parallel-size", "2"],
                              ["--enable-eplb"]],
    "spec.engine.env": [[], [{"name": "X", "value": "1"}], [{"name": "PYTHONPATH", "value": "/mine"}],
                        [{"name": "VLLM_PLUGINS", "value": "other"}, {"name": "HF_HOME", "value": "/cache"}]],
    "spec.engine.imagePullSecrets": [[], [{"name": "regcred"}]],
    "spec.engine.tolerations": [[], [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]],
}


def _leaves(schema: dict, path: str):
    if schema.get("type") == "object" and "properties" in schema:
        for key, sub in schema["properties"].items():
            yield from _leaves(sub, f"{path}.{key}")
    else:
        yield path, schema


def _values(path: str, schema: dict) -> st.SearchStrategy:
    if path in STRINGS:
        return st.sampled_from(STRINGS[path])
    if path in OBJECTS:
        return st.sampled_from(OBJECTS[path])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("x-kubernetes-int-or-string"):
        return st.sampled_from(QUANTITIES)
    kind = schema.get("type")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = int(lo if lo is not None else 0)
        hi = int(hi if hi is not None else 10**9)
        return st.one_of(st.integers(lo, min(hi, lo + 16)), st.sampled_from(sorted({lo, hi, min(hi, 1000), min(hi, 4096)})),
                         st.integers(lo, hi))
    if kind == "number":
        return st.one_of(st.sampled_from([float(lo or 0), float(hi if hi is not None else 1)]),
                         st.floats(float(lo or 0), float(hi if hi is not None else 1e5), allow_nan=False))
    return st.sampled_from(["", "x", "name-1"])


LEAVES = dict(_leaves(openapi_schema()["properties"]["spec"], "spec"))
# whole parts of the spec removed (the CRD defaults or leaves them out)
PARTS = ["spec.autoscaling", "spec.autoscaling.hpa", "spec.autoscaling.keda", "spec.autotune", "spec.autotune.bounds",
         "spec.monitoring", "spec.monitoring.prometheusUrl", "spec.eplb", "spec.model.moe", "spec.model.storage",
         "spec.engine.exporter", "spec.rollout", "spec.parallelism", "spec.engine.resources"]
MUTATION = st.one_of(
    st.sampled_from(sorted(LEAVES)).flatmap(lambda p: st.tuples(st.just(p), _values(p, LEAVES[p]))),
    st.tuples(st.sampled_from(PARTS), st.just(DELETE)),
)
OPERATOR_FLAGS = st.fixed_dictionaries({
    "--prometheus-url": st.sampled_from([None, "http://prometheus.monitoring:9090"]),
    "--exporter-image": st.sampled_from([None, "registry.example.com/moe-eplb/operator:0.3.0"]),
    "--pod-monitor-labels": st.sampled_from([None, "release=kube-prometheus-stack"]),
})


def mutated(seed: dict, mutations) -> dict:
    doc = copy.deepcopy(seed)
    for dotted, value in mutations:
        *parents, last = dotted.split(".")
        obj = doc
        for p in parents:
            if not isinstance(obj.get(p), dict):
                if value is DELETE:
                    break
                obj[p] = {}
            obj = obj[p]
        else:
            if value is DELETE:
                obj.pop(last, None)
            else:
                obj[last] = value
    return doc


def _no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def _validate_and_render(path, flags):
    """``moe-eplb validate`` and ``render`` on ``path`` with the operator's flags; neither may end in a
    traceback."""
    args = [a for k, v in flags.items() if v is not None for a in (k, v)]
    runner = CliRunner()
    validate = runner.invoke(main, ["validate", "-f", str(path), *args])
    render = runner.invoke(main, ["render", "-f", str(path), *args])
    _no_traceback(validate)
    _no_traceback(render)
    return validate, render


#: two CLI runs per example (~0.3 s): a quarter of the tier's count keeps it short; for a longer hunt
#: MOE_EPLB_FUZZ_EXAMPLES=2000 MOE_EPLB_FUZZ_RANDOM=1 (tests/fuzz/conftest.py)
FEWER = settings(max_examples=max(10, settings.default.max_examples // 4))


@FEWER
@given(st.sampled_from(SEEDS), st.lists(MUTATION, min_size=1, max_size=6), OPERATOR_FLAGS)
def test_render_renders_or_refuses_as_validate_does(tmp_path_factory, seed, mutations, flags):
    path = tmp_path_factory.mktemp("r") / "m.yaml"
    path.write_text(yaml.safe_dump(mutated(seed, mutations)))
    validate, render = _validate_and_render(path, flags)
    event(f"validate exit {validate.exit_code}")  # --hypothesis-show-statistics: how many rendered
    assert "cannot render the children" not in render.stderr, render.stderr  # validation missed a case
    if validate.exit_code == 0:
        assert validate.stdout == "valid\n" and render.exit_code == 0, render.output
        children = list(yaml.safe_load_all(render.stdout))
        assert children and all(isinstance(c, dict) and c.get("kind") and c.get("apiVersion") for c in children)
    else:
        assert validate.exit_code == render.exit_code == 1, (validate.output, render.output)
        assert render.stdout == "" and render.stderr == validate.stderr
        assert render.stderr.strip(), "refused without a word"


HOSTILE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
              st.sampled_from(["eplb.ai/v1alpha1", "MoEInference", "v1", "x" * 300])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
SHALLOW = ["apiVersion", "kind", "metadata", "metadata.name", "metadata.namespace", "metadata.labels",
           "metadata.annotations", "spec", "status", "spec.engine", "spec.model", "spec.autoscaling",
           "spec.monitoring", "spec.autotune", "status.autotune", "status.autotune.override"]
DOCUMENT = st.one_of(
    st.tuples(st.sampled_from(SEEDS), st.lists(st.one_of(MUTATION, st.tuples(st.sampled_from(SHALLOW), HOSTILE)),
                                               max_size=4)).map(lambda x: mutated(*x)),
    HOSTILE,
)


@FEWER
@given(st.lists(DOCUMENT, min_size=1, max_size=3), OPERATOR_FLAGS)
def test_streams_of_hostile_documents_render_or_are_refused_as_validate_does(tmp_path_factory, docs, flags):
    path = tmp_path_factory.mktemp("s") / "m.yaml"
    try:
        path.write_text(yaml.safe_dump_all(docs))
    except (yaml.YAMLError, ValueError):
        return
    validate, render = _validate_and_render(path, flags)
    assert "cannot render the children" not in render.stderr, render.stderr
    assert validate.exit_code in (0, 1) and render.exit_code == validate.exit_code, (validate.output, render.output)
    assert render.stderr == validate.stderr
    assert all(len(line) < 2000 for line in render.stderr.splitlines())
    if validate.exit_code == 1:
        assert render.stdout == "" and render.stderr.strip()
