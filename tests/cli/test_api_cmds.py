"""``moe-eplb validate``, ``render`` and ``crd`` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.api.spec import parse
from moe_eplb.cli import main
from moe_eplb.render.objects import render_children
from tests.example_manifests import EXAMPLES

SEED = EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml"


@pytest.fixture()
def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def test_validate_good_file(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", str(SEED)])
    assert result.exit_code == 0
    assert result.stdout == "valid\n" and result.stderr == ""


def test_validate_bad_file_exits_1_with_messages_on_stderr(runner, tmp_path) -> None:
    bad = SEED.read_text().replace("numRedundantExperts: 8", "numRedundantExperts: 7").replace(
        "windowSize: 3000", "windowsize: 3000")
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert f"{path}: spec.eplb.windowsize: unknown field 'windowsize'; did you mean 'windowSize'?" in lines
    assert any("spec.eplb.numRedundantExperts" in line and "use numRedundantExperts 4 or 8" in line for line in lines)


def test_multi_document_file_names_the_bad_document(runner, tmp_path) -> None:
    docs = list(yaml.safe_load_all(SEED.read_text()))
    good = docs[0]
    bad = yaml.safe_load(SEED.read_text())
    bad["metadata"]["name"] = "second"
    bad["spec"]["parallelism"]["tensor"] = 1
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([good, bad]))
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1
    assert "document 2 (second): spec.eplb.enabled:" in result.stderr
    assert "document 1" not in result.stderr


def test_other_kinds_are_skipped(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", str(EXAMPLES / "deepseek-v3-multinode.yaml")])
    assert result.exit_code == 0 and result.stdout == "valid\n"
    assert "Secret (v1) is not a MoEInference, skipped" in result.stderr


def test_render_prints_exactly_render_children(runner) -> None:
    result = runner.invoke(main, ["render", "-f", str(SEED)])
    assert result.exit_code == 0
    printed = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert printed == render_children_of(yaml.safe_load(SEED.read_text()))


def test_render_refuses_invalid_input(runner, tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(SEED.read_text().replace("tensor: 4", "tensor: 1"))
    result = runner.invoke(main, ["render", "-f", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert "spec.eplb.enabled" in result.stderr


@pytest.mark.parametrize(("content", "words"), [("a: [unclosed", "not valid YAML"), ("", "no MoEInference")])
def test_unreadable_inputs(runner, tmp_path, content, words) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(content)
    result = runner.invoke(main, ["validate", "-f", str(path)])
    assert result.exit_code == 1 and words in result.stderr


def test_missing_file(runner, tmp_path) -> None:
    result = runner.invoke(main, ["validate", "-f", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1 and "cannot read" in result.stderr


def test_stdin(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", "-"], input=SEED.read_text())
    assert result.exit_code == 0 and result.stdout == "valid\n"


def test_console_script_end_to_end() -> None:
    """The installed entry point, in a fresh process (exit codes as a shell sees them)."""
    ok = subprocess.run([sys.executable, "-m", "moe_eplb", "validate", "-f", str(SEED)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "valid"
    crd = subprocess.run([sys.executable, "-m", "moe_eplb", "crd"], capture_output=True, text=True)
    assert crd.returncode == 0 and yaml.safe_load(crd.stdout)["kind"] == "CustomResourceDefinition"


AUTOSCALED = EXAMPLES / "qwen3-30b-a3b-autoscaled.yaml"
PROM = "http://prometheus-operated.monitoring.svc:9090"


def _keda_without_prometheus(tmp_path):
    doc = yaml.safe_load(AUTOSCALED.read_text())
    del doc["spec"]["monitoring"]["prometheusUrl"]
    path = tmp_path / "keda.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("command", ["validate", "render"])
def test_keda_without_a_prometheus_address_is_refused_in_one_line_naming_both_fixes(runner, tmp_path, command):
    """What only the operator's --prometheus-url makes valid: refused without it (the operator started
    without one refuses it too), in the same line by both commands; valid and rendered with it."""
    path = _keda_without_prometheus(tmp_path)
    result = runner.invoke(main, [command, "-f", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines() == [
        f"{path}: spec.monitoring.prometheusUrl: spec.autoscaling backend KEDA queries Prometheus, and neither this "
        "field nor --prometheus-url (the operator's option; validate and render take it too) names one: set "
        "spec.monitoring.prometheusUrl or --prometheus-url, or use backend: HPA with prometheus-adapter"]
    given = runner.invoke(main, [command, "-f", str(path), "--prometheus-url", PROM])
    assert given.exit_code == 0, given.stderr
    if command == "render":
        (scaled,) = [d for d in yaml.safe_load_all(given.stdout) if d["kind"] == "ScaledObject"]
        assert scaled["spec"]["triggers"][0]["metadata"]["serverAddress"] == PROM
    # the resource's own address wins over the operator's
    own = runner.invoke(main, ["render", "-f", str(AUTOSCALED), "--prometheus-url", PROM])
    (scaled,) = [d for d in yaml.safe_load_all(own.stdout) if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring:9090"


def test_render_takes_the_operators_exporter_image_and_pod_monitor_labels(runner) -> None:
    """--exporter-image and --pod-monitor-labels render what `moe-eplb run` with them applies."""
    image = "registry.example.com/moe-eplb/operator:0.3.0"
    result = runner.invoke(main, ["render", "-f", str(AUTOSCALED), "--exporter-image", image,
                                  "--pod-monitor-labels", "release=kube-prometheus-stack"])
    assert result.exit_code == 0, result.stderr
    children = list(yaml.safe_load_all(result.stdout))
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["initContainers"][0]["image"] == image
    (pm,) = [c for c in children if c["kind"] == "PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    from moe_eplb.api.spec import OperatorDefaults

    defaults = OperatorDefaults(exporter_image=image, pod_monitor_labels={"release": "kube-prometheus-stack"})
    assert children == render_children(parse(yaml.safe_load(AUTOSCALED.read_text())).with_operator_defaults(defaults))


@pytest.mark.parametrize(("option", "value", "words"), [
    ("--prometheus-url", "prometheus:9090", "is not an http(s) URL"),
    ("--exporter-image", "Not An Image", "is not an image reference"),
    ("--pod-monitor-labels", "release", "is not key=value"),
])
@pytest.mark.parametrize("command", ["validate", "render"])
def test_bad_operator_options_are_usage_errors_naming_the_option(runner, command, option, value, words) -> None:
    result = runner.invoke(main, [command, "-f", str(SEED), option, value])
    assert result.exit_code == 2 and result.stdout == ""
    assert f"Error: {option}: {value!r} {words}" in result.stderr
    assert "Traceback" not in result.stderr and "MOE_EPLB_" not in result.stderr  # no env variable is read


def test_documents_are_named_by_their_place_in_the_file(runner, tmp_path) -> None:
    """A skipped or malformed document (metadata not an object) is named, not a traceback."""
    path = tmp_path / "mixed.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: just-a-string\n---\n"
                    "apiVersion: eplb.ai/v1alpha1\nkind: MoEInference\nmetadata: [1]\n---\n" + SEED.read_text())
    for command in ("validate", "render"):
        result = runner.invoke(main, [command, "-f", str(path)])
        assert result.exit_code == 1 and result.stdout == ""
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert result.stderr.splitlines() == [
            f"{path}: document 1: ConfigMap (v1) is not a MoEInference, skipped",
            f"{path}: document 2: metadata: must be an object with at least a name"]


def render_children_of(resource):
    """``render_children`` of a resource dict (parsed once)."""
    return render_children(parse(resource))


def _deepseek(tmp_path, *, backend="deepep_low_latency", image="vllm/vllm-openai:v0.34.0", model="deepseek-ai/DeepSeek-V3",
              gpu=None, extra_args=None, eplb=True) -> str:
    """One node of 8 GPUs, DP 8 + EP, EPLB on: the shape of DeepSeek-V3 on a single H200 node."""
    spec = {"model": {"name": model}, "engine": {"image": image},
            "parallelism": {"tensor": 1, "data": 8, **({"all2allBackend": backend} if backend else {})},
            "eplb": {"enabled": eplb, **({"numRedundantExperts": 0} if eplb else {})}}
    if gpu:
        spec["engine"]["gpuResourceName"] = gpu
    if extra_args:
        spec["engine"]["extraArgs"] = extra_args
    doc = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "m"}, "spec": spec}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_validate_warns_where_eplb_drops_the_shared_expert_overlap(runner, tmp_path) -> None:
    """DeepSeek-V3 + EPLB + deepep_low_latency on vLLM 0.34: valid (exit 0), one warning naming
    spec.parallelism.all2allBackend and the backends that keep the overlap on these GPUs."""
    path = _deepseek(tmp_path)
    result = runner.invoke(main, ["validate", "-f", path])
    assert result.exit_code == 0 and result.stdout == "valid\n", result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{path}: warning: spec.parallelism.all2allBackend: EPLB on deepep_low_latency turns off "
                           "the shared-expert overlap")
    assert "12.5% of the routed compute" in line
    assert "(vLLM 0.34.0, NVIDIA): allgather_reducescatter; deepep_v2; flashinfer_nvlink_one_sided." in line
    # render warns the same and still renders
    rendered = runner.invoke(main, ["render", "-f", path])
    assert rendered.exit_code == 0 and "kind: Deployment" in rendered.stdout and "warning:" in rendered.stderr
    # AMD GPUs: only allgather_reducescatter keeps it (DeepEP and FlashInfer are NVIDIA's)
    amd = runner.invoke(main, ["validate", "-f", _deepseek(tmp_path, backend="mori", gpu="amd.com/gpu", image="vllm/vllm-openai-rocm:v0.34.0")])
    assert amd.exit_code == 0 and "EPLB on mori" in amd.stderr
    assert "(vLLM 0.34.0, AMD): allgather_reducescatter." in amd.stderr and "deepep_v2" not in amd.stderr
    # set through extraArgs: the argument is named, and the field to use instead
    extra = runner.invoke(main, ["validate", "-f", _deepseek(tmp_path, backend=None,
                                                               extra_args=["--all2all-backend", "deepep_high_throughput"])])
    assert extra.exit_code == 0 and "warning: spec.engine.extraArgs[0]: EPLB on deepep_high_throughput" in extra.stderr
    assert "(set spec.parallelism.all2allBackend, not the argument)" in extra.stderr


@pytest.mark.parametrize("variant", [
    {"model": "Qwen/Qwen3-30B-A3B"},                     # no shared experts
    {"backend": "deepep_v2"},                             # keeps the overlap with EPLB
    {"backend": None},                                    # vLLM's default, allgather_reducescatter
    {"backend": "flashinfer_nvlink_two_sided"},           # drops it with data parallel whatever EPLB does
    {"eplb": False},                                      # nothing to warn about
])
def test_validate_is_silent_where_eplb_costs_no_overlap(runner, tmp_path, variant) -> None:
    result = runner.invoke(main, ["validate", "-f", _deepseek(tmp_path, **variant)])
    assert result.exit_code == 0 and result.stdout == "valid\n" and result.stderr == "", result.stderr


def test_validate_warning_with_fault_tolerance_says_no_backend_keeps_it(runner) -> None:
    result = runner.invoke(main, ["validate", "-f", str(EXAMPLES / "deepseek-v3-fault-tolerant.yaml")])
    assert result.exit_code == 0 and result.stdout == "valid\n"
    assert "fault tolerance needs deepep_low_latency or nixl_ep, which both drop it" in result.stderr
