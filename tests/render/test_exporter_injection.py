"""The exporter plugin injected into stock vLLM images (issue 14): the init container, the shared
volume and the environment the rendered pod has, and what the injection step writes."""

from __future__ import annotations

import subprocess
import sys

from moe_eplb import __version__
from moe_eplb.api.spec import OperatorDefaults, parse
from moe_eplb.contracts import k8s_names
from moe_eplb.exporter.inject import inject
from moe_eplb.render.objects import render_children


def _pod_specs(resource) -> list[dict]:
    out = []
    for child in render_children(parse(resource)):
        if child["kind"] == "Deployment":
            out.append(child["spec"]["template"]["spec"])
        elif child["kind"] == "LeaderWorkerSet":
            tmpl = child["spec"]["leaderWorkerTemplate"]
            out += [tmpl["leaderTemplate"]["spec"], tmpl["workerTemplate"]["spec"]]
    return out


def _env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def test_injected_by_default_into_every_engine_pod(variant) -> None:
    res = variant({"spec.engine.image": "vllm/vllm-openai:v0.32.0"})
    for spec in _pod_specs(res):
        (init,) = spec["initContainers"]
        assert init["name"] == k8s_names.EXPORTER_INIT_CONTAINER
        assert init["image"] == f"{k8s_names.OPERATOR_IMAGE_REPOSITORY}:{__version__}"
        assert init["command"] == ["python", "-m", "moe_eplb.exporter.inject", k8s_names.EXPORTER_INJECT_DIR]
        assert init["volumeMounts"] == [{"name": k8s_names.EXPORTER_VOLUME, "mountPath": k8s_names.EXPORTER_INJECT_DIR}]
        assert {"name": k8s_names.EXPORTER_VOLUME, "emptyDir": {}} in spec["volumes"]
        (engine,) = spec["containers"]
        assert {"name": k8s_names.EXPORTER_VOLUME, "mountPath": k8s_names.EXPORTER_INJECT_DIR, "readOnly": True} \
            in engine["volumeMounts"]
        env = _env(engine)
        assert env["PYTHONPATH"] == k8s_names.EXPORTER_INJECT_DIR
        assert env["VLLM_PLUGINS"] == k8s_names.EXPORTER_PLUGIN


def test_multinode_groups_inject_into_leader_and_workers(variant) -> None:
    res = variant({"spec.parallelism": {"tensor": 4, "data": 4, "nodes": 2}})
    specs = _pod_specs(res)
    assert len(specs) == 2 and all(len(s["initContainers"]) == 1 for s in specs)


def test_user_pythonpath_and_plugins_are_kept_after_ours(variant) -> None:
    res = variant({"spec.engine.env": [{"name": "PYTHONPATH", "value": "/mine"},
                                        {"name": "VLLM_PLUGINS", "value": "other_plugin"},
                                        {"name": "X", "value": "1"}],
                   "spec.engine.exporter": {"image": "registry.local/moe-eplb/operator:dev"}})
    (spec,) = _pod_specs(res)
    env = _env(spec["containers"][0])
    assert env["PYTHONPATH"] == f"{k8s_names.EXPORTER_INJECT_DIR}:/mine"
    assert env["VLLM_PLUGINS"] == f"other_plugin,{k8s_names.EXPORTER_PLUGIN}"
    assert env["X"] == "1" and [e["name"] for e in spec["containers"][0]["env"]].count("PYTHONPATH") == 1
    assert spec["initContainers"][0]["image"] == "registry.local/moe-eplb/operator:dev"


def test_not_injected_when_turned_off(variant) -> None:
    res = variant({"spec.engine.exporter": {"inject": False}, "spec.engine.image": "ghcr.io/moe-eplb/vllm:v0.32.0"})
    (spec,) = _pod_specs(res)
    assert "initContainers" not in spec
    assert all(v["name"] != k8s_names.EXPORTER_VOLUME for v in spec["volumes"])
    assert "PYTHONPATH" not in _env(spec["containers"][0])
    assert _env(spec["containers"][0])["VLLM_PLUGINS"] == k8s_names.EXPORTER_PLUGIN  # the image's own plugin
    # a stock image without the plugin: no exporter to name, vLLM's own plugin choice
    (spec,) = _pod_specs(variant({"spec.engine.exporter": {"inject": False}}))
    assert "VLLM_PLUGINS" not in _env(spec["containers"][0])


def test_injection_writes_a_plugin_vllm_finds_without_the_package_installed(tmp_path) -> None:
    files = inject(tmp_path)
    names = {p.relative_to(tmp_path).as_posix() for p in files}
    assert "moe_eplb/exporter/plugin.py" in names and "moe_eplb/contracts/metric_names.py" in names
    assert not any(n.startswith(("moe_eplb/controller", "moe_eplb/api", "moe_eplb/eplb")) for n in names)
    assert inject(tmp_path) and len(list(tmp_path.glob("*.dist-info"))) == 1  # idempotent
    # a Python without site-packages (no moe-eplb installed) finds the entry point through the
    # directory alone, as vLLM's plugin loader does, and loads the injected copy; -I: not through a
    # PYTHONPATH to the source tree either (whose moe_eplb.egg-info an editable install leaves there)
    # (tests/exporter/test_injected_minimal.py: the same in a Python with only numpy and prometheus-client)
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import importlib.metadata as m, moe_eplb\n"
            "eps = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'moe_eplb_exporter']\n"
            "fn = eps[0].load()\n"
            "print(len(eps), fn.__module__, fn.__name__, moe_eplb.__file__)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    count, module, name, path = out.stdout.split()
    assert (count, module, name) == ("1", "moe_eplb.exporter.plugin", "register")
    assert path.startswith(str(tmp_path))


def test_pod_monitor_carries_the_configured_labels(variant) -> None:
    res = variant({"spec.monitoring.podMonitor": {"enabled": True, "labels": {
        "release": "kube-prometheus-stack", "eplb.ai/name": "not-mine"}}})
    pm = next(c for c in render_children(parse(res)) if c["kind"] == "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pm["metadata"]["labels"][k8s_names.NAME_LABEL] == res["metadata"]["name"]  # ours cannot be overridden


def test_operator_defaults_fill_what_the_resource_leaves_unset(variant) -> None:
    """The chart's operator.podMonitorLabels and the operator's own image (MOE_EPLB_POD_MONITOR_LABELS,
    MOE_EPLB_EXPORTER_IMAGE): the resource's own values win, ours win over both."""
    defaults = OperatorDefaults(pod_monitor_labels={"release": "kps", "team": "ml", k8s_names.NAME_LABEL: "x"},
                                exporter_image="registry.example.com/moe-eplb/operator:0.3.0")
    res = variant({"spec.monitoring.podMonitor": {"enabled": True, "labels": {"team": "serving"}}})
    children = render_children(parse(res).with_operator_defaults(defaults))
    pm = next(c for c in children if c["kind"] == "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kps" and pm["metadata"]["labels"]["team"] == "serving"
    assert pm["metadata"]["labels"][k8s_names.NAME_LABEL] == res["metadata"]["name"]
    dep = next(c for c in children if c["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["initContainers"][0]["image"] == defaults.exporter_image
    own = variant({"spec.engine.exporter": {"image": "registry.local/moe-eplb/operator:dev"}})
    dep = next(c for c in render_children(parse(own).with_operator_defaults(defaults)) if c["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["initContainers"][0]["image"] == "registry.local/moe-eplb/operator:dev"
    off = parse(variant({"spec.engine.exporter": {"inject": False}}))
    assert off.with_operator_defaults(OperatorDefaults(exporter_image="a/b:1")) is off  # nothing to inject
