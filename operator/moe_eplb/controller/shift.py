"""A workload shift noticed between evaluations (pure; the loop feeds it, :mod:`.autotune`).

Between evaluations the loop measures the engines' balancedness over short windows (one every
:attr:`ShiftSettings.sample_seconds`). When the newest :attr:`ShiftSettings.recent` windows move
away from the windows before them by more than their recent spread allows -- ``k`` robust standard
deviations (median absolute deviation x 1.4826) and at least :attr:`ShiftSettings.min_delta` --
the workload has shifted: the loop evaluates at once on the load since the shift (not the 30-minute
lookback, whose older part no longer describes the load), as soon as that holds enough engine steps,
instead of waiting for ``evaluationIntervalSeconds``.

Each window's balancedness is read over at least :attr:`ShiftSettings.min_read_seconds`, ending at
the window's end: a counter's increase needs two of Prometheus' scrapes in its range, and a window
shorter than that (a tenth of a 15-minute interval on a clock sped up 80 times is about a wall second)
would read nothing. Where the floor is longer than a window, consecutive reads overlap: the windows
stay ``sample_seconds`` apart, and the newest windows judged are as many as it takes for the last
one's read to start after the first one's ended (:attr:`ShiftWatch.recent`): overlapping reads share
their load, so a burst in it moves all of them, and only two reads of disjoint load are two looks.

Balancedness moves with the settings too, so every change the loop makes (live, or a restart)
starts the watch over: windows measured before a change are never compared with windows after it
(nor does a read reach back past the change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moe_eplb.api.autotune_status import iso


@dataclass(frozen=True)
class ShiftSettings:
    """How the watch samples and decides (defaults: one window a minute, each read over at least its
    own length, 6 to 30 windows of history, the 2 newest judged, 4 robust standard deviations and at
    least 0.03 of balancedness)."""

    sample_seconds: float = 60.0
    min_read_seconds: float = 0.0
    min_history: int = 6
    max_history: int = 30
    recent: int = 2
    k: float = 4.0
    min_delta: float = 0.03
    min_spread: float = 0.005


@dataclass(frozen=True)
class Shift:
    """A detected shift: when the moved windows began, and the balancedness before and after."""

    at: float
    before: float
    after: float
    spread: float

    def describe(self) -> str:
        return (f"workload shift: balancedness {self.before:.3f} -> {self.after:.3f} (recent spread {self.spread:.3f}) "
                f"since {iso(self.at)}")


@dataclass
class ShiftWatch:
    """One resource's windows since the last change; :meth:`add` says when a shift shows."""

    settings: ShiftSettings = field(default_factory=ShiftSettings)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (window start, balancedness)
    last_end: float | None = None
    pending: Shift | None = None  # detected, waiting for enough post-shift data
    since: float | None = None  # the last change (reset): no read reaches back past it

    @property
    def recent(self) -> int:
        """How many of the newest windows are judged: ``settings.recent``, and enough that the newest
        one's read starts after the first one's ends (see the module docstring)."""
        s = self.settings
        return max(s.recent, 1 + math.ceil(s.min_read_seconds / s.sample_seconds - 1e-9))

    def due(self, now: float) -> float | None:
        """The start of the next window to measure when one is due (None: not yet): ``sample_seconds``
        after the last one, and ``min_read_seconds`` after the last change."""
        s = self.settings
        start = self.last_end if self.last_end is not None else now - s.sample_seconds
        if now - start < s.sample_seconds or (self.since is not None and now - self.since < s.min_read_seconds):
            return None
        return start

    def window_ends(self, start: float, now: float) -> list[float]:
        """The ends of the windows due from ``start`` (:meth:`due`) to ``now``, ``sample_seconds``
        apart, the last one ending at ``now``; those missed while the loop was busy (an evaluation
        that took minutes of an accelerated clock) included, the newest ``max_history + recent`` at
        most, and none whose read could not reach two scrapes without crossing the last change."""
        s = self.settings
        n = max(1, int((now - start) // s.sample_seconds))
        ends = [start + k * s.sample_seconds for k in range(1, n)] + [now]
        ends = ends[-(s.max_history + self.recent):]
        return [e for e in ends if self.since is None or e - self.since >= s.min_read_seconds] or [now]

    def read_window(self, start: float, end: float) -> tuple[float, float]:
        """What to read for the window ``[start, end]``: at least ``min_read_seconds`` back from its
        end, never before the last change."""
        begin = min(start, end - self.settings.min_read_seconds)
        return (max(begin, self.since) if self.since is not None else begin), end

    def reset(self, now: float) -> None:
        """A change was made (or an evaluation ran on the shift): start the history over from now."""
        self.samples.clear()
        self.last_end = now
        self.since = now
        self.pending = None

    def add(self, start: float, end: float, balancedness: float | None) -> Shift | None:
        """One measured window; returns the shift when the newest windows moved (also kept in
        :attr:`pending` until the loop evaluates)."""
        self.last_end = end
        if balancedness is None or not np.isfinite(balancedness):
            return None
        s, recent = self.settings, self.recent
        self.samples.append((start, float(balancedness)))
        del self.samples[:-(s.max_history + recent)]
        if self.pending is not None or len(self.samples) < s.min_history + recent:
            return None
        shift = detect(self.samples, s, recent)
        if shift is not None:
            self.pending = shift
        return shift


def detect(samples: list[tuple[float, float]], s: ShiftSettings, recent_count: int | None = None) -> Shift | None:
    """The shift in ``samples`` (oldest first), or None: the newest ``recent_count`` values (default
    ``s.recent``), each, against the median and robust spread of those before (see the module docstring)."""
    n = recent_count or s.recent
    values = np.array([v for _, v in samples])
    history, recent = values[:-n], values[-n:]
    median = float(np.median(history))
    spread = max(float(np.median(np.abs(history - median))) * 1.4826, s.min_spread)
    moved = recent - median
    # every recent window beyond the bound, on the same side: one noisy window is not a shift
    bound = max(s.k * spread, s.min_delta)
    if np.all(np.abs(moved) > bound) and (np.all(moved > 0) or np.all(moved < 0)):
        return Shift(at=samples[-n][0], before=median, after=float(recent.mean()), spread=spread)
    return None
