"""Which vLLM EPLB state layout a worker runs, found by looking at the objects (not version strings).

Supported: vLLM 0.12.0 through 0.34 (the first release with the seed change through the newest
tested). Layouts handled explicitly:

==================  =================  ===========================================================
layout              vLLM               what differs
==================  =================  ===========================================================
``multi-model``     0.12 - ~0.2x       ``EplbState.model_states: dict[str, EplbModelState]``;
                                       ``expert_load_pass [L, P]`` over all physical slots;
                                       ``step(is_dummy, is_profile, log_stats)``; every step records
``multi-model-gated`` ~0.2x - 0.34     as above, plus ``EplbState.should_record_tensor`` (a shared
                                       bool the router reads): vLLM records only the last
                                       ``window_size`` steps before a rearrangement, so the exporter
                                       turns recording on every step (see docs/exporter.md). From
                                       0.34 vLLM writes the flag only when its own value flips
                                       (``_should_record_value``); the exporter still writes it
                                       after every step, so it stays on either way
==================  =================  ===========================================================

Anything else (the single-model ``EplbState`` of vLLM <= 0.11 with ``step(model, ...)``, a load
pass over local slots only, missing attributes) is :class:`UnsupportedLayout`: the exporter logs
it once and exports nothing for that process; the engine keeps running.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moe_eplb.contracts.vllm_facts import ASYNC_WORKER_ERROR_ATTR


class UnsupportedLayout(RuntimeError):
    """The EPLB state does not look like any supported vLLM version's."""


SUPPORTED_VLLM = ">=0.12.0,<=0.34.x"


@dataclass
class ModelHandle:
    """Accessors for one model's EPLB state (one ``EplbModelState``). Tensors are read through the
    state every time because vLLM may replace a view (elastic EP) or refill it in place."""

    key: str
    state: Any
    name: str  # the model_name label: vLLM's served model name (see served_names)
    num_layers: int
    num_experts: int  # logical experts E
    top_k: int | None = None  # experts per token (FusedMoE.top_k of the first MoE layer), if known

    @property
    def load_pass(self):  # int32 [L, P], this rank's tokens routed to every physical slot this step
        return self.state.expert_load_pass

    @property
    def physical_to_logical(self):  # int [L, P], -1 = empty slot (elastic EP)
        return self.state.physical_to_logical_map

    @property
    def replica_count(self):  # int [L, E]
        return self.state.logical_replica_count

    @property
    def num_physical_experts(self) -> int:
        return int(self.state.expert_load_pass.shape[1])

    @property
    def rebalancing(self) -> bool:
        """Async EPLB: new maps computed and layers still being moved."""
        return bool(getattr(self.state, "rebalanced", False))


@dataclass
class EplbLayout:
    name: str
    models: list[ModelHandle]
    gated: bool  # has should_record_tensor
    is_async: bool
    window_size: int | None
    step_interval: int | None
    num_redundant_experts: int | None
    #: vLLM reports async worker failures and times async cycles itself (0.34+: :mod:`.health`)
    health_signals: bool = False


NAMES_ATTR = "_moe_eplb_names"  # set on the EplbState by the hook's add_model wrapper


def _top_k(model: Any) -> int | None:
    try:
        return int(model.moe_layers[0].top_k)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _served_names(handles: list[ModelHandle], names: dict) -> None:
    """Name each model as vLLM's own metrics do (label ``model_name``): the main model by its served
    name (``--served-model-name``, else the model path); a drafter registered under an explicit EPLB
    name (vLLM 0.32: ``"<path> (draft)"``) by ``"<served name> (draft)"``. ``names`` maps a
    ``model_states`` key to ``(served_model_name, explicit EPLB name or None)`` as the hook saw
    ``add_model``; models it did not see keep vLLM's EPLB name (the model path)."""
    main = next((names[h.key][0] for h in handles if h.key in names and names[h.key][1] is None
                 and names[h.key][0]), None)
    for h in handles:
        served, explicit = names.get(h.key, (None, None))
        if explicit is None and served:
            h.name = served
        elif explicit is not None and main:
            h.name = f"{main} (draft)"


def check_step_signature(step: Callable) -> None:
    """``EplbState.step`` must be ``step(self, is_dummy=..., is_profile=..., log_stats=...)``."""
    try:
        params = list(inspect.signature(step).parameters)
    except (TypeError, ValueError) as exc:
        raise UnsupportedLayout(f"cannot read the signature of EplbState.step: {exc}") from None
    if params[:3] != ["self", "is_dummy", "is_profile"]:
        raise UnsupportedLayout(
            f"EplbState.step{tuple(params)} is not step(self, is_dummy, is_profile, ...): "
            f"vLLM <= 0.11 (single-model EPLB state) is not supported; use vLLM {SUPPORTED_VLLM}"
        )


def eplb_config_of(eplb_state: Any) -> tuple[int | None, int | None, int | None]:
    """(window_size, step_interval, num_redundant_experts) of the running EPLB config."""
    pc = getattr(eplb_state, "parallel_config", None)
    cfg = getattr(pc, "eplb_config", None)
    if cfg is not None:
        return (getattr(cfg, "window_size", None), getattr(cfg, "step_interval", None),
                getattr(cfg, "num_redundant_experts", None))
    if pc is not None:  # flat fields (vLLM <= 0.10.1), kept for stand-ins
        return (getattr(pc, "eplb_window_size", None), getattr(pc, "eplb_step_interval", None),
                getattr(pc, "num_redundant_experts", None))
    return (None, None, None)


def detect(eplb_state: Any) -> EplbLayout:
    """Describe ``eplb_state`` or raise :class:`UnsupportedLayout` saying what is missing."""
    model_states = getattr(eplb_state, "model_states", None)
    if not isinstance(model_states, dict):
        raise UnsupportedLayout(
            "EplbState has no model_states dict (single-model layout of vLLM <= 0.11); "
            f"supported: vLLM {SUPPORTED_VLLM}"
        )
    if not model_states:
        raise UnsupportedLayout("EplbState.model_states is empty (no MoE model registered yet)")
    handles = []
    for key, ms in model_states.items():
        for attr in ("expert_load_pass", "physical_to_logical_map", "logical_replica_count", "model"):
            if not hasattr(ms, attr):
                raise UnsupportedLayout(f"EplbModelState has no {attr!r}; supported: vLLM {SUPPORTED_VLLM}")
        model = ms.model
        load_pass, p2l, cnt = ms.expert_load_pass, ms.physical_to_logical_map, ms.logical_replica_count
        try:
            num_layers = int(model.num_moe_layers)
            num_experts = int(model.num_logical_experts)
            num_physical = int(model.num_physical_experts)
        except (AttributeError, TypeError, ValueError) as exc:
            raise UnsupportedLayout(f"MoE model lacks expert counts: {exc}") from None
        if getattr(load_pass, "ndim", None) != 2 or tuple(load_pass.shape) != (num_layers, num_physical):
            raise UnsupportedLayout(
                f"expert_load_pass has shape {tuple(getattr(load_pass, 'shape', ()))}, expected "
                f"(num_moe_layers={num_layers}, num_physical_experts={num_physical}) "
                "(a per-local-slot pass is the vLLM <= 0.10 layout)"
            )
        if tuple(p2l.shape) != tuple(load_pass.shape):
            raise UnsupportedLayout(
                f"physical_to_logical_map shape {tuple(p2l.shape)} != expert_load_pass shape {tuple(load_pass.shape)}"
            )
        if tuple(cnt.shape) != (num_layers, num_experts):
            raise UnsupportedLayout(
                f"logical_replica_count shape {tuple(cnt.shape)} != ({num_layers}, {num_experts})"
            )
        handles.append(ModelHandle(key=str(key), state=ms, name=str(getattr(ms, "model_name", None) or key),
                                   num_layers=num_layers, num_experts=num_experts, top_k=_top_k(model)))
    _served_names(handles, eplb_state.__dict__.get(NAMES_ATTR) or {})
    gated = hasattr(eplb_state, "should_record_tensor")
    window, interval, redundant = eplb_config_of(eplb_state)
    return EplbLayout(
        name="multi-model-gated" if gated else "multi-model",
        models=handles,
        gated=gated,
        is_async=bool(getattr(eplb_state, "is_async", False)),
        window_size=window,
        step_interval=interval,
        num_redundant_experts=redundant,
        health_signals=hasattr(eplb_state, ASYNC_WORKER_ERROR_ATTR),
    )
