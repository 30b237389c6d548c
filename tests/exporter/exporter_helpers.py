"""Helpers for the exporter tests: a one-process vLLM world on CPU with vLLM's REAL EPLB classes,
a small MixtureOfExperts model object, a router stand-in that records load like vLLM's kernel, and
per-version stand-ins of the EPLB state for layouts the installed wheel does not have.
"""

from __future__ import annotations

import os
import types

import numpy as np

from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.vllm_engine.cpu_eplb_bridge import PerfCounterEvent

try:  # the torch-free helpers (free_port, env_without_exporter) must import without it
    import torch
except ImportError:  # pragma: no cover - tests needing torch skip via importorskip
    torch = None

KNUTH = 2654435769
#: set by tests/test_vllm_sources.py in the child pytest's environment (and so in its subprocesses)
BRIDGE_ENV = "MOE_EPLB_VLLM_SRC_BRIDGE"


def tiny_exporter_pods() -> dict:
    """The real exporter's aggregated pods (``collector.aggregate``) for a tiny model: 2 layers, 4
    experts, EP 2, every EP rank in one pod and every family set (vLLM 0.34's health signals too:
    async cycles are timed on rank 0 only) -- the input of
    ``collector.families`` wherever a test needs what a real pod exports."""
    from moe_eplb.exporter import snapshot as snap
    from moe_eplb.exporter.collector import aggregate

    L, E, EP = 2, 4, 2
    snaps = [snap.WorkerSnapshot(pid=r, time=0.0, models=[snap.ModelSnapshot(
        name="m", ep_rank=r, ep_size=EP, expert_tokens=np.ones((L, E)), rank_tokens=np.ones((L, EP)),
        replicas=np.ones((L, E), np.int64), steps=5, window_size=1000, step_interval=3000,
        num_redundant_experts=0, use_async=True, kv_cache_bytes=2**30, rebalance_failures=0,
        async_duration_buckets=np.zeros(len(snap.DURATION_BUCKETS) + 1, np.int64) if r == 0 else None)])
        for r in range(EP)]
    pods = aggregate(snaps)
    for pm in pods.values():
        pm.balancedness = {0: 1.0, 1: 1.0}  # what the pod collector sets for a pod holding every rank
    return pods


_WORLD: dict = {}


def vllm_world():
    """Initialise vLLM's distributed state once (world size 1, gloo, EPLB group on)."""
    if _WORLD:
        return _WORLD["vc"]
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if os.environ.get(BRIDGE_ENV):  # a released wheel's sources, not an installed vLLM
        from tests import vllm_src_bridge

        vllm_src_bridge.apply()
    vc = VllmConfig()
    vc.parallel_config.enable_eplb = True
    port = free_port()
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
    _WORLD["vc"] = vc
    return vc


class _Layer:
    """One MoE layer as EPLB sees it: expert weights and a real ``EplbLayerState``."""

    def __init__(self, num_local: int):
        from vllm.distributed.eplb.eplb_state import EplbLayerState

        self.weights = [torch.arange(num_local, dtype=torch.float32).unsqueeze(1).repeat(1, 4)]
        self.eplb_state = EplbLayerState()

    def get_expert_weights(self):
        return self.weights

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.eplb_state.set_layer_state(moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count)


def make_moe_model(L: int, E: int, R: int, ep: int = 1):
    """A MixtureOfExperts model object (vLLM's protocol, with its default ``set_eplb_state``)."""
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    P = E + R

    class TinyMoE(MixtureOfExperts):
        num_moe_layers = L
        num_logical_experts = E
        num_routed_experts = E
        num_redundant_experts = R
        num_physical_experts = P
        num_local_physical_experts = P // ep
        num_expert_groups = 1
        num_shared_experts = 0

        def __init__(self):
            self.moe_layers = [_Layer(P // ep) for _ in range(L)]
            self.expert_weights = []

    return TinyMoE()


class StandInModelConfig:
    """What ``EplbState`` reads of a ``ModelConfig`` (vLLM's needs a real checkpoint): ``model``,
    ``served_model_name`` (already resolved to a string by vLLM) and the config hash that keys
    ``model_states``: ``compute_hash()`` (vLLM <= 0.33, through ``compute_hash_cached``) or
    ``compile_factors()`` (0.34: ``hash_config_cached``). Both derive from the model path and
    ``tag``; vLLM caches the hash by ``id()``, so distinct configs must hash apart (the serial
    number). Every one is also kept alive: vLLM <= 0.33 stores a model under ``compute_hash()`` but
    ``prepare_forward`` looks it up under ``compute_hash_cached()``, which would return a dead
    config's hash to a new config that reuses its id (vLLM's real configs live as long as the
    engine), and the forward's tokens would then go unseen."""

    _serial = 0
    _alive: list = []

    def __init__(self, model: str, served_model_name: str | None = None, tag: str = ""):
        StandInModelConfig._alive.append(self)
        StandInModelConfig._serial += 1
        self.model, self.served_model_name, self.tag = model, served_model_name, tag
        self._factors = {"model": model, "tag": tag, "serial": StandInModelConfig._serial}

    def compile_factors(self) -> dict:
        return dict(self._factors)

    def compute_hash(self) -> str:
        return "hash-{model}{tag}-{serial}".format(**self._factors)


def make_real_state(L=3, E=8, R=4, window=4, interval=10, use_async=False, name="tiny/moe"):
    """vLLM's real ``EplbState`` with one model added through the real ``add_model``."""
    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.distributed.eplb.eplb_state import EplbState

    vc = vllm_world()
    pc = ParallelConfig()
    pc.eplb_config.window_size = window
    pc.eplb_config.step_interval = interval
    pc.eplb_config.num_redundant_experts = R
    pc.eplb_config.use_async = use_async
    pc.eplb_config.communicator = "torch_gloo"
    state = EplbState(pc, torch.device("cpu"))
    model = make_moe_model(L, E, R)
    mc = StandInModelConfig(name)
    with set_current_vllm_config(vc):
        state.add_model(model, mc)
    return state, model


def route(model, topk_ids: np.ndarray) -> None:
    """Record one forward pass like vLLM's ``_eplb_map_and_record`` kernel does on GPU.

    ``topk_ids``: int [L, N, k] logical experts chosen for N tokens in each layer. Each (token, slot)
    is mapped to a physical replica (same hash as the kernel) and counted in ``expert_load_view``
    if the shared ``should_record_tensor`` is on.
    """
    for l, layer in enumerate(model.moe_layers):
        st = layer.eplb_state
        if st.should_record_tensor is not None and not bool(st.should_record_tensor):
            continue
        ids = torch.as_tensor(topk_ids[l], dtype=torch.int64)
        n, k = ids.shape
        token_idx = torch.arange(n).unsqueeze(1).expand(n, k)
        cnt = st.logical_replica_count[ids].clamp(min=1)
        replica = ((token_idx * KNUTH) & 0xFFFFFFFF) % cnt
        phys = st.logical_to_physical_map[ids, replica]
        st.expert_load_view.index_add_(0, phys.reshape(-1), torch.ones(n * k, dtype=st.expert_load_view.dtype))


def logical_counts(topk_ids: np.ndarray, E: int) -> np.ndarray:
    """[L, E] (token, slot) counts per logical expert."""
    L = topk_ids.shape[0]
    out = np.zeros((L, E))
    for l in range(L):
        np.add.at(out[l], topk_ids[l].reshape(-1), 1)
    return out


#: Stand-in for ``torch.Event(enable_timing=True)``: vLLM's sync rearrange times itself with device
#: events, which the CPU backend lacks. The test bridge's own (one definition for both).
CpuEvent = PerfCounterEvent


# ---------------------------------------------------------------------------------------------
# Stand-ins for layouts the installed wheel does not have
# ---------------------------------------------------------------------------------------------


class StandInModelState:
    """``EplbModelState`` fields the exporter reads (vLLM 0.12 names and shapes)."""

    def __init__(self, L, E, R, name):
        P = E + R
        self.model = types.SimpleNamespace(num_moe_layers=L, num_logical_experts=E, num_physical_experts=P,
                                           num_local_physical_experts=P)
        p2l = [*range(E), *[i % E for i in range(R)]]
        self.physical_to_logical_map = torch.tensor([p2l] * L)
        cnt = np.bincount(p2l, minlength=E)
        self.logical_replica_count = torch.tensor(np.tile(cnt, (L, 1)))
        self.expert_load_pass = torch.zeros((L, P), dtype=torch.int32)
        self.expert_load_window = torch.zeros((2, L, P), dtype=torch.int32)
        self.model_name = name
        self.rebalanced = False


def make_standin_v012(L=2, E=4, R=2, name="standin/v0.12"):
    """vLLM 0.12-style EplbState: multi-model, no recording gate, step zeroes the pass each step."""

    class EplbState:
        def __init__(self):
            self.model_states = {"h": StandInModelState(L, E, R, name)}
            self.parallel_config = types.SimpleNamespace(
                eplb_config=types.SimpleNamespace(window_size=2, step_interval=1000, num_redundant_experts=R))
            self.is_async = False
            self.expert_rearrangement_step = 0
            self.calls = 0

        def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
            self.calls += 1
            for ms in self.model_states.values():
                if not is_dummy:
                    ms.expert_load_window[self.calls % 2].copy_(ms.expert_load_pass)
                ms.expert_load_pass.zero_()
            self.expert_rearrangement_step += 1

        def rearrange(self, is_profile: bool = False, rank_mapping=None):
            for ms in self.model_states.values():  # swap two experts' replicas in every layer
                ms.physical_to_logical_map[:, -1] = 3
                ms.logical_replica_count.copy_(torch.tensor([[1, 2, 1, 2]] * L))

    return EplbState


def make_standin_v010():
    """vLLM <= 0.11 single-model EplbState: ``step(self, model, ...)``, pass over local slots."""

    class EplbState:
        def __init__(self):
            self.expert_load_pass = torch.zeros((2, 3), dtype=torch.int32)
            self.calls = 0

        def step(self, model, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
            self.calls += 1

        def rearrange(self, model, is_profile: bool = False):
            pass

    return EplbState


def env_without_exporter() -> dict:
    """The environment without the exporter's settings (the source-tree bridge flag stays)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MOE_EPLB_") or k == BRIDGE_ENV}
