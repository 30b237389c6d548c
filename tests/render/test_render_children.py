"""render_children: the seed renders faithfully; every child is labelled, owned and valid."""

from __future__ import annotations

import copy
import json
import subprocess
from importlib import metadata

import kubernetes_validate
import pytest

from moe_eplb.api.schema import schema_problems, unknown_field_problems
from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb.contracts.k8s_names import CONFIG_HASH_ANNOTATION, EXPORTER_PLUGIN
from moe_eplb.render.engine_args import SHM_CLEAN, engine_args
from moe_eplb.render.labels import labels, selector_string
from moe_eplb.render.objects import API_COMMAND, endpoint, render_children
from moe_eplb_harness.floor.pods import container_argv
from tests.example_manifests import DELETE, EXAMPLES, frozen, load_moeinferences
from tests.render.crd_subsets import LEADER_WORKER_SET, POD_MONITOR

K8S = kubernetes_validate.latest_version()
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))

SEED_ARGS = [
    "cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit",
    "--served-model-name", "qwen3-vl-30b-a3b-instruct",
    "--port", "8000",
    "--tensor-parallel-size", "4",
    "--enable-expert-parallel",
    "--enable-eplb",
    "--eplb-config", '{"window_size":3000,"step_interval":1000,"num_redundant_experts":8,"log_balancedness":false}',
    "--moe-backend", "triton",
    "--dtype", "float16",
    "--max-model-len", "40960",
    "--gpu-memory-utilization", "0.9",
    "--limit-mm-per-prompt", '{"image":4,"video":0}',
    "--mm-encoder-tp-mode", "data",
    "--shutdown-timeout", "30",
]


def by_kind(children):
    return {c["kind"]: c for c in children}


def container(pod_template):
    (c,) = pod_template["spec"]["containers"]
    return c


def test_seed_args_exactly(seed) -> None:
    deploy = by_kind(render_children_of(seed))["Deployment"]
    c = container(deploy["spec"]["template"])
    assert c["command"] == API_COMMAND
    assert c["args"] == SEED_ARGS


def test_seed_children_in_apply_order(seed) -> None:
    kinds = [c["kind"] for c in render_children_of(seed)]
    assert kinds == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "PodMonitor"]
    no_monitor = copy.deepcopy(seed)
    no_monitor["spec"]["monitoring"]["podMonitor"]["enabled"] = False
    assert [c["kind"] for c in render_children_of(no_monitor)] == ["ConfigMap", "Service", "Deployment",
                                                                    "PodDisruptionBudget"]


def test_seed_deployment(seed) -> None:
    d = by_kind(render_children_of(seed))["Deployment"]
    assert d["metadata"]["name"] == "qwen3-vl-30b" and d["metadata"]["namespace"] == "default"
    spec = d["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    c = container(spec["template"])
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert {"name": "VLLM_PLUGINS", "value": EXPORTER_PLUGIN} in c["env"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, k8s_names.EXPORTER_PORT_NAME: k8s_names.EXPORTER_PORT}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["template"]["spec"]["volumes"]
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # default startupTimeoutSeconds
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": k8s_names.EXPORTER_PORT_NAME}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": k8s_names.EXPORTER_PORT_NAME}
    assert c["livenessProbe"]["failureThreshold"] >= 3
    hash_ = spec["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    assert hash_ == _effective(seed).config_hash()


def test_labels_and_owner_references_on_every_child(seed) -> None:
    owned = copy.deepcopy(seed)
    owned["metadata"]["uid"] = "1234-abcd"
    for child in render_children_of(owned):
        assert child["metadata"]["labels"] == labels("qwen3-vl-30b")
        assert child["metadata"]["labels"]["eplb.ai/name"] == "qwen3-vl-30b"
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": "qwen3-vl-30b",
                       "uid": "1234-abcd", "controller": True, "blockOwnerDeletion": True}
    for child in render_children_of(seed):  # no uid yet (e.g. `moe-eplb render`): no ownerReferences
        assert "ownerReferences" not in child["metadata"]


def test_scaling_keeps_the_pod_template_and_eplb_changes_roll_it(seed, variant) -> None:
    def template(res):
        return by_kind(render_children_of(res))["Deployment"]["spec"]["template"]

    scaled = by_kind(render_children_of(variant({"spec.replicas": 3})))["Deployment"]
    assert scaled["spec"]["replicas"] == 3
    assert scaled["spec"]["template"] == template(seed)
    changed = template(variant({"spec.eplb.stepInterval": 2000}))
    assert changed["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != \
        template(seed)["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    assert '"step_interval":2000' in " ".join(container(changed)["args"])


def test_tuner_override_is_rendered_for_the_current_generation(seed) -> None:
    res = copy.deepcopy(seed)
    res["metadata"]["generation"] = 7
    res["status"] = {"autotune": {"override": {"windowSize": 2000, "stepInterval": 500, "numRedundantExperts": 12,
                                               "specGeneration": 7}}}
    args = container(by_kind(render_children_of(res))["Deployment"]["spec"]["template"])["args"]
    cfg = json.loads(args[args.index("--eplb-config") + 1])
    assert (cfg["window_size"], cfg["step_interval"], cfg["num_redundant_experts"]) == (2000, 500, 12)
    res["metadata"]["generation"] = 8  # the user edited the spec since: spec wins
    args = container(by_kind(render_children_of(res))["Deployment"]["spec"]["template"])["args"]
    assert json.loads(args[args.index("--eplb-config") + 1])["window_size"] == 3000


TEXT_MODEL = {"spec.model.name": "deepseek-ai/DeepSeek-V2-Lite", "spec.model.architecture": DELETE,
              "spec.model.quantization": DELETE, "spec.engine.limitMmPerPrompt": DELETE,
              "spec.engine.mmEncoderTpMode": DELETE, "spec.eplb.numRedundantExperts": 4,
              "spec.eplb.logBalancedness": True}


def test_flat_eplb_flags_before_0_10_2(variant) -> None:
    res = variant({**TEXT_MODEL, "spec.engine.version": "0.10.1"})
    args = engine_args(parse(res), parse(res).effective)
    i = args.index("--enable-eplb")
    assert args[i:i + 8] == ["--enable-eplb", "--num-redundant-experts", "4", "--eplb-window-size", "3000",
                             "--eplb-step-interval", "1000", "--eplb-log-balancedness"]
    assert "--eplb-config" not in args


def test_eplb_config_json_from_0_10_2(variant) -> None:
    res = variant({**TEXT_MODEL, "spec.engine.version": "0.10.2", "spec.eplb.async": True})
    args = engine_args(parse(res), parse(res).effective)
    assert json.loads(args[args.index("--eplb-config") + 1]) == {
        "window_size": 3000, "step_interval": 1000, "num_redundant_experts": 4, "log_balancedness": True,
        "use_async": True}
    assert "--num-redundant-experts" not in args and "--moe-backend" not in args  # unquantized: no backend needed


def test_moe_backend_only_where_needed(variant) -> None:
    def args_of(changes):
        res = variant(changes)
        return engine_args(parse(res), parse(res).effective)

    assert "--moe-backend" not in args_of({"spec.engine.version": "0.12.0"})  # before the Triton-only change
    assert "--moe-backend" not in args_of({"spec.eplb.enabled": False, "spec.eplb.numRedundantExperts": 0})
    user = args_of({"spec.engine.extraArgs": ["--moe-backend=triton"]})
    assert user.count("--moe-backend=triton") == 1 and "--moe-backend" not in user


def test_eplb_off_renders_no_eplb_flags(variant) -> None:
    res = variant({"spec.eplb.enabled": False})
    args = engine_args(parse(res), parse(res).effective)
    assert not any(a.startswith("--enable-eplb") or a.startswith("--eplb") for a in args)
    assert "--enable-expert-parallel" in args  # EP itself stays on


def test_storage_token_chat_template_and_user_env(variant) -> None:
    res = variant({
        "spec.model.storage": {"pvc": {"claimName": "weights", "mountPath": "/cache", "subPath": "hf"},
                               "hfTokenSecret": {"name": "hf"}},
        "spec.engine.chatTemplate": {"configMapRef": {"name": "tmpl"}},
        "spec.engine.env": [{"name": "VLLM_PLUGINS", "value": "other"}, {"name": "FOO", "value": "1"}],
        "spec.engine.resources": {"limits": {"memory": "200Gi"}, "requests": {"cpu": "8"}},
        "spec.engine.extraArgs": ["--trust-remote-code"],
        "spec.engine.imagePullSecrets": [{"name": "regcred"}],
        "spec.engine.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "spec.engine.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    })
    d = by_kind(render_children_of(res))["Deployment"]
    c = container(d["spec"]["template"])
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_PLUGINS"]["value"] == f"other,{EXPORTER_PLUGIN}"
    assert [e["name"] for e in c["env"]].count("VLLM_PLUGINS") == 1 and env["FOO"]["value"] == "1"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_HOME"]["value"] == "/cache"
    assert {"name": "model-storage", "mountPath": "/cache", "readOnly": False, "subPath": "hf"} in c["volumeMounts"]
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-storage"]["persistentVolumeClaim"]["claimName"] == "weights"
    assert vols["chat-template"]["configMap"] == {"name": "tmpl", "items": [
        {"key": "chat_template.jinja", "path": "chat_template.jinja"}]}
    assert c["args"][c["args"].index("--chat-template") + 1] == "/etc/moe-eplb/chat-template/chat_template.jinja"
    assert c["args"][-1] == "--trust-remote-code"
    assert c["resources"] == {"limits": {"memory": "200Gi", "nvidia.com/gpu": 4},
                              "requests": {"cpu": "8", "nvidia.com/gpu": 4}}
    assert not any("token" in a.lower() for a in c["args"])  # never a token in the args
    pod = d["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    kubernetes_validate.validate(d, K8S, strict=True)


def test_local_path_model_does_not_set_hf_home(variant) -> None:
    res = variant({"spec.model.name": "/models/qwen3-vl", "spec.model.architecture": "Qwen3VLMoeForConditionalGeneration",
                   "spec.model.moe": {"numExperts": 128},
                   "spec.model.storage": {"pvc": {"claimName": "weights", "readOnly": True}}})
    c = container(by_kind(render_children_of(res))["Deployment"]["spec"]["template"])
    assert "HF_HOME" not in {e["name"] for e in c["env"]}
    assert c["args"][0] == "/models/qwen3-vl"


def test_service_and_pod_monitor(seed) -> None:
    kids = by_kind(render_children_of(seed))
    svc = kids["Service"]["spec"]
    assert svc["selector"] == kids["Deployment"]["spec"]["selector"]["matchLabels"]
    assert {p["name"]: p["port"] for p in svc["ports"]} == {"http": 8000, k8s_names.EXPORTER_PORT_NAME: k8s_names.EXPORTER_PORT}
    pm = kids["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"] == svc["selector"]
    assert pm["namespaceSelector"] == {"matchNames": ["default"]}
    ports = [e["port"] for e in pm["podMetricsEndpoints"]]
    assert ports == [k8s_names.EXPORTER_PORT_NAME, "http"]
    for e in pm["podMetricsEndpoints"]:
        assert e["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_label_eplb_ai_name"],
                                     "targetLabel": metric_names.MOEINFERENCE_LABEL, "action": "replace"},
                                    {"sourceLabels": ["__meta_kubernetes_pod_label_eplb_ai_arm"],
                                     "targetLabel": metric_names.ARM_LABEL, "action": "replace"}]
    assert endpoint(parse(seed)) == "http://qwen3-vl-30b.default.svc:8000"
    assert selector_string("qwen3-vl-30b") == "app.kubernetes.io/component=engine,eplb.ai/name=qwen3-vl-30b"


def test_exporter_plugin_name_matches_the_entry_point() -> None:
    eps = metadata.entry_points(group="vllm.general_plugins")
    assert EXPORTER_PLUGIN in {ep.name for ep in eps}


# --- multi-node -----------------------------------------------------------------------------------


@pytest.fixture()
def deepseek():
    return load_moeinferences(EXAMPLES / "deepseek-v3-multinode.yaml")[0]


def test_deepseek_renders_a_leader_worker_set(deepseek) -> None:
    kids = by_kind(render_children_of(deepseek))
    assert "Deployment" not in kids
    lws = kids["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["leaderWorkerTemplate"]["size"] == 2
    leader = container(spec["leaderWorkerTemplate"]["leaderTemplate"])
    args = leader["args"]
    assert args[0] == "deepseek-ai/DeepSeek-V3-0324"
    pairs = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--data-parallel")}
    # no --data-parallel-start-rank on the leader: vLLM would infer hybrid load balancing from it and
    # its API would dispatch to its own 8 ranks only (tests/launch_logic checks what vLLM makes of it)
    assert pairs == {"--data-parallel-size": "16", "--data-parallel-size-local": "8",
                     "--data-parallel-rpc-port": "13345", "--data-parallel-address": "$(LWS_LEADER_ADDRESS)"}
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 8 and "--headless" not in args
    assert leader["startupProbe"]["failureThreshold"] * leader["startupProbe"]["periodSeconds"] >= 5400
    assert kids["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert kids["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 2


def test_each_group_gets_its_own_headless_service_not_the_client_services_name(deepseek) -> None:
    """LWS's default subdomain policy (Shared) wants a headless Service named after the LWS, which is
    the client Service's name: LWS skips it and LWS_LEADER_ADDRESS never resolves. UniquePerReplica
    gives each group a headless Service ``<name>-<group>`` and the leader address under it
    (tests/kube/test_lws_subdomain_real.py checks what the real LWS controller makes of it)."""
    kids = by_kind(render_children_of(deepseek))
    lws, svc = kids["LeaderWorkerSet"], kids["Service"]
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    name = lws["metadata"]["name"]
    assert svc["metadata"]["name"] == name and svc["spec"]["type"] == "ClusterIP"
    assert k8s_names.lws_group_service(name, 1) == "deepseek-v3-1" != svc["metadata"]["name"]
    assert k8s_names.lws_leader_address(name, 0, "ns1") == "deepseek-v3-0.deepseek-v3-0.ns1"
    assert k8s_names.lws_leader_address(name, 0) == "deepseek-v3-0.deepseek-v3-0"


def test_worker_command_runs_in_a_real_shell(deepseek) -> None:
    """Run the worker's ``sh -c`` script with LWS's env and its ``args`` as ``$@``, after
    Kubernetes' ``$(VAR)`` expansion, with ``vllm`` replaced by a printer."""
    lws = by_kind(render_children_of(deepseek))["LeaderWorkerSet"]
    worker = container(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    env = {"LWS_LEADER_ADDRESS": "deepseek-v3-0.deepseek-v3-0.default", "LWS_WORKER_INDEX": "1"}
    argv = container_argv(worker, env)
    assert argv[2].startswith(SHM_CLEAN + '; exec vllm serve "$@" ')
    argv[2] = argv[2].replace(SHM_CLEAN, ":", 1).replace("exec vllm serve", "printf '%s\\n'", 1)
    out = subprocess.run(argv, capture_output=True, text=True, check=True,
                         env={**env, "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    leader_args = container(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["args"]
    common = leader_args[: leader_args.index("--data-parallel-size-local")]
    assert out[: len(common)] == common  # JSON in --eplb-config survives
    rest = out[len(common):]
    assert rest == ["--data-parallel-size-local", "8", "--data-parallel-rpc-port", "13345",
                    "--data-parallel-address", "deepseek-v3-0.deepseek-v3-0.default",
                    "--data-parallel-start-rank", "8", "--headless"]


# --- strict validation of every child of every example ---------------------------------------------


def _strict_problems(obj, schema):
    return unknown_field_problems(obj, schema) + schema_problems(obj, schema)


def _validate_child(child) -> None:
    if child["kind"] == "LeaderWorkerSet":
        assert _strict_problems(child, LEADER_WORKER_SET) == []
        for key in ("leaderTemplate", "workerTemplate"):
            template = child["spec"]["leaderWorkerTemplate"][key]
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, K8S, strict=True)
    elif child["kind"] == "PodMonitor":
        assert _strict_problems(child, POD_MONITOR) == []
    elif child["kind"] == "ScaledObject":  # KEDA's published CRD (tests/render/test_autoscaler.py)
        from tests.render.test_autoscaler import keda_problems

        assert keda_problems(child) == []
    else:
        kubernetes_validate.validate(child, K8S, strict=True)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_every_child_of_every_example_is_valid(path) -> None:
    for doc in load_moeinferences(path):
        doc = copy.deepcopy(doc)
        doc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
        children = render_children_of(doc)
        assert children
        for child in children:
            _validate_child(child)
        json.dumps(children)  # plain data only


def test_strict_validation_catches_a_bad_field(seed) -> None:
    """Negative control: the validators used above do reject unknown fields."""
    deploy = by_kind(render_children_of(seed))["Deployment"]
    deploy["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S, strict=True)
    pm = copy.deepcopy(by_kind(render_children_of(seed))["PodMonitor"])
    pm["spec"]["podMetricEndpoints"] = []
    assert _strict_problems(pm, POD_MONITOR)
    lws = by_kind(render_children_of(load_moeinferences(EXAMPLES / "deepseek-v3-multinode.yaml")[0]))["LeaderWorkerSet"]
    lws["spec"]["startupPolicy"] = "Eager"
    assert _strict_problems(lws, LEADER_WORKER_SET)


def test_render_is_deterministic_and_pure(seed) -> None:
    before = copy.deepcopy(seed)
    assert render_children_of(seed) == render_children_of(seed)
    assert seed == before


def test_mapping_views_render_like_dicts(seed) -> None:
    assert render_children_of(frozen(seed)) == render_children_of(seed)


def _effective(resource):
    """The EPLB settings that run for ``resource`` (parsed once)."""
    return parse(resource).effective


def render_children_of(resource):
    """``render_children`` of a resource dict (parsed once)."""
    return render_children(parse(resource))


def test_fault_tolerant_group_serves_every_rank_and_keeps_survivors() -> None:
    """With spec.faultTolerance every data-parallel rank serves its own API: the workers get the API
    port and vLLM's /health as their startup probe, the Service selects every pod of a group (not
    only leaders), and a failed pod does not make LeaderWorkerSet recreate the surviving ones."""
    doc = next(d for d in load_moeinferences(EXAMPLES / "deepseek-v3-fault-tolerant.yaml"))
    inf = parse(doc)
    assert inf.fault_tolerance.enabled and inf.parallelism.nodes > 1
    kids = {c["kind"]: c for c in render_children(inf)}
    lwt = kids["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "None"
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    # 8 ranks a pod: one API server each (ports 8000-8007) and the multi-port supervisor's health
    assert {p["name"] for p in worker["ports"]} == {k8s_names.api_port_name(i) for i in range(8)} | {
        "dp-supervisor", k8s_names.EXPORTER_PORT_NAME}
    assert worker["startupProbe"]["httpGet"] == {"path": "/health", "port": "dp-supervisor"}
    assert k8s_names.LWS_WORKER_INDEX_LABEL not in kids["Service"]["spec"]["selector"]
    # without fault tolerance: leaders only, groups recreated together, headless workers
    plain = copy.deepcopy(doc)
    plain["spec"]["faultTolerance"] = {"enabled": False}
    kids = {c["kind"]: c for c in render_children(parse(plain))}
    lwt = kids["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert {p["name"] for p in lwt["workerTemplate"]["spec"]["containers"][0]["ports"]} == {k8s_names.EXPORTER_PORT_NAME}
    assert kids["Service"]["spec"]["selector"][k8s_names.LWS_WORKER_INDEX_LABEL] == "0"


def test_every_engine_pod_mounts_the_control_token_and_the_secret_is_not_a_child(seed, deepseek) -> None:
    """The operator's control token: every engine container (single-node, LWS leader and worker) mounts
    ``<name>-control`` read-only and is told where the file is; the Secret itself is not one of the
    rendered children (the reconciler makes it once, with a random token)."""
    from moe_eplb.render.objects import control_secret

    for resource, pods in ((seed, 1), (deepseek, 2)):
        inf = parse(resource)
        kids = render_children(inf)
        assert "Secret" not in {c["kind"] for c in kids}
        templates = [c["spec"]["template"] for c in kids if c["kind"] == "Deployment"] + [
            c["spec"]["leaderWorkerTemplate"][t] for c in kids if c["kind"] == "LeaderWorkerSet"
            for t in ("leaderTemplate", "workerTemplate")]
        assert len(templates) == pods
        for tmpl in templates:
            secret_name = f"{inf.name}-control"
            assert {"name": "eplb-control", "secret": {"secretName": secret_name, "optional": True,
                                                       "items": [{"key": "token", "path": "token"}]}} \
                in tmpl["spec"]["volumes"]
            c = container(tmpl)
            assert {"name": "eplb-control", "mountPath": "/var/run/moe-eplb/control", "readOnly": True} \
                in c["volumeMounts"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env[k8s_names.CONTROL_TOKEN_FILE_ENV] == "/var/run/moe-eplb/control/token"
    inf = parse(seed)
    secret = control_secret(inf, "tok-123")
    assert secret["metadata"]["name"] == f"{inf.name}-control" and secret["type"] == "Opaque"
    assert secret["data"] == {"token": "dG9rLTEyMw=="}  # base64 of the token, as the API server stores it
    assert secret["metadata"]["labels"] == labels(inf.name)
    kubernetes_validate.validate(secret, K8S, strict=True)


def test_workload_metadata_reaches_the_workload_object(deepseek) -> None:
    """``spec.workload.metadata``: Kueue's queue label and LeaderWorkerSet's exclusive-topology
    annotation on the LeaderWorkerSet object itself (gang admission of a whole group), the operator's
    labels kept; the pods do not get them (their own are spec.engine.podTemplate.metadata)."""
    import copy

    res = copy.deepcopy(deepseek)
    res["spec"]["workload"] = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "gpu"},
                                            "annotations": {"leaderworkerset.sigs.k8s.io/exclusive-topology": "rack"}}}
    lws = by_kind(render_children_of(res))["LeaderWorkerSet"]
    assert lws["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert lws["metadata"]["labels"]["eplb.ai/name"] == "deepseek-v3"
    assert lws["metadata"]["annotations"] == {"leaderworkerset.sigs.k8s.io/exclusive-topology": "rack"}
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]
    assert "kueue.x-k8s.io/queue-name" not in leader["labels"]
