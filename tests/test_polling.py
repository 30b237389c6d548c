"""The one poller (tests/polling.py): first truthy answer back, "not yet" exceptions retried and
re-raised at the end, others at once, and a failure that names the condition and the last answer."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest

from tests.kube.conftest import not_found
from tests.polling import eventually, wait_until


def counter(ready_at: int):
    calls = {"n": 0}

    def check() -> int:
        calls["n"] += 1
        assert calls["n"] >= ready_at, f"try {calls['n']}"
        return calls["n"]

    return check


def test_wait_until_returns_the_first_truthy_answer_after_failed_tries():
    assert wait_until(counter(3), timeout=5, interval=0.001) == 3


def test_wait_until_names_the_condition_and_the_last_answer():
    with pytest.raises(AssertionError, match=r"the queue drained: not met within 0.05 s \(last: \[\]\)"):
        wait_until(lambda: [], timeout=0.05, interval=0.01, what="the queue drained")


def test_a_not_yet_error_is_raised_itself_once_time_is_up():
    with pytest.raises(AssertionError, match="try"):
        wait_until(counter(10**9), timeout=0.05, interval=0.01)


def test_other_errors_end_the_wait_at_once():
    calls = []

    def check():
        calls.append(1)
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        wait_until(check, timeout=5)
    assert len(calls) == 1


def test_a_custom_not_yet_predicate():
    answers = iter([urllib.error.HTTPError("u", 404, "gone", {}, None), "there"])

    def check():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_until(check, timeout=5, interval=0.001, not_yet=not_found) == "there"
    with pytest.raises(urllib.error.HTTPError):
        wait_until(lambda: (_ for _ in ()).throw(urllib.error.HTTPError("u", 500, "x", {}, None)),
                   timeout=5, not_yet=not_found)


def test_eventually_awaits_async_checks_and_describes_late():
    async def check():
        return 7

    assert asyncio.run(eventually(check, timeout=1)) == 7
    seen = {"last": "nothing yet"}

    async def never():
        seen["last"] = "still starting"
        return None

    with pytest.raises(AssertionError, match="status: still starting"):
        asyncio.run(eventually(never, timeout=0.05, what=lambda: f"status: {seen['last']}"))
