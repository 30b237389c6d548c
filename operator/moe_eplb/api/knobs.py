"""The three EPLB settings vLLM fixes at start-up, and ranges of them: one type each, everywhere.

:class:`Knobs` (window size, step interval, redundant experts) is what the spec sets, what the
tuner searches, recommends and records, what the simulator replays and what the simulated engines
run; :class:`Bounds` is the range the tuner may search (``spec.autotune.bounds``, ``tune --bounds``).
The CRD spells them ``windowSize``/``stepInterval``/``numRedundantExperts``; the conversion happens
at the boundary only (:mod:`moe_eplb.api.convert`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_eplb.contracts import vllm_facts


class KnobsError(ValueError):
    """Knobs or bounds that cannot be used; the message names the field and what it must be."""


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise KnobsError(f"{name}: must be a whole number, got {value!r}")
    value = int(value)  # numpy integers too
    if value < minimum:
        raise KnobsError(f"{name}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Knobs:
    """EPLB's window (engine steps of load history), interval (engine steps between
    rearrangements) and redundant experts (extra replicas per MoE layer)."""

    window_size: int
    step_interval: int
    num_redundant_experts: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_size", _whole("window_size", self.window_size, 1))
        object.__setattr__(self, "step_interval", _whole("step_interval", self.step_interval, 1))
        object.__setattr__(self, "num_redundant_experts",
                           _whole("num_redundant_experts", self.num_redundant_experts, 0))

    @property
    def label(self) -> str:
        """``W/I/R``, e.g. ``1000/3000/0``."""
        return f"{self.window_size}/{self.step_interval}/{self.num_redundant_experts}"

    def describe(self) -> str:
        """``window W, interval I, redundant R`` (for messages and events)."""
        return f"window {self.window_size}, interval {self.step_interval}, redundant {self.num_redundant_experts}"

    def to_dict(self) -> dict[str, int]:
        """The snake_case mapping of the tuner's and simulator's JSON output."""
        return {"window_size": self.window_size, "step_interval": self.step_interval,
                "num_redundant_experts": self.num_redundant_experts}


#: vLLM's EPLBConfig defaults (vLLM 0.32 and 0.33).
VLLM_DEFAULTS = Knobs(vllm_facts.DEFAULT_WINDOW_SIZE, vllm_facts.DEFAULT_STEP_INTERVAL,
                      vllm_facts.DEFAULT_NUM_REDUNDANT_EXPERTS)
#: The hand-picked settings of vLLM PR #28849 (Qwen3-VL-MoE; +4 % throughput measured).
SEED_CONFIG = Knobs(vllm_facts.SEED_WINDOW_SIZE, vllm_facts.SEED_STEP_INTERVAL, vllm_facts.SEED_NUM_REDUNDANT_EXPERTS)

Range = tuple[int | None, int | None]


@dataclass(frozen=True)
class Bounds:
    """Inclusive ranges for the search; a ``None`` end means "no limit of its own" (the tuner then
    uses its ladder's end). ``redundant`` with no upper end: at most two extra experts per GPU,
    at most half the experts (the tuner's default)."""

    window: Range = (None, None)
    interval: Range = (None, None)
    redundant: Range = (None, None)

    def __post_init__(self) -> None:
        for name in ("window", "interval", "redundant"):
            lo, hi = getattr(self, name)
            floor = 0 if name == "redundant" else 1
            for v in (lo, hi):
                if v is not None and (isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < floor):
                    raise KnobsError(f"bounds.{name}: {v!r} is not a whole number >= {floor}")
            if lo is not None and hi is not None and lo > hi:
                raise KnobsError(f"bounds.{name}: lower end {lo} is above upper end {hi}")
            object.__setattr__(self, name, tuple(None if v is None else int(v) for v in (lo, hi)))

    def allows(self, knobs: Knobs) -> bool:
        """Whether every value of ``knobs`` lies within its range."""
        def inside(v: int, rng: Range) -> bool:
            return (rng[0] is None or v >= rng[0]) and (rng[1] is None or v <= rng[1])

        return (inside(knobs.window_size, self.window) and inside(knobs.step_interval, self.interval)
                and inside(knobs.num_redundant_experts, self.redundant))

    def to_dict(self) -> dict[str, list[int | None]]:
        return {k: list(getattr(self, k)) for k in ("window", "interval", "redundant")}

    def with_redundancy_floor(self, floor: int) -> Bounds:
        """These bounds with the redundancy's lower end raised to ``floor`` (a hard lower bound, e.g.
        the fault-tolerance floor: the tuner then never proposes less). The floor wins over an upper
        end below it (validation refuses such bounds; the tuner still never goes below the floor)."""
        lo, hi = self.redundant
        if floor <= 0 or (lo is not None and lo >= floor):
            return self
        return Bounds(self.window, self.interval, (floor, hi if hi is None or hi >= floor else floor))
