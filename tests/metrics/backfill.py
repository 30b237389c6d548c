"""A real Prometheus serving counters backfilled with ``promtool tsdb create-blocks-from
openmetrics`` (the reader tests' data source): ``with backfilled_prometheus(work, text) as url``."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from moe_eplb_harness.floor.prometheus import prometheus_binary, promtool_binary, start_prometheus

PROMETHEUS = prometheus_binary()
PROMTOOL = promtool_binary()


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


@contextlib.contextmanager
def backfilled_prometheus(work: Path, openmetrics: str, ready_timeout: float = 30.0) -> Iterator[str]:
    """Backfill ``openmetrics`` (OpenMetrics text with timestamps, ``# EOF`` last) into a TSDB
    under ``work`` and serve it on loopback; yields the base URL, stops the server on exit."""
    (work / "data.om").write_text(openmetrics)
    subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(work / "data.om"), str(work / "data")],
                   check=True, capture_output=True, timeout=60)
    with start_prometheus(work, {"global": {"scrape_interval": "1h"}}, storage=work / "data",
                          timeout=ready_timeout) as prom:
        yield prom.url
