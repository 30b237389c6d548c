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
import urllib.request
from dataclasses import dataclass
from typing import Any

from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready

#: where the Debian ``prometheus`` package installs the server (``apt-get install prometheus``)
PROMETHEUS_BIN = "/usr/bin/prometheus"
PROMTOOL_BIN = "/usr/bin/promtool"


def _binary(path: str, name: str) -> str | None:
    return path if os.path.exists(path) else shutil.which(name)


def prometheus_binary() -> str | None:
    """Path of a Prometheus server binary (the Debian package's, else one on ``PATH``), or None."""
    return _binary(PROMETHEUS_BIN, "prometheus")


def promtool_binary() -> str | None:
    """Path of ``promtool`` (it comes with the server), or None."""
    return _binary(PROMTOOL_BIN, "promtool")


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
    binary = binary or prometheus_binary()
    if binary is None:
        raise RuntimeError("no Prometheus binary (apt-get install prometheus)")
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
