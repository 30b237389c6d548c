"""Golden copies of user-visible output. ``tune-*.json`` were made with the code before the
typed-model refactor (issue 10) and must not change; ``render-*.yaml`` likewise, regenerated once on
purpose when the exporter injection (issue 14: an init container, a volume, PYTHONPATH) and plain
YAML output (no anchors) changed what ``moe-eplb render`` prints, once more when the seed and
DeepSeek-V3 examples moved to the stock ``vllm/vllm-openai`` image (the plugin injected), and
``render-deepseek-v3-multinode`` once more when the PodMonitor of a multi-node resource started
copying the LWS group labels onto the series (issue 13: ``replica_group``, ``group_worker``,
``group_size``), and once more when the worker's argv moved from its ``sh -c`` script into container
``args`` (issue 24: no user text in a script Kubernetes expands ``$(VAR)`` in).
``render-qwen3-30b-a3b-autoscaled`` was made with its example (issue 20:
``spec.autoscaling``, the KEDA ScaledObject as the last child). ``render-deepseek-v3-deepep-rdma``,
``render-qwen3-30b-a3b-restricted``, ``-kueue`` and ``-s3-streamer`` were made with their examples
(``spec.engine.podTemplate`` merged into the engine pods); the existing goldens did not change.
Every ``render-*.yaml`` was regenerated once more when the engine pods got their drain (the
exporter's ``/drain`` preStop hook, ``--shutdown-timeout``, ``terminationGracePeriodSeconds`` from
``spec.engine.drainSeconds``), the exporter's ``/readyz`` and ``/livez`` probes (workers included), and
the ``sh -c`` command that cleans ``/dev/shm`` before ``vllm serve``.
``render-deepseek-v3-fault-tolerant`` was made with its example (vLLM 0.34: fault tolerance, the all2all
backend, the redundancy floor).
Every ``render-*.yaml`` with a PodMonitor or a LeaderWorkerSet was regenerated once more for the
experiments: the PodMonitor copies the pods' ``eplb.ai/arm`` label to ``arm``, and a LeaderWorkerSet
renders its rolling-update ``partition`` (0 outside an experiment).
Every ``render-*.yaml`` was regenerated once more when the engine pods started mounting the operator's
control token (the ``eplb-control`` Secret volume and ``MOE_EPLB_CONTROL_TOKEN_FILE``).
``render-deepseek-v3-elastic`` was made with its example (issue 39: an elastic group, founders in a
LeaderWorkerSet, the joining pods' StatefulSet, the NetworkPolicy); the others did not change.

Every ``render-*.yaml`` was regenerated once more for issue 37 (launch as vLLM runs it): the leader
of a multi-node group without ``--data-parallel-start-rank`` (vLLM's internal load balancing over every
rank), several API servers a pod rendered from the layout (container and Service ports ``http-1``...,
the supervisor's ``dp-supervisor`` health port, a PodMonitor endpoint each, ``MOE_EPLB_API_PORTS``),
and the drain as an ``exec`` preStop (the exporter takes it from loopback only);
``render-qwen3-235b-mi300x-rocm`` was made with its example.

The ``tune-*.json`` goldens were regenerated once, on purpose, when the tuner started asking whether
EPLB is worth it (issue 41): keys were added (``recommendation.enabled``/``mode``/``advice``,
``baselines.eplb_off``, each candidate's ``enabled``, the breakdown's ``overlap_factor``/``overlap_seconds``,
the cost model's overlap fields); every value that was there before was checked unchanged.
Every ``render-*.yaml`` was regenerated once more for live apply (issue 40): the live-settings ConfigMap
``<name>-eplb-live`` as the first child, its ``eplb-live`` volume, ``MOE_EPLB_LIVE_FILE`` and
``MOE_EPLB_CONFIG_HASH`` in the engine container (the goldens also caught up with the ``exec`` preStop
drain, which had changed without them).

``make_trace()`` builds the fixed trace the tune golden was made on (NumPy only, seeded), so the
golden does not depend on the workload generator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: keys whose values are timings (they differ run to run); dropped before comparing
TIMING_KEYS = ("seconds", "evaluate_seconds")


def make_trace() -> dict:
    """The file-format dict of the fixed trace: 96 buckets x 6 layers x 32 experts, a popularity
    that drifts from one Dirichlet draw to another, Poisson counts."""
    rng = np.random.default_rng(20261203)
    T, L, E, top_k = 96, 6, 32, 8
    pop_a = rng.dirichlet(np.full(E, 0.3), size=L)
    pop_b = rng.dirichlet(np.full(E, 0.3), size=L)
    steps = rng.integers(40, 60, size=T)
    load = np.stack([rng.poisson(((1 - m) * pop_a + m * pop_b) * s * 16 * top_k)
                     for m, s in zip(np.linspace(0.0, 1.0, T), steps)])
    return {"num_layers": L, "num_experts": E, "bucket_steps": steps.tolist(), "load": load.tolist(),
            "bucket_seconds": 15.0, "top_k": top_k, "model": "golden"}


#: relative tolerance for floats: the compiled kernels (``eplb/replay/kernels.py``) and the NumPy fallback sum
#: in different orders, and Numba's code differs by CPU (vector width, FMA), so the same tune agrees
#: to ~1e-9, not to the last bit; a change a user could see is far larger than this
FLOAT_REL = 1e-7


def approx_floats(value):
    """``value`` with every float replaced by ``pytest.approx(rel=FLOAT_REL)``, so ``got == want``
    compares strings, ints, keys and list lengths exactly and floats to round-off."""
    import pytest

    if isinstance(value, dict):
        return {k: approx_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [approx_floats(v) for v in value]
    if isinstance(value, float):
        return pytest.approx(value, rel=FLOAT_REL, abs=1e-12)
    return value


def strip_timings(value):
    """``value`` without the :data:`TIMING_KEYS` anywhere inside."""
    if isinstance(value, dict):
        return {k: strip_timings(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [strip_timings(v) for v in value]
    return value
