"""Inside each vLLM worker: EPLB's window and interval changed live, at one engine step on every rank.

vLLM's ``EplbState`` keeps the interval (``expert_rearrangement_step_interval``) and the window
(``expert_load_window_size``, ``expert_load_window_step`` and each model's ``expert_load_window``
ring of ``[window, layers, physical slots]`` counts) as plain attributes, read only by its own
``step()`` and ``rearrange()`` on the worker's step thread (the async worker gets a snapshot of the
summed window). So between two steps a worker can change them without vLLM noticing. The rules of
the exchange (prepare / commit / the agreed step / the grace) are in
:mod:`moe_eplb.contracts.live_protocol`; this module is one rank's side:

* a daemon thread (``moe-eplb-live``) watches the pod's command file (the pod's exporter writes it,
  :mod:`moe_eplb.exporter.live_control`) every :data:`POLL_SECONDS`; on ``prepare`` it checks the
  command and allocates the new window tensors (so that applying cannot fail for want of memory),
  then reports ``armed`` or ``refused``; ``commit`` and ``abort`` follow. It rewrites this worker's
  status file (``live-status-<pid>.json``) whenever something changed, and every quarter second (its step);
* the hook (:mod:`moe_eplb.exporter.hook`) calls :meth:`LiveWorker.before_step` before vLLM's step
  and :meth:`LiveWorker.after_step` after it (one attribute test per step while no command is
  pending), and :meth:`LiveWorker.rearranged` when vLLM rearranges;
* at the agreed step the worker copies the window into the new tensors -- oldest step first, so the
  counts it keeps are the newest ``min(old, new)`` steps', all of them when it grows -- and sets the
  interval last. vLLM's rearrangement counter is left as it is: the next rearrangement comes when it
  reaches the new interval, as if the engine had been started with it.

At start, a worker whose pod mounts the operator's live-settings file (``MOE_EPLB_LIVE_FILE``, a
ConfigMap) applies the values in it before its first step, when the file was written for this pod
template (its ``configHash`` equals ``MOE_EPLB_CONFIG_HASH``): a restarted pod comes back with the
values in force, not the template's.

Supported where this was checked against vLLM's own ``EplbState``: 0.32 (the CPU wheel, and a real
engine), 0.33 and 0.34 (their released sources). Elsewhere every rank reports ``supported: false``
with the reason, and the operator falls back to a restart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from moe_eplb.contracts import k8s_names, vllm_facts
from moe_eplb.contracts import live_protocol as lp

log = logging.getLogger("moe_eplb.exporter")

LIVE_ATTR = "_moe_eplb_live"
POLL_SECONDS = 0.05
STATUS_EVERY_SECONDS = 0.25
REARRANGEMENTS_KEPT = 16
ENV_LIVE_FILE = k8s_names.LIVE_FILE_ENV
ENV_CONFIG_HASH = k8s_names.CONFIG_HASH_ENV
#: the ``EplbState`` attributes live apply reads and writes (vLLM 0.32 - 0.34)
STATE_ATTRS = ("expert_rearrangement_step", "expert_rearrangement_step_interval", "expert_load_window_size",
               "expert_load_window_step", "model_states")


def support_problem(state: Any, vllm_version: str) -> str | None:
    """Why this ``EplbState`` cannot be changed live, or None: a vLLM outside the checked releases,
    or a state without the attributes (or windows) this module changes."""
    if not vllm_facts.live_apply_supports(vllm_version):
        return (f"vLLM {vllm_version or '(unknown version)'}: live apply is checked on vLLM "
                f"{vllm_facts.live_apply_range()} only; the operator restarts the pods instead")
    missing = [a for a in STATE_ATTRS if not hasattr(state, a)]
    if missing:
        return f"vLLM's EplbState has no {', '.join(missing)}: live apply is not possible on this layout"
    for ms in (state.model_states or {}).values():
        window = getattr(ms, "expert_load_window", None)
        if window is None or getattr(window, "dim", lambda: 0)() != 3:
            return "an EplbModelState has no [window, layers, slots] expert_load_window"
    return None


def resize_window(window: Any, position: int, out: Any) -> int:
    """Copy ring buffer ``window`` (``[W, ...]``, next write at ``position``) into ``out``
    (``[W', ...]``, zeroed) oldest step first, keeping the newest ``min(W, W')`` steps; returns the
    next write position in ``out``. Pure tensor work (torch), no allocation beyond a roll."""
    import torch

    old, new = int(window.shape[0]), int(out.shape[0])
    ordered = torch.roll(window, shifts=-int(position), dims=0)  # oldest first
    keep = min(old, new)
    out.zero_()
    out[:keep].copy_(ordered[old - keep:])
    return keep % new


class LiveWorker:
    """One worker's side of live apply (see the module docstring). ``directory``: the pod's
    exporter directory (command file in, status file out)."""

    def __init__(self, state: Any, directory: str | None, *, vllm_version: str = "",
                 ep_info: Callable[[], tuple[int, int] | None] | None = None,
                 startup: dict | None = None, poll_seconds: float = POLL_SECONDS, start_thread: bool = True) -> None:
        self.state = state
        self.directory = directory
        self.steps = 0
        self.since_step = 0
        self.source = lp.SOURCE_ENGINE
        self.pending: dict | None = None  # {cmd, state, windows, reason, applied_step}
        self.last: dict = {}  # the latest command's report: {id, state, reason, at_step, applied_step}
        self.rearranged_at: list[int] = []
        self.why = support_problem(state, vllm_version)
        info = ep_info() if ep_info is not None else None
        self.ep_rank, self.ep_size = info if info is not None else (None, None)
        self._lock = threading.Lock()
        self._seen: tuple | None = None  # (mtime_ns, size, inode) of the command file last read
        self._dirty = True
        self._written = 0.0
        self._rate_mark = (time.monotonic(), 0)
        self.rate = 0.0
        self._stop = threading.Event()
        if self.why is None and startup:
            self._apply_startup(startup)
        self.write_status()
        self._thread = None
        if start_thread and directory and self.why is None:
            self._thread = threading.Thread(target=self._run, args=(poll_seconds,), name="moe-eplb-live", daemon=True)
            self._thread.start()

    # --- the step thread -------------------------------------------------------------------------
    def before_step(self) -> None:
        """Before vLLM's step number :attr:`steps`: apply (or give up) a pending command due now."""
        if self.pending is None:
            return
        with self._lock:
            p = self.pending
            if p is None or self.steps < p["cmd"].at_step:
                return
            self._due(p)

    def after_step(self) -> None:
        self.steps += 1

    def rearranged(self) -> None:
        """vLLM started a (non-profile) rearrangement in the step under way."""
        self.rearranged_at = (self.rearranged_at + [self.steps])[-REARRANGEMENTS_KEPT:]
        self._dirty = True

    def _due(self, p: dict) -> None:
        """Step ``self.steps >= at_step`` with command ``p`` pending (caller holds the lock)."""
        cmd: lp.Command = p["cmd"]
        late = self.steps - cmd.at_step
        st = self.state
        counter_at = int(st.expert_rearrangement_step) - late
        if any(s >= cmd.at_step for s in self.rearranged_at):
            counter_at = -1  # a rearrangement since the agreed step: the guard below cannot hold
        problem = lp.guard_problem(counter_at, cmd.grace_steps, int(st.expert_rearrangement_step_interval),
                                   cmd.step_interval) if counter_at >= 0 else \
            f"vLLM rearranged since the agreed step {cmd.at_step}; a late change would no longer agree"
        if problem is not None:
            self._finish(p, lp.REFUSED, problem)
        elif p["state"] == lp.COMMITTED:
            self._apply(p)
        elif late > cmd.grace_steps:
            self._finish(p, lp.EXPIRED, f"no commit arrived by step {cmd.at_step + cmd.grace_steps} (the agreed "
                                        f"step {cmd.at_step} + grace {cmd.grace_steps}); nothing changed")

    def _apply(self, p: dict) -> None:
        cmd: lp.Command = p["cmd"]
        st = self.state
        if (int(st.expert_load_window_size), int(st.expert_rearrangement_step_interval)) == (cmd.window_size,
                                                                                            cmd.step_interval):
            # already in force here (a rank that kept them while others changed back): nothing to do
            return self._finish(p, lp.APPLIED, f"window {cmd.window_size}, interval {cmd.step_interval} were already "
                                                f"in force (since step {self.since_step})")
        try:
            before = int(st.expert_load_window_size)
            kept = []
            position = int(st.expert_load_window_step)
            for key, ms in st.model_states.items():
                new = p["windows"][key]
                total = int(ms.expert_load_window.sum())
                next_pos = resize_window(ms.expert_load_window, position, new)
                kept.append((total, int(new.sum())))
                ms.expert_load_window = new
            st.expert_load_window_step = next_pos if st.model_states else 0
            st.expert_load_window_size = cmd.window_size
            st.expert_rearrangement_step_interval = cmd.step_interval  # last: the value ranks must agree on
        except Exception as exc:  # noqa: BLE001 - report it; the interval (set last) was not changed
            self._finish(p, lp.FAILED, f"{type(exc).__name__}: {exc}")
            return
        self.since_step, self.source = cmd.at_step, lp.SOURCE_LIVE
        self._finish(p, lp.APPLIED, f"window {before} -> {cmd.window_size} (counts kept: "
                                    f"{', '.join(f'{b} of {a}' for a, b in kept) or 'none'}), interval -> "
                                    f"{cmd.step_interval}, from step {cmd.at_step} (applied at {self.steps})")
        log.info("moe-eplb live: EP rank %s: window %d, interval %d in force from engine step %d (applied at step "
                 "%d; vLLM's counter %d; window counts kept %s)", self.ep_rank, cmd.window_size, cmd.step_interval,
                 cmd.at_step, self.steps, int(st.expert_rearrangement_step),
                 ", ".join(f"{b}/{a}" for a, b in kept) or "-")

    def _finish(self, p: dict, state: str, reason: str) -> None:
        cmd: lp.Command = p["cmd"]
        self.last = {"id": cmd.id, "state": state, "reason": reason, "at_step": cmd.at_step,
                     "applied_step": self.steps if state == lp.APPLIED else None}
        self.pending = None
        self._dirty = True
        if state not in (lp.APPLIED, lp.ABORTED):
            log.warning("moe-eplb live: EP rank %s: command %s %s: %s", self.ep_rank, cmd.id, state, reason)

    # --- start-up values ---------------------------------------------------------------------------
    def _apply_startup(self, values: dict) -> None:
        """Before the first step: the live-settings file's values (the counter restarted as vLLM
        starts it, at 3/4 of the interval), the window reallocated empty."""
        import torch

        st = self.state
        window, interval = int(values[lp.FILE_WINDOW]), int(values[lp.FILE_INTERVAL])
        for ms in st.model_states.values():
            w = ms.expert_load_window
            ms.expert_load_window = torch.zeros((window, *w.shape[1:]), dtype=w.dtype, device=w.device)
        st.expert_load_window_size, st.expert_load_window_step = window, 0
        st.expert_rearrangement_step = vllm_facts.first_counter(interval)
        st.expert_rearrangement_step_interval = interval
        self.source = lp.SOURCE_STARTUP
        log.info("moe-eplb live: EP rank %s starts with window %d, interval %d from the operator's live settings "
                 "(in force since engine step %s of the pod it replaces)", self.ep_rank, window, interval,
                 values.get(lp.FILE_STEP))

    # --- the poll thread ---------------------------------------------------------------------------
    def _run(self, poll_seconds: float) -> None:
        while not self._stop.wait(poll_seconds):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - never take the worker down; it stops answering commands
                log.exception("moe-eplb live: the command watcher failed; this rank no longer takes live commands")
                self.why = "the command watcher failed (see the worker's log)"
                self.write_status()
                return

    def poll_once(self) -> None:
        """Read the command file if it changed, act on it, and write the status when due."""
        path = os.path.join(self.directory or "", lp.COMMAND_FILE)
        try:
            s = os.stat(path)
            seen = (s.st_mtime_ns, s.st_size, s.st_ino)
        except OSError:
            seen = None
        if seen is not None and seen != self._seen:
            self._seen = seen
            try:
                with open(path, encoding="utf-8") as f:
                    cmd = lp.Command.from_mapping(json.load(f))
            except (OSError, ValueError) as exc:
                log.warning("moe-eplb live: unreadable command file %s (%s)", path, exc)
            else:
                with self._lock:
                    self.take(cmd)
        if self._dirty or time.monotonic() - self._written >= STATUS_EVERY_SECONDS:
            self.write_status()

    def take(self, cmd: lp.Command) -> None:
        """Act on a command (caller holds the lock; the poll thread, or a test)."""
        p = self.pending
        same = p is not None and p["cmd"].id == cmd.id
        if cmd.op == lp.PREPARE:
            if same or self.last.get("id") == cmd.id:
                return  # the same prepare again
            if p is not None:  # a newer command replaces one never committed
                self._finish(p, lp.ABORTED, f"replaced by command {cmd.id}")
            self._prepare(cmd)
        elif not same:
            return  # a commit or abort of a command this rank does not hold (refused, expired, never seen)
        elif cmd.op == lp.COMMIT:
            if p["state"] == lp.ARMED:
                p["state"] = lp.COMMITTED
                self.last = {**self.last, "state": lp.COMMITTED}
                self._dirty = True
        else:
            self._finish(p, lp.ABORTED, "the operator aborted it")

    def _prepare(self, cmd: lp.Command) -> None:
        st = self.state
        p = {"cmd": cmd, "state": lp.ARMED, "windows": {}}
        running = (int(st.expert_load_window_size), int(st.expert_rearrangement_step_interval))
        if self.why is not None:
            return self._finish(p, lp.REFUSED, self.why)
        if self.steps > cmd.at_step:
            return self._finish(p, lp.REFUSED, f"step {cmd.at_step} is already past: this rank is at engine step "
                                               f"{self.steps}")
        if running != (cmd.expect_window_size, cmd.expect_step_interval) and running != (cmd.window_size,
                                                                                       cmd.step_interval):
            return self._finish(p, lp.REFUSED, f"this rank runs window {running[0]}, interval {running[1]}, not "
                                               f"the {cmd.expect_window_size}, {cmd.expect_step_interval} the "
                                               "command expects")
        try:
            import torch

            for key, ms in st.model_states.items():
                w = ms.expert_load_window
                p["windows"][key] = torch.zeros((cmd.window_size, *w.shape[1:]), dtype=w.dtype, device=w.device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of device memory: refuse, nothing changed
            return self._finish(p, lp.REFUSED, f"cannot allocate the new window: {type(exc).__name__}: {exc}")
        self.pending = p
        self.last = {"id": cmd.id, "state": lp.ARMED, "reason": "", "at_step": cmd.at_step, "applied_step": None}
        self._dirty = True

    def status(self) -> lp.RankStatus:
        st = self.state

        def num(name: str) -> int | None:
            value = getattr(st, name, None)
            return int(value) if isinstance(value, int) else None

        return lp.RankStatus(ep_rank=self.ep_rank, ep_size=self.ep_size, pid=os.getpid(), step=self.steps,
                             counter=num("expert_rearrangement_step"), window_size=num("expert_load_window_size"),
                             step_interval=num("expert_rearrangement_step_interval"), since_step=self.since_step,
                             source=self.source, supported=self.why is None, why=self.why or "",
                             command=dict(self.last), rearranged_at=tuple(self.rearranged_at),
                             rate=round(self.rate, 3), time=time.time())

    def write_status(self) -> None:
        """This worker's status file, replaced atomically."""
        self._dirty = False
        self._written = now = time.monotonic()
        t0, steps0 = self._rate_mark
        if now - t0 >= 1.0:
            self.rate, self._rate_mark = (self.steps - steps0) / (now - t0), (now, self.steps)
        if not self.directory:
            return
        path = os.path.join(self.directory, f"{lp.STATUS_PREFIX}{os.getpid()}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.status().to_json())
        os.replace(tmp, path)

    def close(self) -> None:
        self._stop.set()


def read_startup_file(env: dict[str, str] | os._Environ | None = None) -> dict | None:
    """The operator's live-settings file when it holds values for this pod's template (its
    ``configHash`` equals ``MOE_EPLB_CONFIG_HASH``), else None (no file, empty, another template's,
    or unreadable: logged)."""
    env = os.environ if env is None else env
    path, own = env.get(ENV_LIVE_FILE), env.get(ENV_CONFIG_HASH)
    if not path or not own:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        values = json.loads(text) if text else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("moe-eplb live: cannot read the live-settings file %s (%s); starting with the template's", path,
                    exc)
        return None
    if not isinstance(values, dict) or values.get(lp.FILE_HASH) != own:
        return None
    try:
        window, interval = int(values[lp.FILE_WINDOW]), int(values[lp.FILE_INTERVAL])
    except (KeyError, TypeError, ValueError):
        log.warning("moe-eplb live: the live-settings file %s lacks %s/%s; starting with the template's", path,
                    lp.FILE_WINDOW, lp.FILE_INTERVAL)
        return None
    if window <= 0 or interval <= 0:
        return None
    return values


def live_of(state: Any, factory: Callable[[Any], LiveWorker | None]) -> LiveWorker | None:
    """The worker's :class:`LiveWorker` for ``state``, made at its first (non-profile) step."""
    live = state.__dict__.get(LIVE_ATTR)
    if live is None and LIVE_ATTR not in state.__dict__:
        if not getattr(state, "model_states", None):
            return None  # nothing registered yet; look again next step
        live = factory(state)
        state.__dict__[LIVE_ATTR] = live
    return live
