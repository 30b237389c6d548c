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
        # an exec in the engine container (the pod's own network namespace: the exporter takes a drain
        # from loopback only), never an httpGet the kubelet sends from the node
        assert c["lifecycle"] == {"preStop": {"exec": {"command": ["python3", "-m", "moe_eplb.exporter.drain"]}}}
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
        assert c["lifecycle"]["preStop"]["exec"]["command"] == list(k8s_names.DRAIN_COMMAND)
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


def test_a_stock_engine_uses_what_vllm_offers(variant):
    """``spec.engine.exporter.inject: false`` on a stock image (no exporter in the pod): startup,
    readiness and liveness on vLLM's own ``/health``, no preStop hook and no exporter port, and vLLM's
    graceful shutdown is the whole drain (``--shutdown-timeout drainSeconds``)."""
    res = variant({"spec.engine.image": "vllm/vllm-openai:v0.35.0", "spec.engine.exporter": {"inject": False},
                   "spec.engine.drainSeconds": 300})
    children = render_children(parse(res))
    (pod,) = _pod_specs(res).values()
    (c,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert "lifecycle" not in c and "initContainers" not in pod
    assert [p["name"] for p in c["ports"]] == ["http"]
    args = c["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "300"
    assert pod["terminationGracePeriodSeconds"] == 300 + 30
    service = next(x for x in children if x["kind"] == "Service")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    monitor = next(x for x in children if x["kind"] == "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"]


def test_several_api_servers_a_pod_are_each_reachable(variant):
    """Fault tolerance with 8 ranks a pod (vLLM's multi-port supervisor): every rank's API port is a
    container port, a Service port and a PodMonitor endpoint; startup waits for the supervisor's
    aggregated health; the exporter's health and drain follow every port."""
    res = variant({"spec.model.name": "deepseek-ai/DeepSeek-R1", "spec.model.architecture": None,
                   "spec.model.quantization": None, "spec.engine.image": "vllm/vllm-openai:v0.34.0",
                   "spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2, "all2allBackend": "deepep_low_latency"},
                   "spec.faultTolerance": {"enabled": True}, "spec.engine.limitMmPerPrompt": None,
                   "spec.engine.mmEncoderTpMode": None, "spec.eplb.numRedundantExperts": 32})
    children = render_children(parse(res))
    names = ["http"] + [f"http-{i}" for i in range(1, 8)]
    service = next(x for x in children if x["kind"] == "Service")
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == \
        list(zip(names, range(8000, 8008))) + [("eplb-metrics", 9400)]
    assert k8s_names.LWS_WORKER_INDEX_LABEL not in service["spec"]["selector"]  # every pod serves
    monitor = next(x for x in children if x["kind"] == "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["eplb-metrics"] + names
    for spec in _pod_specs(res).values():
        (c,) = spec["containers"]
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == \
            list(zip(names, range(8000, 8008))) + [("dp-supervisor", 9256), ("eplb-metrics", 9400)]
        assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "dp-supervisor"}
        assert _env(c)[k8s_names.API_PORTS_ENV] == ",".join(str(8000 + i) for i in range(8))
