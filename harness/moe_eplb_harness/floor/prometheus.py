"""A real Prometheus server on loopback: the one way the demo, the test suite, the engine scripts and
the benchmarks start one.

:func:`start_prometheus` writes the configuration (a dict; JSON is YAML) into a work folder, starts
the binary with :func:`moe_eplb_harness.floor.procs.spawn` -- its own process group, killed with this process
however it ends -- and returns a :class:`RunningPrometheus` once ``/-/ready`` answers 200
(:func:`moe_eplb_harness.floor.procs.poll_ready`); a server that exits or stays unready is stopped and
the error quotes its log. ``storage`` serves an existing
TSDB (one that ``promtool tsdb create-blocks-from openmetrics`` backfilled).

Only the standard library (``urllib`` for the readiness check).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready

#: where the Debian ``prometheus`` package installs the server (``apt-get install prometheus``)
PROMETHEUS_BIN = "/usr/bin/prometheus"
PROMTOOL_BIN = "/usr/bin/promtool"
#: the override: the path of a ``prometheus`` binary, with its ``promtool`` beside it
PROMETHEUS_ENV = "MOE_EPLB_PROMETHEUS"
#: the project's own build (``make prometheus``: tools/prometheus, Prometheus 3 from its Go module)
BUILT_DIR = pathlib.Path(__file__).resolve().parents[3] / "tools" / "prometheus" / "bin"
#: the one step that provides a pair where none is installed
BUILD_STEP = "make prometheus"


@dataclass(frozen=True)
class PrometheusTools:
    """The Prometheus server and ``promtool`` the tests, the demo and the scripts run (one pair, from
    one place: ``source``), or ``problem``: one line naming what is missing and the step to run."""

    server: str | None
    promtool: str | None
    source: str
    problem: str | None = None


def _executable(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_prometheus(environ: dict[str, str] | None = None, *, executable: Any = _executable, which: Any = shutil.which,
                    debian: tuple[str, str] = (PROMETHEUS_BIN, PROMTOOL_BIN),
                    built: pathlib.Path = BUILT_DIR) -> PrometheusTools:
    """Where the Prometheus server and ``promtool`` are, first found of:

    1. ``$MOE_EPLB_PROMETHEUS`` (a ``prometheus`` binary; ``promtool`` beside it): when set, only it;
    2. the Debian package's (``/usr/bin/prometheus`` and ``/usr/bin/promtool``);
    3. a ``prometheus`` on ``PATH`` with ``promtool`` beside it;
    4. the project's build, ``tools/prometheus/bin`` (``make prometheus``).
    """
    env = (os.environ if environ is None else environ).get(PROMETHEUS_ENV, "").strip()
    if env:
        tool = str(pathlib.Path(env).with_name("promtool"))
        if not executable(env):
            return PrometheusTools(None, None, PROMETHEUS_ENV, f"{PROMETHEUS_ENV}={env}: no executable Prometheus "
                                                              "server there (unset it to use the project's build)")
        if not executable(tool):
            return PrometheusTools(env, None, PROMETHEUS_ENV, f"{PROMETHEUS_ENV}={env}: no executable promtool "
                                                              f"beside it ({tool})")
        return PrometheusTools(env, tool, PROMETHEUS_ENV)
    if all(executable(p) for p in debian):
        return PrometheusTools(*debian, "debian")
    on_path = which("prometheus")
    if on_path and executable(pathlib.Path(on_path).with_name("promtool")):
        return PrometheusTools(on_path, str(pathlib.Path(on_path).with_name("promtool")), "PATH")
    server, tool = built / "prometheus", built / "promtool"
    if executable(server) and executable(tool):
        return PrometheusTools(str(server), str(tool), "built")
    return PrometheusTools(None, None, "none", f"no Prometheus server and promtool: not the Debian package's, none "
                                               f"on PATH, none built in {built} (run `{BUILD_STEP}`)")


def prometheus_binary() -> str | None:
    """Path of the Prometheus server binary (:func:`find_prometheus`), or None."""
    return find_prometheus().server


def promtool_binary() -> str | None:
    """Path of the ``promtool`` that comes with that server (:func:`find_prometheus`), or None."""
    return find_prometheus().promtool


@dataclass
class RunningPrometheus(procs.Stoppable):
    """A Prometheus server :func:`start_prometheus` started: ``url`` is its base URL. ``with`` it (or
    call :meth:`stop`) to end it."""

    url: str
    port: int
    proc: subprocess.Popen[bytes] | None
    log_path: pathlib.Path

    def start(self) -> RunningPrometheus:  # already running: ``with start_prometheus(...) as prom``
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; nothing when it was stopped already."""
        proc, self.proc = self.proc, None
        if proc is not None:
            procs.stop(proc, timeout=5)

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def start_prometheus(workdir: str | os.PathLike[str], config: dict[str, Any], *, binary: str | None = None,
                     storage: str | os.PathLike[str] | None = None, port: int | None = None,
                     timeout: float = 30.0) -> RunningPrometheus:
    """Start Prometheus with ``config`` on loopback (``port``, else a free one); return once it is ready.

    ``workdir`` gets ``prometheus.yml``, ``prometheus.log`` and (unless ``storage`` names another
    folder) the TSDB in ``data/``. Raises RuntimeError naming the log when the server exits or is not
    ready within ``timeout`` s (it is stopped then)."""
    found = None if binary else find_prometheus()
    binary = binary or found.server
    if binary is None:
        raise RuntimeError(found.problem)
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(json.dumps(config, indent=1))
    port = port or free_port()
    prom = RunningPrometheus(f"http://127.0.0.1:{port}", port, None, work / "prometheus.log")
    with open(prom.log_path, "wb") as log:
        prom.proc = procs.spawn(
            [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={storage or work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready() -> str | None:
        with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r:
            return None if r.status == 200 else f"HTTP {r.status}"

    def alive() -> None:
        if prom.proc is not None and prom.proc.poll() is not None:
            raise RuntimeError("exited")

    try:
        why = poll_ready(ready, timeout, alive=alive, interval=0.05)
    except RuntimeError as exc:
        why = str(exc)
    if why is None:
        return prom
    prom.stop()
    raise RuntimeError(f"Prometheus did not start ({why}; log {prom.log_path}): {prom.log_tail()}")


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_eplb_harness.floor.prometheus`` (``make prometheus``): exit 0 naming the pair
    when one is installed (``$MOE_EPLB_PROMETHEUS``, the Debian package's, or on ``PATH``); 1 when the
    project's build is the one to use (built or not: the build is then run, a no-op when current);
    2 with the problem when ``$MOE_EPLB_PROMETHEUS`` names no usable pair."""
    found = find_prometheus()
    if found.source == PROMETHEUS_ENV and found.problem:
        print(f"error: {found.problem}", file=sys.stderr)
        return 2
    if found.source in ("built", "none"):
        return 1
    print(f"prometheus: {found.server} and {found.promtool} ({found.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
