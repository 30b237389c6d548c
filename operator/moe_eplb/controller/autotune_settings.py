"""Process-wide settings of the tuning loop (:class:`AutotuneSettings`) and its clock.

The operator builds them from the environment (:meth:`AutotuneSettings.from_env`); the demo and the
tests pass their own to the :class:`~moe_eplb.controller.handlers.Controller` (an accelerated clock,
a fast tick, an observer). Spec durations are in the clock's seconds; Prometheus is queried in wall
time (``clock.to_wall``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from moe_eplb.api.spec import MoEInference
from moe_eplb.eplb.tuning.options import TuneOptions

#: The operator's search (a reduced ladder of the tuner's, 27 candidates, the 6 best of the screening
#: re-scored on every layer) on the last 30 minutes of load, sized so one core evaluates >= 200
#: resources every 5 minutes (bench/bench_autotune.py). Override with MOE_EPLB_AUTOTUNE_SEARCH=full
#: and MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS. The deployment's fields (``ep_size``, ``bounds``, ...) are
#: each resource's, filled in per evaluation (``controller.autotune.run_tuner``).
OPERATOR_SEARCH = TuneOptions(windows=(250, 1000, 4000), intervals=(500, 2000, 8000), max_redundancy_levels=3,
                              segments=4, finalists=6)


class Clock(Protocol):
    """The loop's clock: ``now()`` in its seconds, ``to_wall(t)`` to wall (POSIX) seconds and
    ``scale`` (its seconds per wall second). An accelerated clock (:class:`moe_eplb_harness.engines.engine.SimClock`)
    also has ``to_sim(wall)``, the inverse of ``to_wall``."""

    scale: float

    def now(self) -> float: ...

    def to_wall(self, t: float) -> float: ...


class WallClock:
    """The real clock (POSIX seconds); the default."""

    scale = 1.0

    @staticmethod
    def now() -> float:
        return time.time()

    @staticmethod
    def to_wall(t: float) -> float:
        return t


@dataclass
class AutotuneSettings:
    """Process-wide settings of the loop (the demo and tests replace parts of them).

    Attributes:
        clock: ``now()`` and ``to_wall(t)``; spec durations are in its seconds.
        tick_seconds: wall seconds between two ticks of one resource's timer.
        lookback_seconds: how much load history (clock seconds) the tuner sees.
        search: the tuner's search (:class:`~moe_eplb.eplb.tuning.options.TuneOptions`: its ladders,
            screening and decision rules; the deployment's fields are each resource's). Its
            ``min_steps`` is also the loop's: fewer engine steps in the history -> ``NoData``.
        bucket_seconds: bucket length (clock seconds) of the load read for the tuner; also how
            often pods are scraped when there is no Prometheus.
        min_wall_bucket_seconds: floor of the bucket in wall seconds (>= 2 scrape intervals when
            the clock is accelerated).
        crashloop_restarts: restarts of a pod of the new template that count as a crash loop.
        observer: called with ``(kind, resource, record)`` after each successful write
            (``evaluation`` with the :class:`Evaluation`, ``history`` with a finished rollout's
            :class:`HistoryEntry`, ``rollout`` with a phase change's :class:`Rollout`) -- the demo
            prints these.
        http_timeout: seconds for a Prometheus or pod scrape request.
        prometheus_budget_seconds: wall seconds one read of the load (or one measurement) may spend
            on Prometheus, retries of transient errors included.
    """

    clock: Clock = field(default_factory=WallClock)
    tick_seconds: float = 15.0
    lookback_seconds: float = 1800.0
    search: TuneOptions = OPERATOR_SEARCH
    crashloop_restarts: int = 3
    observer: Callable[[str, MoEInference, Any], None] | None = None
    http_timeout: float = 10.0
    prometheus_budget_seconds: float = 30.0
    bucket_seconds: float = 15.0
    min_wall_bucket_seconds: float = 0.0

    @classmethod
    def from_env(cls) -> AutotuneSettings:
        """Defaults, with ``MOE_EPLB_AUTOTUNE_TICK_SECONDS``, ``MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS``
        and ``MOE_EPLB_AUTOTUNE_SEARCH=full`` (the tuner's full ladder) applied."""
        settings = cls()
        if os.environ.get("MOE_EPLB_AUTOTUNE_TICK_SECONDS"):
            settings.tick_seconds = float(os.environ["MOE_EPLB_AUTOTUNE_TICK_SECONDS"])
        if os.environ.get("MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS"):
            settings.lookback_seconds = float(os.environ["MOE_EPLB_AUTOTUNE_LOOKBACK_SECONDS"])
        if os.environ.get("MOE_EPLB_AUTOTUNE_SEARCH") == "full":
            settings.search = TuneOptions()
        return settings

    @property
    def min_steps(self) -> int:
        """Fewest engine steps in the history the loop tunes on (``search.min_steps``)."""
        return self.search.min_steps

    @property
    def scale(self) -> float:
        """The clock's seconds per wall second (1 on the real clock)."""
        return float(getattr(self.clock, "scale", 1.0) or 1.0)

    def to_clock(self, wall: float) -> float:
        """Wall (POSIX) seconds -> the clock's seconds."""
        to_sim = getattr(self.clock, "to_sim", None)
        return to_sim(wall) if to_sim is not None else wall
