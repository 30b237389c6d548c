"""The ``slow`` tier is a list of paths (tests/conftest.py ``SLOW``): every entry must name a test file
or folder that exists, so a renamed file cannot silently move back into ``make test``."""

from __future__ import annotations

import os

from tests.conftest import ROOT, SLOW


def test_every_slow_entry_exists():
    for entry in SLOW:
        path = os.path.join(ROOT, entry)
        assert (os.path.isdir(path) if entry.endswith("/") else os.path.isfile(path)), entry
        assert entry.startswith("tests/"), entry


def test_the_slow_tier_is_not_the_whole_suite():
    names = set(os.listdir(os.path.join(ROOT, "tests")))
    assert {"api", "render", "eplb", "kube"} <= names
    assert not any(entry.rstrip("/") in ("tests", "tests/kube", "tests/autotune") for entry in SLOW)
