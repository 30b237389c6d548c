"""The test suite's one poller: try a check until it holds, fail saying what was last seen.

``await eventually(check)`` in async tests (``check`` plain or async), ``wait_until(check)`` in
plain ones; both return the first truthy answer. An exception the ``not_yet`` predicate accepts
(default: ``AssertionError``) counts as "not yet" and is re-raised once the time is up; any other
ends the wait at once. ``what`` (a string, or a callable for a description made at failure time)
names the condition in the failure.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _assertion(exc: BaseException) -> bool:
    return isinstance(exc, AssertionError)


class _Poll:
    """The deadline, the last answer and the verdict on each try, shared by both drivers."""

    def __init__(self, timeout: float, what: str | Callable[[], str],
                 not_yet: Callable[[BaseException], bool]) -> None:
        self.timeout, self.what, self.not_yet = timeout, what, not_yet
        self.deadline = time.monotonic() + timeout
        self.last: Any = None

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def took(self, value: Any, error: Exception | None) -> bool:
        """Record one try (its answer, or the exception it raised); True when the answer holds."""
        if error is not None:
            if not self.not_yet(error) or self.expired():
                raise error
            self.last = error
            return False
        self.last = value
        return bool(value)

    def done(self, value: Any, error: Exception | None) -> bool:
        """Record one try; True when it holds, an AssertionError naming the condition once time is up."""
        if self.took(value, error):
            return True
        if self.expired():
            raise self.failure()
        return False

    def failure(self) -> AssertionError:
        what = self.what() if callable(self.what) else self.what
        return AssertionError(f"{what}: not met within {self.timeout:g} s (last: {self.last!r})")


def _call(check: Callable[[], Any]) -> tuple[Any, Exception | None]:
    try:
        return check(), None
    except Exception as exc:  # noqa: BLE001 - judged by not_yet
        return None, exc


async def _settle(awaitable: Any) -> tuple[Any, Exception | None]:
    try:
        return await awaitable, None
    except Exception as exc:  # noqa: BLE001 - judged by not_yet
        return None, exc


def wait_until(check: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05,
               what: str | Callable[[], str] = "condition",
               not_yet: Callable[[BaseException], bool] = _assertion) -> Any:
    """Call ``check()`` every ``interval`` s until it returns something truthy; return that."""
    poll = _Poll(timeout, what, not_yet)
    while not poll.done(*_call(check)):
        time.sleep(interval)
    return poll.last


async def eventually(check: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02,
                     what: str | Callable[[], str] = "condition",
                     not_yet: Callable[[BaseException], bool] = _assertion) -> Any:
    """Await ``check()`` (sync or async) every ``interval`` s until it answers something truthy;
    return that."""
    poll = _Poll(timeout, what, not_yet)
    while True:
        value, error = _call(check)
        if error is None and inspect.isawaitable(value):
            value, error = await _settle(value)
        if poll.done(value, error):
            return value
        await asyncio.sleep(interval)
