"""Elastic wide-EP groups (``spec.parallelism.elastic``): vLLM's facts, the pure arithmetic of a
resize, and the ``status.elastic`` record (typed).

Facts read from vLLM's own code (0.33.0 and 0.34.0 carry the same external elastic EP; the contract
tests in tests/controller/test_elastic_vllm_router.py and tests/api/test_api_elastic.py read them):

* ``--enable-elastic-ep`` needs ``--enable-eplb``, no pipeline parallelism, not
  ``--data-parallel-hybrid-lb``; with async EPLB it needs NIXL (``config/parallel.py``
  ``ParallelConfig.__post_init__``). ``--elastic-ep-max-dp-size`` is the ceiling of any scale-up and
  must be at least the launch size (default: the launch size, i.e. no growth).
* External mode (``distributed/elastic_ep/external_elastic_ep.py``, new in 0.33): with external load
  balancing every API server holds an ``ExternalElasticEPScaleCoordinator``; an orchestrator POSTs
  ``/scale_elastic_ep`` ``{"new_data_parallel_size", "drain_timeout"}`` to EVERY old rank's API
  (the request gate is per process) and follows ``POST /is_scaling_elastic_ep``'s ``phase``
  (:data:`VLLM_PHASES`), ``epoch``, ``error`` and ``requested_data_parallel_size``, read from the
  group's coordination store (``entrypoints/serve/elastic_ep/api_router.py``).
* New ranks are launched by the orchestrator with ``VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1``
  (``v1/engine/core.py``: the engine then decodes the scale-up handshake, which carries the new DP
  size, the master ports and the target redundancy) and handshake with rank 0's temporary listener on
  ``--data-parallel-rpc-port`` at ``--data-parallel-address``.
* The redundancy follows the resize (``_calculate_num_redundant_experts``):
  ``R' = (E + R) * DP' // DP - E``; a negative ``R'`` is refused ("the target topology cannot retain
  all model experts"). So the physical slots per GPU stay constant: ``(E + R') / (TP x DP') ==
  (E + R) / (TP x DP)``, and ``E + R'`` always divides over the new EP size when ``E + R`` divided
  over the old one. A chain of resizes lands where a direct one does.
* Serving during a resize (``entrypoints/serve/elastic_ep/middleware.py``, ``v1/engine/async_llm.py``):
  after ``prepare`` succeeded every old rank answers 503 ("The model is currently scaling") to
  anything but ``/health`` and ``/is_scaling_elastic_ep`` until its commit succeeded; a rank retired
  by a shrink answers 503 ("retired and is awaiting shutdown") until the orchestrator removes it.
  A failure after ``prepare`` leaves the gate closed in external mode (nothing clears it): the group
  then serves nothing until it restarts. A failure during ``prepare`` (a new rank that never becomes
  ready, a refused size) leaves the old ranks serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_eplb.api.versions import Version

#: the first release with external elastic EP (one API server per rank, the phases in the shared
#: store): 0.33.0; 0.32's ParallelConfig refuses elastic EP with external load balancing
ELASTIC_EXTERNAL_SINCE: Version = (0, 33, 0)
#: vLLM's phases of an external elastic EP operation (``ExternalElasticEPScalePhase``)
VLLM_IDLE, VLLM_PREPARING, VLLM_COMMITTING, VLLM_FAILED, VLLM_COMPLETED = (
    "idle", "preparing", "committing", "failed", "completed")
VLLM_PHASES = (VLLM_IDLE, VLLM_PREPARING, VLLM_COMMITTING, VLLM_FAILED, VLLM_COMPLETED)
#: HTTP paths of a rank's API server (vLLM's router)
SCALE_PATH = "/scale_elastic_ep"
STATUS_PATH = "/is_scaling_elastic_ep"
#: ``drain_timeout``'s default in vLLM's router (seconds)
DEFAULT_DRAIN_TIMEOUT = 120
#: the env a newly launched rank must carry so that its engine decodes the scale-up handshake
SCALE_UP_LAUNCH_ENV = "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH"
#: vLLM's own bounds inside one operation (``external_elastic_ep.py``): rank 0 waits this long for
#: every new rank to be ready to commit (``_wait_for_ready_ranks``), then each rank this long for the
#: commit (``_wait_for_local_reconfig_finished``, ``_wait_for_all_old_ranks``)
VLLM_PREPARE_TIMEOUT_S = 300.0
VLLM_COMMIT_TIMEOUT_S = 600.0

# --- the operator's phases (status.elastic.phase) --------------------------------------------------
#: the group runs ``dataParallel`` ranks and nothing is under way
STABLE = "Stable"
#: the group (re)starts at its launch size (``spec.parallelism.data``); resizes wait for it
LAUNCHING = "Launching"
#: grow: the new ranks' pods are created and must start (scheduled, containers running)
STARTING = "Starting"
#: shrink: the retiring pods are taken out of the Service and finish what they serve
DRAINING = "Draining"
#: ``/scale_elastic_ep`` sent to every old rank; vLLM prepares (new ranks handshake, load, join)
PREPARING = "Preparing"
#: vLLM commits (every old rank paused briefly, then the new topology serves)
COMMITTING = "Committing"
#: shrink committed: the retired ranks' pods are removed
RETIRING = "Retiring"
#: the operation failed or timed out while the old ranks still serve: the new pods are removed
ROLLING_BACK = "RollingBack"
#: the operation failed after vLLM paused the old ranks (nothing clears the pause): the group is
#: restarted at its launch size, then grown back
RESTARTING_GROUP = "RestartingGroup"
#: the last operation failed and was rolled back: the group serves ``dataParallel``; the same target is
#: tried again after :data:`RETRY_AFTER_S` (a new target at once)
FAILED = "Failed"
PHASES = (STABLE, LAUNCHING, STARTING, DRAINING, PREPARING, COMMITTING, RETIRING, ROLLING_BACK,
          RESTARTING_GROUP, FAILED)
#: phases of an operation in progress (the ``Resizing`` condition is True)
IN_PROGRESS = (STARTING, DRAINING, PREPARING, COMMITTING, RETIRING, ROLLING_BACK, RESTARTING_GROUP)
#: a failed target is tried again this long after the failure
RETRY_AFTER_S = 600.0


class ElasticError(ValueError):
    """A resize vLLM would refuse (the message says why)."""


def redundancy_at(num_experts: int, redundant: int, from_data: int, to_data: int) -> int:
    """vLLM's redundancy after resizing from ``from_data`` to ``to_data`` data-parallel ranks
    (``_calculate_num_redundant_experts``): ``(E + R) * DP' // DP - E``. Raises :class:`ElasticError`
    when it is negative (vLLM: "the target topology cannot retain all model experts")."""
    if from_data < 1 or to_data < 1:
        raise ElasticError(f"data-parallel sizes must be positive ({from_data} -> {to_data})")
    r = (num_experts + redundant) * to_data // from_data - num_experts
    if r < 0:
        raise ElasticError(f"{to_data} data-parallel ranks cannot hold all {num_experts} experts "
                           f"({(num_experts + redundant) // from_data} slots per rank at launch)")
    return r


def sizes(min_data: int, max_data: int, step: int) -> tuple[int, ...]:
    """Every size a group may run, in pod steps: ``min_data, min_data + step, ..., max_data``."""
    if step < 1 or min_data < 1 or max_data < min_data:
        return ()
    return tuple(range(min_data, max_data + 1, step))


def size_problem(num_experts: int | None, redundant: int, tensor: int, launch: int, target: int) -> str | None:
    """Why vLLM would refuse to resize a group launched at ``launch`` ranks with ``redundant``
    redundant experts to ``target`` ranks, or None: the target's ``R'`` negative, or ``E + R'`` not
    divisible by the new EP size ``tensor x target`` (only possible where ``E + R`` did not divide at
    launch). Without the expert count nothing can be said (None)."""
    if not num_experts:
        return None
    try:
        r = redundancy_at(num_experts, redundant, launch, target)
    except ElasticError as exc:
        return str(exc)
    ep = tensor * target
    if (num_experts + r) % ep:
        return (f"at {target} data-parallel ranks vLLM runs {r} redundant experts, and experts + redundant "
                f"({num_experts + r}) does not divide over the EP size {ep}")
    return None


def pods_for(data: int, data_local: int) -> int:
    """Pods of ``data_local`` ranks that hold ``data`` ranks (rounded up)."""
    return -(-data // max(1, data_local))


@dataclass(frozen=True)
class ElasticStatus:
    """``status.elastic``: ``dataParallel`` (ranks of the committed topology), ``targetDataParallel``
    (the size being driven to), ``phase`` (:data:`PHASES`), ``epoch`` (vLLM's epoch of the current or
    last operation) and ``lastError`` (why the last operation failed, for the record)."""

    data_parallel: int
    target_data_parallel: int
    phase: str = STABLE
    epoch: str | None = None
    last_error: str | None = None

    @property
    def in_progress(self) -> bool:
        return self.phase in IN_PROGRESS

    @property
    def growing(self) -> bool:
        return self.target_data_parallel > self.data_parallel

    def to_crd(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dataParallel": self.data_parallel, "targetDataParallel": self.target_data_parallel,
                               "phase": self.phase}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        if self.last_error is not None:
            out["lastError"] = self.last_error
        return out


def parse_status(raw: Any) -> ElasticStatus | None:
    """``status.elastic`` as stored, or None when absent or unreadable (the operator then starts over
    from the launch size: what a freshly (re)started group runs)."""
    if not isinstance(raw, Mapping):
        return None
    dp, target, phase = raw.get("dataParallel"), raw.get("targetDataParallel"), raw.get("phase")
    if not (isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1):
        return None
    if not (isinstance(target, int) and not isinstance(target, bool) and target >= 1):
        target = dp
    if phase not in PHASES:
        phase = STABLE
    epoch, error = raw.get("epoch"), raw.get("lastError")
    return ElasticStatus(dp, target, phase, epoch if isinstance(epoch, str) else None,
                         error if isinstance(error, str) else None)


def planned_size(st: ElasticStatus, launch: int) -> int:
    """The data-parallel ranks whose pods should exist in phase ``st.phase``: the target while a grow
    starts, prepares or commits (the new pods must be there to join); the launch size while the group
    (re)starts; else the committed size (a rollback removes the new pods, a committed shrink the
    retired ones)."""
    if st.phase in (LAUNCHING, RESTARTING_GROUP):
        return launch
    if st.growing and st.phase in (STARTING, PREPARING, COMMITTING):
        return st.target_data_parallel
    return st.data_parallel


def joiner_pods(st: ElasticStatus, launch: int, data_local: int) -> int:
    """Pods of the joiners' StatefulSet in phase ``st.phase`` (:func:`planned_size` above the launch size)."""
    return max(0, pods_for(planned_size(st, launch) - launch, data_local))


def joiner_launch_size(st: ElasticStatus) -> int:
    """``--data-parallel-size`` of a pod created now: the size it joins while a grow starts, prepares or
    commits, else the committed size (so a deferred or failed target does not touch the template;
    vLLM's handshake gives a joining rank the size of the operation anyway)."""
    grow = st.growing and st.phase in (STARTING, PREPARING, COMMITTING)
    return st.target_data_parallel if grow else st.data_parallel
