"""The simulation's child processes (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
the LeaderWorkerSet controller, prometheus-adapter, Prometheus, real vLLM engines) never outlive it.

Every child is started by :func:`spawn`:

- in a process group of its own (``start_new_session``), so :func:`stop` ends it and whatever it
  started, and a Ctrl+C at the terminal reaches only the Python process, which stops it in order;
- with the parent-death signal set to SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel kills
  the child when the Python process dies for any reason -- SIGTERM, SIGKILL, a crash -- when no
  Python code runs any more. The kernel ties that signal to the *thread* that forked the child, so
  every child is forked by one daemon thread that lives as long as the process (a child forked by
  an ``asyncio.to_thread`` worker would be killed when that worker thread retires);
- registered for :func:`kill_all` at interpreter exit (``atexit``: an exception that ends the
  program, ``sys.exit``), which SIGTERMs each group still running, then SIGKILLs it after a grace
  period; and with a ``weakref.finalize`` that SIGKILLs its group when its ``Popen`` is
  garbage-collected while the child still runs (an owner dropped without being stopped).

Only the standard library (``ctypes`` for ``prctl``); elsewhere than Linux the parent-death signal is
not set and the rest still applies.

Also what every process starter here shares: :func:`free_port` and :func:`poll_ready` (wait until a
started server answers). Shared by both backends (``sim.emulated``, ``sim.real``) and the top level.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import os
import queue
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_lock = threading.RLock()  # re-entrant: a finalizer may run (garbage collection) while it is held
_jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_alive: weakref.WeakValueDictionary[int, subprocess.Popen[Any]] = weakref.WeakValueDictionary()
_finalizers: dict[int, weakref.finalize] = {}


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _preexec(parent: int) -> Callable[[], None] | None:
    """In the forked child, before exec: die with the parent (and at once if it already died)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the prctl
            os._exit(1)

    return set_pdeathsig


def _serve() -> None:
    while True:
        job, future = _jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)


def _in_spawner(job: Callable[[], Any]) -> Any:
    """Run ``job`` on the spawner thread (started on first use; it lives as long as the process)."""
    global _spawner
    if threading.current_thread() is _spawner:
        return job()
    with _lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_serve, name="moe-eplb-spawner", daemon=True)
            _spawner.start()
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    _jobs.put((job, future))
    return future.result()


def spawn(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **popen_kwargs)`` in a new process group, killed with this process
    (see the module doc). Stop it with :func:`stop`."""
    popen_kwargs["start_new_session"] = True
    parent = os.getpid()
    proc: subprocess.Popen[Any] = _in_spawner(
        lambda: subprocess.Popen(list(argv), preexec_fn=_preexec(parent), **popen_kwargs))
    with _lock:
        _alive[proc.pid] = proc
        fin = weakref.finalize(proc, _signal_group, proc.pid, signal.SIGKILL)
        fin.atexit = False  # at exit, kill_all() stops it in order (SIGTERM first)
        _finalizers[proc.pid] = fin
    return proc


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    with _lock:
        _finalizers.pop(pgid, None)


def _forget(proc: subprocess.Popen[Any]) -> None:
    with _lock:
        _alive.pop(proc.pid, None)
        fin = _finalizers.pop(proc.pid, None)
    if fin is not None:
        fin.detach()


def stop(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout`` s (and whatever of the group is
    left once the child exited), reap the child. Nothing when it was stopped already."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # the group outlives its leader if the leader started others: they go now, as on a node
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    _forget(proc)


def running() -> list[subprocess.Popen[Any]]:
    """The children :func:`spawn` started that have not been stopped and still run."""
    with _lock:
        procs = list(_alive.values())
    return [p for p in procs if p.poll() is None]


def kill_all(grace: float = 3.0) -> None:
    """SIGTERM every running child's group, SIGKILL what is left after ``grace`` s (at exit)."""
    procs = running()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        _forget(proc)


atexit.register(kill_all)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick), for a child or a test server to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_S = TypeVar("_S", bound="Stoppable")


def poll_ready(probe: Callable[[], str | None], timeout: float, *, alive: Callable[[], None] | None = None,
               interval: float = 0.2) -> str | None:
    """Call ``probe()`` every ``interval`` s (``alive()`` first: it raises if the process died) until it
    returns None (ready) or ``timeout`` s (at least 5) have passed. Its other answers, and the network
    errors it raises (``URLError``, ``HTTPError``, ``OSError``, ``SSLError``), say why not yet; the last
    reason comes back on a timeout, None once ready."""
    deadline = time.monotonic() + max(timeout, 5.0)
    last: str | None = "not tried"
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            last = probe()
        except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
            last = str(exc) or type(exc).__name__
        if last is None:
            return None
        time.sleep(interval)
    return last


class Stoppable:
    """A local service with ``start()`` and ``stop()`` used as a context manager: ``with thing:``
    starts it, stops what did start when starting fails half-way (and re-raises), stops it on exit."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def give_signals_back() -> None:
    """Undo the SIGINT/SIGTERM handlers kopf's ``operator()`` adds to the running loop (it does so in
    the main thread, for ``moe-eplb run``). An operator embedded in a simulation must not swallow them:
    SIGTERM then ends the process (and :func:`spawn`'s children with it) and SIGINT raises
    ``KeyboardInterrupt``, as before the operator started, instead of stopping just the operator
    while the rest runs on."""
    import asyncio

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError):
            loop.remove_signal_handler(sig)
