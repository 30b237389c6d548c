"""Exporter settings, read from environment variables (the only way to configure a vLLM plugin).

=====================================  ==========  ===============================================
variable                               default     meaning
=====================================  ==========  ===============================================
``MOE_EPLB_EXPORTER_MODE``             ``full``    ``full``, ``reduced`` (fewer series) or ``off``
``MOE_EPLB_EXPORTER_PORT``             ``9400``    port of the dedicated ``/metrics`` server
``MOE_EPLB_EXPORTER_ADDRESS``          ``0.0.0.0`` address it binds
``MOE_EPLB_EXPORTER_DIR``              (temp dir)  per-pod directory the workers write to (default: a
                                                   new directory in /dev/shm, else in $TMPDIR)
``MOE_EPLB_EXPORTER_FLUSH_SECONDS``    ``1.0``     how often a worker reads its counters back
``MOE_EPLB_BALANCEDNESS_WINDOW_SECONDS`` ``60``    window of the balancedness gauge
``MOE_EPLB_TRACE_DIR``                 (unset)     write the load as trace files here (opt-in)
``MOE_EPLB_TRACE_BUCKET_SECONDS``      ``10``      length of one trace bucket
``MOE_EPLB_TRACE_MAX_BUCKETS``         ``360``     buckets per trace file before a new file starts
``MOE_EPLB_LIVE_APPLY``                ``on``      ``off``: no live change of window and interval in
                                                   this pod (no route, no watcher in the workers)
=====================================  ==========  ===============================================

``MOE_EPLB_EXPORTER_SERVER_PID`` and ``MOE_EPLB_EXPORTER_START_TIME`` are internal: the first vLLM
process that loads the plugin sets them (with ``MOE_EPLB_EXPORTER_DIR``) so that its child
processes (engine core, workers) know they are not the one that serves the port, and all report the
same counter start time (``moe_eplb_exporter_start_time_seconds``; workers starting their counters
at slightly different moments must not look like a restart to Prometheus and the load reader).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from moe_eplb.contracts import k8s_names

ENV_MODE = "MOE_EPLB_EXPORTER_MODE"
ENV_PORT = "MOE_EPLB_EXPORTER_PORT"
ENV_ADDRESS = "MOE_EPLB_EXPORTER_ADDRESS"
ENV_DIR = "MOE_EPLB_EXPORTER_DIR"
ENV_FLUSH_SECONDS = "MOE_EPLB_EXPORTER_FLUSH_SECONDS"
ENV_BALANCEDNESS_WINDOW = "MOE_EPLB_BALANCEDNESS_WINDOW_SECONDS"
ENV_TRACE_DIR = "MOE_EPLB_TRACE_DIR"
ENV_TRACE_BUCKET_SECONDS = "MOE_EPLB_TRACE_BUCKET_SECONDS"
ENV_TRACE_MAX_BUCKETS = "MOE_EPLB_TRACE_MAX_BUCKETS"
ENV_SERVER_PID = "MOE_EPLB_EXPORTER_SERVER_PID"
ENV_START_TIME = "MOE_EPLB_EXPORTER_START_TIME"  # internal: when the pod's counters started (unix s)
ENV_DIR_OWNED = "MOE_EPLB_EXPORTER_DIR_OWNED"  # internal: the directory was created by the plugin
ENV_LIVE_APPLY = "MOE_EPLB_LIVE_APPLY"

MODES = ("full", "reduced", "off")


class ExporterSettingsError(ValueError):
    """A bad environment variable; the message names it and says what to set instead."""


@dataclass(frozen=True)
class Settings:
    mode: str = "full"
    port: int = k8s_names.EXPORTER_PORT
    address: str = "0.0.0.0"
    directory: str | None = None
    flush_seconds: float = 1.0
    balancedness_window_seconds: float = 60.0
    trace_dir: str | None = None
    trace_bucket_seconds: float = 10.0
    trace_max_buckets: int = 360
    server_pid: int | None = None
    start_time: float | None = None
    live_apply: bool = True

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        mode = env.get(ENV_MODE, "full").strip().lower() or "full"
        if mode not in MODES:
            raise ExporterSettingsError(f"{ENV_MODE}={env[ENV_MODE]!r}: expected one of {', '.join(MODES)}")
        live = (env.get(ENV_LIVE_APPLY, "on").strip().lower() or "on")
        if live not in ("on", "off"):
            raise ExporterSettingsError(f"{ENV_LIVE_APPLY}={env[ENV_LIVE_APPLY]!r}: expected on or off")
        server_pid = env.get(ENV_SERVER_PID)
        try:
            start_time = float(env.get(ENV_START_TIME, ""))
        except ValueError:
            start_time = None
        return cls(
            mode=mode,
            port=_int(env, ENV_PORT, k8s_names.EXPORTER_PORT, 1, 65535),
            address=env.get(ENV_ADDRESS, "0.0.0.0") or "0.0.0.0",
            directory=env.get(ENV_DIR) or None,
            flush_seconds=_float(env, ENV_FLUSH_SECONDS, 1.0, 0.0),
            balancedness_window_seconds=_float(env, ENV_BALANCEDNESS_WINDOW, 60.0, 1.0),
            trace_dir=env.get(ENV_TRACE_DIR) or None,
            trace_bucket_seconds=_float(env, ENV_TRACE_BUCKET_SECONDS, 10.0, 0.1),
            trace_max_buckets=_int(env, ENV_TRACE_MAX_BUCKETS, 360, 1, 10**7),
            server_pid=int(server_pid) if server_pid and server_pid.isdigit() else None,
            start_time=start_time,
            live_apply=live == "on",
        )


def _int(env, key: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ExporterSettingsError(f"{key}={raw!r}: expected a whole number between {lo} and {hi}") from None
    if not lo <= value <= hi:
        raise ExporterSettingsError(f"{key}={raw!r}: expected a whole number between {lo} and {hi}")
    return value


def _float(env, key: str, default: float, lo: float) -> float:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ExporterSettingsError(f"{key}={raw!r}: expected a number of seconds >= {lo}") from None
    if not value >= lo or value != value or value == float("inf"):
        raise ExporterSettingsError(f"{key}={raw!r}: expected a finite number of seconds >= {lo}")
    return value


def setup_logging() -> logging.Logger:
    """Give the exporter's logger (``moe_eplb.exporter``) a handler of its own, once per process:
    vLLM configures only its ``vllm`` logger, and the server process has none. Lines start with
    ``[moe-eplb pid N]``; the level comes from ``MOE_EPLB_LOG_LEVEL`` (default INFO)."""
    log = logging.getLogger("moe_eplb.exporter")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [moe-eplb pid %(process)d] %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("MOE_EPLB_LOG_LEVEL", "INFO").upper())
        log.propagate = False
    return log
