"""Fixtures of the real-engine tier (markers ``vllm_engine`` and ``integration``).

* The tier is skipped only when the vLLM CPU wheel cannot be imported (the reason says what is
  missing). With ``MOE_EPLB_REQUIRE_VLLM_ENGINE=1`` (``.ci/run`` sets it) that is a failure instead,
  and so is a missing Prometheus binary: CI must run this tier, never silently skip it.
* ``tiny_model`` / ``bridge_dir``: built once per session in a temporary directory.
* Engines are module-scoped (one per test module, ~30 s to start on two cores); each module's
  fixture stops its engine's whole process group on teardown.
* Timings (engine start, workloads, the whole tier) are collected and printed in the terminal
  summary, and written to ``$MOE_EPLB_ENGINE_TIMINGS`` (JSON) when that is set.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from moe_eplb_harness.floor.prometheus import find_prometheus
from moe_eplb_harness.vllm_engine import harness

REQUIRE_ENV = "MOE_EPLB_REQUIRE_VLLM_ENGINE"
TIMINGS: dict[str, float] = {}
NOTES: dict[str, str] = {}
_T0: list[float] = []


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> None:
    if _required():
        pytest.fail(f"{REQUIRE_ENV} is set, so the real-engine tier must run, but: {reason}", pytrace=False)
    pytest.skip(reason)


def record_time(name: str, seconds: float) -> None:
    TIMINGS[name] = round(seconds, 2)


def record_note(name: str, text: str) -> None:
    """A measured fact worth reading in the summary (not a time)."""
    NOTES[name] = text


@pytest.fixture(scope="session")
def cpu_wheel() -> None:
    problem = harness.cpu_wheel_problem()
    if problem:
        skip_or_fail(problem)
    if not _T0:
        _T0.append(time.monotonic())


@pytest.fixture(scope="session")
def prometheus_binary(cpu_wheel) -> str:
    if not os.path.exists(harness.PROMETHEUS):
        skip_or_fail(find_prometheus().problem or f"no Prometheus binary at {harness.PROMETHEUS}")
    return harness.PROMETHEUS


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory, cpu_wheel) -> str:
    return str(tmp_path_factory.mktemp("vllm-engine"))


@pytest.fixture(scope="session")
def tiny_model(engine_root) -> str:
    from moe_eplb_harness.vllm_engine import tiny_model as tm

    t0 = time.monotonic()
    path = tm.build_tiny_moe(os.path.join(engine_root, "tiny-qwen3-moe"))
    record_time("build tiny model", time.monotonic() - t0)
    return path


@pytest.fixture(scope="session")
def bridge_dir(engine_root) -> str:
    return harness.bridge_site(os.path.join(engine_root, "bridge-site"))


def pytest_terminal_summary(terminalreporter):
    if not TIMINGS:
        return
    if _T0:
        record_time("vllm_engine tier (first fixture to summary)", time.monotonic() - _T0[0])
    terminalreporter.write_sep("-", f"real-engine timings ({harness.LABEL}), seconds")
    for k, v in TIMINGS.items():
        terminalreporter.write_line(f"{k:55s} {v:8.2f}")
    for k, v in NOTES.items():
        terminalreporter.write_line(f"{k}: {v}")
    out = os.environ.get("MOE_EPLB_ENGINE_TIMINGS")
    if out:
        with open(out, "w") as f:
            json.dump({"seconds": TIMINGS, "notes": NOTES}, f, indent=1)
