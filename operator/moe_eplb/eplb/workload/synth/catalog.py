"""What the generator is asked for: the model shapes (:data:`MODEL_SHAPES`, :func:`resolve_shape`),
the workload profiles by name (:func:`list_profiles`, :func:`get_profile`) and :class:`SynthError`."""

from __future__ import annotations

from collections.abc import Sequence

from moe_eplb.eplb.workload import profiles as _profiles
from moe_eplb.eplb.workload.profiles import (
    Profile,
)

# name -> (MoE layers, routed experts per layer, expert groups, top_k)
MODEL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "deepseek-v3": (58, 256, 8, 8),
    "qwen3-vl-30b-a3b": (48, 128, 1, 8),
}


_CHUNK = 64  # buckets generated at a time


class SynthError(ValueError):
    """A generator request that cannot be met; the message names the argument and the fix."""


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(_profiles.BUILTIN_PROFILES)


def get_profile(name: str) -> Profile:
    """The built-in profile ``name``; unknown names list the valid ones."""
    try:
        return _profiles.BUILTIN_PROFILES[name]
    except KeyError:
        raise SynthError(f"profile: unknown profile {name!r}; choose one of: {', '.join(list_profiles())}") from None


def resolve_shape(model_shape: str | Sequence[int]) -> tuple[str, tuple[int, int, int, int]]:
    """``name`` or ``(layers, experts, groups, top_k)`` -> (label, shape)."""
    if isinstance(model_shape, str):
        if model_shape not in MODEL_SHAPES:
            raise SynthError(f"model_shape: unknown shape {model_shape!r}; choose one of: {', '.join(MODEL_SHAPES)}")
        return model_shape, MODEL_SHAPES[model_shape]
    shape = tuple(int(x) for x in model_shape)
    if len(shape) == 3:
        shape = (shape[0], shape[1], 1, shape[2])
    if len(shape) != 4 or min(shape) <= 0:
        raise SynthError(f"model_shape: expected (layers, experts, groups, top_k) > 0, got {model_shape!r}")
    layers, experts, groups, top_k = shape
    if experts % groups:
        raise SynthError(f"model_shape: {experts} experts do not split into {groups} groups")
    if top_k > experts:
        raise SynthError(f"model_shape: top_k {top_k} is more than {experts} experts")
    return f"{layers}x{experts}-top{top_k}", shape  # type: ignore[return-value]
