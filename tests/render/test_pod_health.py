"""The engine pods' drain, probes, /dev/shm clean and GPU resource name as rendered (pure), and the
fixed ``sh -c`` script run in a real shell on a sandbox instead of /dev/shm."""

from __future__ import annotations

import subprocess

from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.render.engine_args import SHM_CLEAN
from moe_eplb.render.objects import API_COMMAND, render_children
from moe_eplb_harness.floor.pods import container_argv


def _workload(res):
    return next(c for c in render_children(parse(res)) if c["kind"] in ("Deployment", "LeaderWorkerSet"))


def _pod_specs(res):
    w = _workload(res)
    if w["kind"] == "Deployment":
        return {"pod": w["spec"]["template"]["spec"]}
    lwt = w["spec"]["leaderWorkerTemplate"]
    return {"leader": lwt["leaderTemplate"]["spec"], "worker": lwt["workerTemplate"]["spec"]}


def _env(c):
    return {e["name"]: e.get("value") for e in c["env"]}


def test_drain_renders_hook_grace_flag_and_env(variant):
    for drain in (600, 7200):
        res = variant({"spec.engine.drainSeconds": drain})
        (pod,) = _pod_specs(res).values()
        (c,) = pod["containers"]
        assert c["lifecycle"] == {"preStop": {"httpGet": {"path": "/drain", "port": k8s_names.EXPORTER_PORT_NAME}}}
        assert pod["terminationGracePeriodSeconds"] == drain + 60
        args = c["args"]
        assert args[args.index("--shutdown-timeout") + 1] == "30"
        assert _env(c)[k8s_names.DRAIN_SECONDS_ENV] == str(drain) and _env(c)[k8s_names.ENGINE_ROLE_ENV] == "api"
        deploy = _workload(res)
        assert deploy["spec"]["progressDeadlineSeconds"] == 3600 + drain + 60 + 600


def test_no_drain_and_old_versions(variant):
    (pod,) = _pod_specs(variant({"spec.engine.drainSeconds": 0})).values()
    (c,) = pod["containers"]
    assert "lifecycle" not in c and "--shutdown-timeout" not in c["args"]
    assert pod["terminationGracePeriodSeconds"] == 60
    # vLLM before 0.18.0 has no --shutdown-timeout: the preStop drain alone
    (pod,) = _pod_specs(variant({"spec.engine.image": "vllm/vllm-openai:v0.17.1"})).values()
    (c,) = pod["containers"]
    assert "--shutdown-timeout" not in c["args"] and c["lifecycle"]["preStop"]
    (pod,) = _pod_specs(variant({"spec.engine.image": "vllm/vllm-openai:v0.18.0"})).values()
    assert "--shutdown-timeout" in pod["containers"][0]["args"]


def test_every_pod_of_a_group_has_probes_sized_for_long_loads(variant):
    res = variant({"spec.parallelism": {"tensor": 2, "data": 4, "nodes": 2}, "spec.engine.startupTimeoutSeconds": 7200})
    specs = _pod_specs(res)
    leader, worker = specs["leader"]["containers"][0], specs["worker"]["containers"][0]
    exporter = k8s_names.EXPORTER_PORT_NAME
    assert leader["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["startupProbe"]["httpGet"] == {"path": "/livez", "port": exporter}
    for c in (leader, worker):
        s = c["startupProbe"]
        assert s["periodSeconds"] * s["failureThreshold"] >= 7200
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": exporter}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": exporter}
        assert c["lifecycle"]["preStop"]["httpGet"]["path"] == "/drain"
    assert _env(leader)[k8s_names.ENGINE_ROLE_ENV] == "api" and _env(worker)[k8s_names.ENGINE_ROLE_ENV] == "worker"
    assert specs["leader"]["terminationGracePeriodSeconds"] == specs["worker"]["terminationGracePeriodSeconds"] == 660


def test_gpu_resource_name_in_limits_and_requests(variant):
    res = variant({"spec.engine.gpuResourceName": "amd.com/gpu",
                   "spec.engine.resources": {"limits": {"memory": "64Gi"}, "requests": {"cpu": "8"}}})
    (pod,) = _pod_specs(res).values()
    resources = pod["containers"][0]["resources"]
    assert resources == {"limits": {"memory": "64Gi", "amd.com/gpu": 4}, "requests": {"cpu": "8", "amd.com/gpu": 4}}
    assert "nvidia.com/gpu" not in str(resources)


def test_the_api_command_cleans_shm_and_passes_args_verbatim(tmp_path, variant):
    """The rendered command in a real shell, /dev/shm swapped for a sandbox: every entry (hidden ones
    too) is removed, then vllm gets the container args unchanged, one argument each."""
    (pod,) = _pod_specs(variant({"spec.engine.extraArgs": ["a b", "$$HOME", "'\""]})).values()
    (c,) = pod["containers"]
    assert c["command"] == API_COMMAND and c["command"][2].startswith(SHM_CLEAN.replace("$", "$$"))
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("vllm_dist_x", ".hidden", "..dots", "moe-eplb-dir"):
        (shm / name).mkdir() if name.endswith("dir") else (shm / name).write_text("leftover")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$OUT"\n')
    (bindir / "vllm").chmod(0o755)
    argv = container_argv(c, {})
    argv[2] = argv[2].replace("/dev/shm", str(shm))
    out = tmp_path / "argv"
    subprocess.run(argv, env={"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(out)}, check=True, timeout=30)
    assert list(shm.iterdir()) == []
    got = [a.decode() for a in out.read_bytes().split(b"\0")[:-1]]
    assert got == ["serve", *c["args"][:-3], "a b", "$HOME", "'\""]
