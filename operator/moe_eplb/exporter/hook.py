"""The hook: how the exporter reaches vLLM's EPLB state without changing vLLM's source.

vLLM creates the worker's ``EplbState`` in the model runner's ``load_model()`` and calls
``step(is_dummy, is_profile, log_stats)`` on it once per engine step: up to 0.33 the V1 runner's
``GPUModelRunner.eplb_state`` (``v1/worker/gpu_model_runner.py``); from 0.34, where that runner is
gone, the new runner's ``EPLBController`` (``v1/worker/gpu/eplb_utils.py``: ``prepare_load``,
``step``, ``prepare_forward``; ``GPUModelRunner.eplb_state`` in ``v1/worker/gpu/model_runner.py``
is a property returning its state). Both build the class from ``vllm.distributed.eplb.eplb_state``,
so patching that class reaches either runner.
At plugin load (``register()``, which vLLM runs in every process before the worker is built) we
install, once per process, a method patch on the *class*
``vllm.distributed.eplb.eplb_state.EplbState``:

* ``step``: before vLLM's step, add this step's ``expert_load_pass`` to the exporter's device
  accumulators; after it, clear the pass / keep recording on (gated layouts) and maybe start an
  asynchronous read-back (see :mod:`moe_eplb.exporter.recorder`);
* ``rearrange``: count rearrangements and time them (sync: the call; async: until the last layer
  is committed);
* ``add_model``: remember each model's served name (``model_config.served_model_name``, the value
  of vLLM's own ``model_name`` label) and the worker's ``VllmConfig`` (for the KV-cache size);
* ``prepare_forward``: remember the forward's real (unpadded) token count and when it started
  (host values vLLM passes in; the step telemetry of :mod:`moe_eplb.exporter.recorder`).

Both ``prepare_forward`` and ``step`` also beat the process's heartbeat (a forward began, a step
ended: :class:`moe_eplb.exporter.health.Heartbeat`), which the pod's liveness probe reads.

If ``eplb_state`` is not imported yet, the patch is applied by a ``sys.meta_path`` finder right
after the module is executed. The patch finds the instance's recorder lazily on its first step
(after ``load_model()``, so every model, drafter included, is registered). vLLM's own code always
runs exactly once per call; any exception in the exporter is logged once and turns the exporter off
for that process ("fail soft"), never the engine.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from moe_eplb.exporter.layout import NAMES_ATTR, SUPPORTED_VLLM, UnsupportedLayout, check_step_signature, detect
from moe_eplb.exporter.live import LIVE_ATTR, live_of

log = logging.getLogger("moe_eplb.exporter")

EPLB_MODULE = "vllm.distributed.eplb.eplb_state"
_PATCHED = "_moe_eplb_patched"
_RECORDER = "_moe_eplb_recorder"
NAMES = NAMES_ATTR  # {str(model_states key): (served_model_name, model_name given to add_model or None)}
VLLM_CONFIG = "_moe_eplb_vllm_config"  # the worker's VllmConfig, seen while add_model ran
_DISABLED = object()

RecorderFactory = Callable[[Any, Any], Any]  # (eplb_state, layout) -> StateRecorder
#: the process's heartbeat (:class:`moe_eplb.exporter.health.Heartbeat`), set by :func:`install`
_heartbeat: list[Any] = []
#: the process's live-apply factory (eplb_state -> :class:`moe_eplb.exporter.live.LiveWorker`), set
#: by :func:`install` (or :func:`patch_eplb_state`); empty: no live apply in this process
_live_factory: list[Any] = []
# The exporter's own cost per step: CPU time of the step thread spent in exporter code (not wall time,
# which on a busy host also counts the thread being preempted; ~0.25 us per reading).
_now = time.thread_time


def _fail_soft(where: str, exc: BaseException, owner: Any | None = None) -> None:
    log.error("moe-eplb exporter: %s failed (%s: %s); exporting nothing from this process, "
              "the engine is not affected", where, type(exc).__name__, exc)
    if owner is not None:
        try:
            owner.__dict__[_RECORDER] = _DISABLED
        except Exception:  # noqa: BLE001
            pass


def _soft(where: str, owner: Any, call: Callable, *args: Any) -> bool:
    """``call(*args)`` where a failure is the exporter's, never the engine's: logged and the
    exporter switched off for ``owner`` (:func:`_fail_soft`). True when it ran."""
    try:
        call(*args)
        return True
    except Exception as exc:  # noqa: BLE001
        _fail_soft(where, exc, owner)
        return False


def recorder_of(eplb_state: Any, factory: RecorderFactory) -> Any | None:
    rec = eplb_state.__dict__.get(_RECORDER)
    if rec is _DISABLED:
        return None
    if rec is not None:
        if len(rec._model_keys) == len(eplb_state.model_states):
            return rec
        # a model was added after the first step: start over (counters restart from zero)
    try:
        layout = detect(eplb_state)
    except UnsupportedLayout as exc:
        if "empty" in str(exc):
            return None  # nothing registered yet; look again next step
        _fail_soft("layout detection", exc, eplb_state)
        return None
    rec = factory(eplb_state, layout)
    eplb_state.__dict__[_RECORDER] = rec
    log.info("moe-eplb exporter: recording %s (layout %s) on EP rank %s/%s",
             ", ".join(m.handle.name for m in rec.models), layout.name,
             rec.models[0].ep_rank, rec.models[0].ep_size)
    return rec


def patch_eplb_state(cls: type, factory: RecorderFactory, live: Callable[[Any], Any] | None = None) -> bool:
    """Wrap ``cls.step`` and ``cls.rearrange`` (and ``add_model`` and ``prepare_forward`` where vLLM
    has them). Idempotent; returns False (and logs once) when the class does not have a supported
    layout. ``live``: the live-apply factory (:mod:`moe_eplb.exporter.live`), if any."""
    _live_factory[:] = [live] if live is not None else []
    if getattr(cls, _PATCHED, False):
        return True
    try:
        check_step_signature(cls.step)
    except UnsupportedLayout as exc:
        _fail_soft("hook installation", exc)
        return False
    orig_step = cls.step
    orig_rearrange = getattr(cls, "rearrange", None)
    orig_add_model = getattr(cls, "add_model", None)
    orig_prepare = getattr(cls, "prepare_forward", None)
    cls.step = _wrapped_step(orig_step, factory)
    if orig_rearrange is not None:
        cls.rearrange = _wrapped_rearrange(orig_rearrange)
    if orig_add_model is not None:
        cls.add_model = _wrapped_add_model(orig_add_model)
    if orig_prepare is not None:
        cls.prepare_forward = _wrapped_prepare_forward(orig_prepare, factory)
    setattr(cls, _PATCHED, True)
    cls._moe_eplb_originals = (orig_step, orig_rearrange, orig_add_model, orig_prepare)
    return True


def _wrapped_step(orig_step: Callable, factory: RecorderFactory) -> Callable:
    """``EplbState.step`` wrapped: the recorder reads the expert load before the step and finishes
    after it (not during profiling); the time it takes is counted as the exporter's."""

    @functools.wraps(orig_step)
    def step(self, is_dummy: bool = False, is_profile: bool = False, *args, **kwargs):
        t0 = _now()
        rec = None
        if not is_profile:
            try:
                rec = recorder_of(self, factory)
                if rec is not None:
                    rec.before_step(bool(is_dummy))
            except Exception as exc:  # noqa: BLE001
                _fail_soft("reading the expert load", exc, self)
                rec = None
        live = _live_before(self) if not is_profile else None
        t1 = _now()
        try:
            result = orig_step(self, is_dummy, is_profile, *args, **kwargs)
        except Exception as exc:
            if rec is not None:  # vLLM 0.34: the async worker's failure, raised on every rank
                _soft("counting a failed EPLB step", self, rec.step_failed, exc)
            raise
        if live is not None:
            live.after_step()
        _beat("step_ended")
        if rec is not None:
            _soft("after the EPLB step", self, _after_step, rec, t1 - t0)
        return result

    return step


def _after_step(rec: Any, before_s: float) -> None:
    """The recorder's work after a step; its time and ``before_s`` (its work before the step) are
    counted as the exporter's share of the step."""
    t = _now()
    rec.after_step()
    rec.exporter_seconds += before_s + (_now() - t)


def _live_before(state: Any) -> Any | None:
    """The state's live worker after its ``before_step`` (None without live apply, or once it
    failed: logged, and this process takes no more live commands; vLLM is not affected)."""
    if not _live_factory:
        return None
    try:
        live = live_of(state, _live_factory[0])
        if live is not None:
            live.before_step()
        return live
    except Exception as exc:  # noqa: BLE001
        log.error("moe-eplb live: failed (%s: %s); this worker takes no more live commands", type(exc).__name__, exc)
        state.__dict__[LIVE_ATTR] = None
        return None


def _wrapped_rearrange(orig_rearrange: Callable) -> Callable:
    """``EplbState.rearrange``, timed (not during profiling)."""

    @functools.wraps(orig_rearrange)
    def rearrange(self, *args, **kwargs):
        is_profile = bool(kwargs.get("is_profile", args[0] if args else False))
        rec = None
        if not is_profile:
            live = self.__dict__.get(LIVE_ATTR)
            if live is not None:
                live.rearranged()
            rec = self.__dict__.get(_RECORDER)
            rec = None if rec is _DISABLED else rec
            if rec is not None and not _soft("timing a rearrangement", self, rec.rearrange_started):
                rec = None
        result = orig_rearrange(self, *args, **kwargs)
        if rec is not None:
            _soft("timing a rearrangement", self, rec.rearrange_finished)
        return result

    return rearrange


def _wrapped_add_model(orig_add_model: Callable) -> Callable:
    """``EplbState.add_model``: remembers the served model's name."""

    @functools.wraps(orig_add_model)
    def add_model(self, model, model_config, *args, **kwargs):
        before = set(getattr(self, "model_states", {}) or {})
        result = orig_add_model(self, model, model_config, *args, **kwargs)
        try:
            remember_model(self, before, model_config, kwargs.get("model_name", args[0] if args else None))
        except Exception as exc:  # noqa: BLE001
            log.warning("moe-eplb exporter: could not read the served model name (%s: %s)",
                        type(exc).__name__, exc)
        return result

    return add_model


def _wrapped_prepare_forward(orig_prepare: Callable, factory: RecorderFactory) -> Callable:
    """``EplbState.prepare_forward``: the forward's unpadded token count."""

    @functools.wraps(orig_prepare)
    def prepare_forward(self, model_config, num_unpadded_tokens, *args, **kwargs):
        _beat("forward_began")
        result = orig_prepare(self, model_config, num_unpadded_tokens, *args, **kwargs)
        t0 = _now()
        try:
            rec = recorder_of(self, factory)
            if rec is not None:
                key = _hash_key(model_config)
                rec.forward_started(self.model_states.get(key), int(num_unpadded_tokens))
                rec.exporter_seconds += _now() - t0
        except Exception as exc:  # noqa: BLE001
            _fail_soft("reading the forward's token count", exc, self)
        return result

    return prepare_forward


#: The function ``vllm.distributed.eplb.eplb_state`` keys ``model_states`` with, newest first:
#: ``hash_config_cached`` (vLLM 0.34: the hash of ``compile_factors()``, cached by ``id``; vLLM
#: 0.34 has no ``ModelConfig.compute_hash``), ``compute_hash_cached`` (0.32 - 0.33: cached
#: ``compute_hash()``). Older releases call ``model_config.compute_hash()`` directly.
KEY_FUNCTIONS = ("hash_config_cached", "compute_hash_cached")


def _hash_key(model_config: Any):
    """The ``model_states`` key vLLM uses for ``model_config``: computed by the function vLLM's own
    EPLB module imported for it (so a cached hash is the very string vLLM stored)."""
    module = sys.modules.get(EPLB_MODULE)
    for name in KEY_FUNCTIONS:
        key_of = getattr(module, name, None)
        if callable(key_of):
            return key_of(model_config)
    compute = getattr(model_config, "compute_hash", None)
    if compute is None:
        raise UnsupportedLayout(f"{EPLB_MODULE} has none of {', '.join(KEY_FUNCTIONS)} and the model "
                                f"config no compute_hash(): cannot find a model's EPLB state; supported: "
                                f"vLLM {SUPPORTED_VLLM}")
    return compute()


def remember_model(eplb_state: Any, before: set, model_config: Any, model_name: str | None) -> None:
    """Record the served name of the model(s) ``add_model`` just registered, and the worker's
    ``VllmConfig`` (vLLM runs ``load_model`` inside ``set_current_vllm_config``)."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    served = served or getattr(model_config, "model", None)
    names = eplb_state.__dict__.setdefault(NAMES, {})
    for key in set(getattr(eplb_state, "model_states", {}) or {}) - before:
        names[str(key)] = (str(served) if served else None, model_name)
    if VLLM_CONFIG not in eplb_state.__dict__:
        try:
            from vllm.config import get_current_vllm_config_or_none
        except ImportError:  # older vLLM
            return
        cfg = get_current_vllm_config_or_none()
        if cfg is not None:
            eplb_state.__dict__[VLLM_CONFIG] = cfg


def unpatch_eplb_state(cls: type) -> None:
    """Undo :func:`patch_eplb_state` (tests)."""
    originals = getattr(cls, "_moe_eplb_originals", None)
    if originals is None:
        return
    cls.step, rearrange, add_model, prepare = originals
    for name, orig in (("rearrange", rearrange), ("add_model", add_model), ("prepare_forward", prepare)):
        if orig is not None:
            setattr(cls, name, orig)
    del cls._moe_eplb_originals
    setattr(cls, _PATCHED, False)



class _CallbackLoader(importlib.abc.Loader):
    """Runs ``loader`` as usual, then ``callback(module)`` (a failure there never breaks the import)."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[Any], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.callback(module)
        except Exception as exc:  # noqa: BLE001
            _fail_soft("hook installation", exc)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``module_name`` is first executed."""

    def __init__(self, module_name: str, callback: Callable[[Any], None]):
        self.module_name = module_name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _CallbackLoader(spec.loader, self.callback)
                return spec
        return None


def _beat(what: str) -> None:
    """Tell the heartbeat (if any) that a forward began / a step ended; never raises into vLLM."""
    if not _heartbeat:
        return
    try:
        getattr(_heartbeat[0], what)()
    except Exception as exc:  # noqa: BLE001
        log.error("moe-eplb exporter: the heartbeat failed (%s: %s); liveness no longer sees a stuck worker",
                  type(exc).__name__, exc)
        _heartbeat.clear()


def install(factory: RecorderFactory, heartbeat: Any = None, live: Callable[[Any], Any] | None = None) -> None:
    """Patch ``EplbState`` now if vLLM's EPLB module is loaded, else as soon as it is. ``heartbeat``:
    told when a forward begins and when an EPLB step ends (the liveness probe's stuck check);
    ``live``: the live-apply factory (:mod:`moe_eplb.exporter.live`)."""
    _heartbeat[:] = [heartbeat] if heartbeat is not None else []

    def apply(module: Any) -> None:
        cls = getattr(module, "EplbState", None)
        if cls is None:
            _fail_soft("hook installation", UnsupportedLayout(f"{EPLB_MODULE} has no EplbState"))
            return
        patch_eplb_state(cls, factory, live)

    module = sys.modules.get(EPLB_MODULE)
    if module is not None:
        apply(module)
        return
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(EPLB_MODULE, apply))
