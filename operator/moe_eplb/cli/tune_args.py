"""The tuner's command-line values: ``moe-eplb tune``'s flags -> the tuner's one settings object
(:func:`tune_options`: a :class:`~moe_eplb.eplb.tuning.options.TuneOptions`, with ``--bounds`` and
``--memory-budget`` parsed) and ``--current`` text -> :class:`~moe_eplb.api.knobs.Knobs`. Bad text
raises :class:`~moe_eplb.eplb.tuning.tuner.TuneError` naming the flag's field, which ``moe-eplb tune``
reports with exit status 2."""

from __future__ import annotations

from moe_eplb.api.knobs import Bounds, Knobs, KnobsError
from moe_eplb.api.quantity import QuantityError
from moe_eplb.api.quantity import parse_bytes as _parse_quantity_bytes
from moe_eplb.eplb.tuning.options import MIN_TUNE_STEPS, TuneOptions
from moe_eplb.eplb.tuning.tuner import TuneError

__all__ = ["parse_bounds", "parse_bytes", "parse_knobs", "tune_options", "overlap_context"]


def tune_options(*, ep_size: int, nodes: int, groups: int, memory_budget: str | None, bounds: str | None,
                 bytes_per_expert: float | None, min_gain: float, workers: int | None, min_steps: int | None,
                 replicas: int | None) -> TuneOptions:
    """``moe-eplb tune``'s flags as the tuner's options (``--memory-budget`` and ``--bounds`` text
    parsed; ``--min-steps`` and ``--replicas`` not given: the tuner's default and one replica)."""
    return TuneOptions(
        ep_size=ep_size, num_nodes=nodes, num_groups=groups,
        memory_budget_bytes=parse_bytes(memory_budget) if memory_budget is not None else None,
        bytes_per_expert=bytes_per_expert, bounds=parse_bounds(bounds) if bounds else Bounds(),
        min_gain=min_gain, workers=workers, min_steps=MIN_TUNE_STEPS if min_steps is None else min_steps,
        replicas=replicas or 1)


def parse_bounds(text: str) -> Bounds:
    """``"window=500:5000,interval=500:10000,redundant=0:32"`` -> Bounds (any subset; an end may
    be left empty: ``window=:4000``)."""
    names = {"window": "window", "interval": "interval", "redundant": "redundant"}
    values: dict[str, tuple[int | None, int | None]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, rng = part.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise TuneError(
                f"bounds: {part!r} is not NAME=LO:HI with NAME one of window, interval, redundant"
            )
        lo, sep, hi = rng.partition(":")
        if not sep:
            lo = hi = rng
        try:
            pair = tuple(int(v) if v.strip() else None for v in (lo, hi))
        except ValueError:
            raise TuneError(f"bounds.{key}: {rng!r} is not LO:HI with whole numbers") from None
        values[key] = pair  # type: ignore[assignment]
    try:
        return Bounds(**values)
    except KnobsError as exc:
        raise TuneError(str(exc)) from None


def parse_bytes(text: str) -> int:
    """Bytes from plain digits (``8589934592``), a Kubernetes quantity (``8Gi``, ``500M``) or those
    with a trailing ``B`` (``8GiB``, ``8GB``) (:func:`moe_eplb.api.quantity.parse_bytes`)."""
    try:
        return _parse_quantity_bytes(text, "memory_budget")
    except QuantityError as exc:
        raise TuneError(str(exc)) from None


def parse_knobs(text: str) -> Knobs:
    """``"W,I,R"`` -> Knobs (window size, step interval, redundant experts)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise TuneError(f"current: {text!r} is not W,I,R (window,interval,redundant), e.g. 1000,3000,0")
    try:
        w, i, r = (int(p) for p in parts)
        return Knobs(w, i, r)
    except (ValueError, KnobsError) as exc:
        raise TuneError(f"current: {text!r}: {exc}") from None


def overlap_context(trace_model: str | None, *, model: str | None, backend: str | None, version_text: str | None,
                    vendor: str | None, shared_expert_ratio: float | None, nodes: int, ep_size: int):
    """``tune``'s shared-expert overlap (:func:`moe_eplb.eplb.tuning.overlap.context_for`): the model
    (``--model``, else the trace's), vLLM's rule for ``--all2all-backend`` in ``--vllm-version`` (default
    the newest release read) and the overlap-safe backends GPUs of ``--gpu-vendor`` run. Bad text raises
    :class:`TuneError` naming the flag."""
    from moe_eplb.api import vllm_cli, wide_ep
    from moe_eplb.api.versions import parse_version
    from moe_eplb.eplb.tuning.overlap import context_for

    version = parse_version(version_text) if version_text else vllm_cli.known()[-1]
    if version is None:
        raise TuneError(f"vllm_version: {version_text!r} is not a version like 0.34.0")
    if backend is not None and backend not in wide_ep.ALL2ALL_SINCE:
        raise TuneError(f"all2all_backend: {backend!r} is not one of vLLM's backends "
                        f"({', '.join(wide_ep.ALL2ALL_BACKENDS)})")
    if shared_expert_ratio is not None and not 0 <= shared_expert_ratio <= 4:
        raise TuneError(f"shared_expert_ratio: must be within 0..4, got {shared_expert_ratio}")
    resource = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}.get(vendor or "")
    return context_for(model or trace_model, backend, version, gpu_resource_name=resource, nodes=nodes,
                       data_parallel=ep_size, shared_expert_ratio=shared_expert_ratio)
