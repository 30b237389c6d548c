"""A real Prometheus serving counters backfilled with ``promtool tsdb create-blocks-from
openmetrics`` (the reader tests' data source): ``with backfilled_prometheus(work, text) as url``."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)


def openmetrics_text(families: dict[str, list[str]]) -> str:
    """OpenMetrics text for ``promtool tsdb create-blocks-from openmetrics``: each family's sample
    lines under its ``# TYPE`` line (``*_total`` families are counters, the others gauges), then
    ``# EOF``."""
    lines = []
    for name, rows in families.items():
        counter = name.endswith("_total")
        lines.append(f"# TYPE {name.removesuffix('_total')} counter" if counter else f"# TYPE {name} gauge")
        lines += rows
    return "\n".join(lines + ["# EOF"]) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def backfilled_prometheus(work: Path, openmetrics: str, ready_timeout: float = 30.0) -> Iterator[str]:
    """Backfill ``openmetrics`` (OpenMetrics text with timestamps, ``# EOF`` last) into a TSDB
    under ``work`` and serve it on loopback; yields the base URL, stops the server on exit."""
    (work / "data.om").write_text(openmetrics)
    subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(work / "data.om"), str(work / "data")],
                   check=True, capture_output=True, timeout=60)
    (work / "p.yml").write_text("global:\n  scrape_interval: 1h\n")
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'p.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("prometheus did not become ready")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
