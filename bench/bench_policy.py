"""Time one EPLB policy call: moe-eplb's NumPy policy vs vLLM 0.32's, DeepSeek-V3 shape.

    python bench/bench_policy.py [--repeats 30] [--min-ratio 5]

Shape: 58 MoE layers x 256 experts, 288 physical slots (32 redundant), 32 GPUs, 4 nodes,
8 expert groups (hierarchical policy). Load: skewed integer token counts (log-normal, as
routers produce), a few different matrices, each call timed separately; the table shows the
median. Every output is checked identical to vLLM's before any time is reported. Runs on one
thread (torch and BLAS pinned to 1), as the tuner does.

Also shows the batched entry point the simulator/tuner uses (``rebalance_batch``), per matrix.
Exit status 1 if outputs differ or the ratio is below ``--min-ratio``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from moe_eplb.eplb.policy import rebalance, rebalance_batch  # noqa: E402

LAYERS, EXPERTS = 58, 256
SIZES = dict(num_replicas=288, num_groups=8, num_nodes=4, num_gpus=32)


def _regen():
    path = Path(__file__).resolve().parents[1] / "tests" / "eplb" / "fixtures" / "regen.py"
    spec = importlib.util.spec_from_file_location("policy_fixture_regen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median_ms(fns, inputs, repeats: int) -> list[float]:
    """Median ms per call of each function; calls are interleaved (f1, f2, f1, f2, ...) so that
    other load on the machine hits every function alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        w = inputs[r % len(inputs)]
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(w)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per row")
    parser.add_argument("--batch", type=int, default=64, help="matrices per rebalance_batch call")
    parser.add_argument("--min-ratio", type=float, default=0.0,
                        help="exit 1 if vLLM time / ours is below this")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    inputs = [(rng.lognormal(6.0, 1.2, size=(LAYERS, EXPERTS))).astype(np.int64) for _ in range(5)]
    sizes = tuple(SIZES.values())
    rows: list[tuple[str, float]] = []

    def ours_call(w):
        return rebalance(w, *sizes)

    ours = [ours_call(w) for w in inputs]  # warm-up and reference
    batch = np.stack([inputs[i % len(inputs)] for i in range(args.batch)])
    batch_times = []
    for _ in range(3):
        t0 = time.perf_counter()
        b_phy2log, _ = rebalance_batch(batch, *sizes)
        batch_times.append(time.perf_counter() - t0)
    batch_ms = statistics.median(batch_times) * 1e3 / args.batch
    rows.append((f"moe-eplb rebalance_batch, per matrix (B={args.batch})", batch_ms))
    same_batch = all(np.array_equal(b_phy2log[i], ours[i % len(inputs)][0])
                     for i in range(args.batch))

    regen = _regen()
    missing = regen.vllm_missing_reason()
    ratio = None
    identical = same_batch
    if missing is None:
        import torch

        torch.set_num_threads(1)
        vllm = regen.VllmPolicy()
        policy = vllm.policy

        def vllm_call(w):
            return policy.rebalance_experts(torch.from_numpy(w), *sizes)

        theirs = [vllm(w, *sizes) for w in inputs]
        identical = identical and all(
            all(np.array_equal(a, b) for a, b in zip(o, t)) for o, t in zip(ours, theirs))
        vllm_ms, maps_ms, ours_ms = _median_ms(
            [vllm_call, lambda w: vllm(w, *sizes), ours_call], inputs, args.repeats)
        rows.insert(0, (f"vLLM {vllm.version} DefaultEplbPolicy.rebalance_experts", vllm_ms))
        rows.insert(1, ("vLLM rebalance_experts + compute_logical_maps", maps_ms))
        ratio = vllm_ms / ours_ms
    else:
        (ours_ms,) = _median_ms([ours_call], inputs, args.repeats)
    rows.insert(len(rows) - 1, ("moe-eplb rebalance (phy2log + log2phy + logcnt)", ours_ms))

    width = max(len(name) for name, _ in rows)
    print(f"EPLB policy, one call: {LAYERS} layers x {EXPERTS} experts, "
          + ", ".join(f"{k}={v}" for k, v in SIZES.items()) + f"; median of {args.repeats}")
    print(f"{'':<{width}}  {'ms/call':>9}")
    for name, ms in rows:
        print(f"{name:<{width}}  {ms:9.2f}")
    print(f"identical to vLLM: {'yes' if identical and missing is None else 'no' if not identical else 'not checked'}"
          + (f" ({missing})" if missing else ""))
    if ratio is not None:
        print(f"speed-up (vLLM rebalance_experts / moe-eplb rebalance): {ratio:.1f}x")
        print(f"speed-up, batched (vLLM / moe-eplb rebalance_batch per matrix): "
              f"{rows[0][1] / batch_ms:.1f}x")
    if not identical:
        print("FAIL: outputs differ from vLLM's", file=sys.stderr)
        return 1
    if ratio is not None and ratio < args.min_ratio:
        print(f"FAIL: speed-up {ratio:.1f}x below --min-ratio {args.min_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
