"""vLLM's own rearrangement health signals, for the recorder (vLLM 0.34 and later).

vLLM 0.34 reports two things about asynchronous EPLB that earlier releases keep to themselves
(``vllm_facts.ASYNC_*``; read from its ``distributed/eplb/`` code):

* every async rearrangement cycle ends, on EP rank 0, with the log line "Async EPLB rearranged
  N/M layers of <model> in T s" (logger ``vllm.distributed.eplb.async_worker``, emitted from the
  async worker thread): :class:`AsyncLogTap`, a logging handler on that logger, keeps the
  arguments for the next step to take (no parsing of formatted text; vLLM's log level must let INFO
  through, its default);
* when the async worker thread dies, its exception is kept in ``EplbState.async_worker_error`` on
  that rank, and the next ``EplbState.step`` raises ``RuntimeError("Async EPLB worker failed on at
  least one rank ...")`` on every rank (the worker's exception as ``__cause__`` on the failing
  one): :func:`failure_of` recognises it, so the hook can count it before vLLM's exception goes on
  up (unchanged).

Whether an engine has these signals is seen on the object (``async_worker_error`` exists:
``EplbLayout.health_signals``), not read from a version string.
"""

from __future__ import annotations

import logging
from collections import deque

from moe_eplb.contracts import vllm_facts


class AsyncLogTap(logging.Handler):
    """Keeps ``(vLLM model name, layers moved, layers, seconds)`` of each "Async EPLB rearranged"
    record. ``emit`` runs in vLLM's async worker thread; :meth:`drain` in the step thread (a deque's
    append and popleft are atomic)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.cycles: deque[tuple[str, int, int, float]] = deque(maxlen=4096)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if record.msg != vllm_facts.ASYNC_REARRANGED_LOG or not isinstance(args, tuple) or len(args) != 4:
            return
        try:
            done, total, name, seconds = args
            self.cycles.append((str(name), int(done), int(total), float(seconds)))
        except (TypeError, ValueError):
            return

    def drain(self) -> list[tuple[str, int, int, float]]:
        out = []
        while self.cycles:
            out.append(self.cycles.popleft())
        return out


def attach_tap() -> AsyncLogTap:
    tap = AsyncLogTap()
    logging.getLogger(vllm_facts.ASYNC_WORKER_LOGGER).addHandler(tap)
    return tap


def detach_tap(tap: AsyncLogTap) -> None:
    logging.getLogger(vllm_facts.ASYNC_WORKER_LOGGER).removeHandler(tap)


def failure_of(exc: BaseException) -> BaseException | None:
    """The async worker failure behind ``exc`` (raised by ``EplbState.step``): the worker's own
    exception where this rank has it, else ``exc``; None when ``exc`` is something else."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(vllm_facts.ASYNC_WORKER_FAILED):
        return exc.__cause__ or exc
    return None
