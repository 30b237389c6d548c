"""Cost of the per-expert load exporter for a DeepSeek-V3 shape, and series per pod in each mode.

    python bench/bench_exporter.py [--steps 2000] [--layers 58] [--experts 256] [--redundant 32]
                                   [--ep 32] [--device cpu|cuda] [--budget-us 200]

Measures, with the exporter's real code (hook, recorder, snapshot writer, collector) on an
``EplbState`` stand-in with vLLM 0.32's layout and tensor shapes:

* per engine step: the CPU time the patched ``EplbState.step`` adds on the step loop (the original
  step is a no-op here, so everything timed is the exporter: the two accumulation kernels, clearing
  the pass, keeping the recording flag on, and the read-back bookkeeping, amortised over
  ``--flush-seconds``). On ``--device cuda`` these are kernel launches (asynchronous); on CPU the
  kernels run inline, so the CPU figure is an upper bound of the host cost;
* per read-back: folding one copy of the accumulators into the host totals (every flush);
* per scrape: reading the snapshot files and rendering /metrics, full and reduced;
* series per pod in each mode (one pod holding all EP ranks);
* the operator's load reader on Prometheus answers for ``--reader-pods`` pods, a 30-minute window
  of 15 s buckets (raw samples every 15 s): parsing, exact increments, trace assembly.

Exit status 1 if the per-step cost exceeds ``--budget-us`` (default 200 us = 1 % of a 20 ms decode
step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types

import numpy as np
from prometheus_client.exposition import generate_latest  # noqa: E402

from moe_eplb.exporter import hook, snapshot  # noqa: E402
from moe_eplb.exporter.collector import PodCollector  # noqa: E402
from moe_eplb.exporter.recorder import SnapshotWriter, StateRecorder  # noqa: E402
from moe_eplb.exporter.server import make_registry  # noqa: E402


def make_state_class(torch, L, E, R, device):
    P = E + R

    class ModelState:
        def __init__(self):
            self.model = types.SimpleNamespace(num_moe_layers=L, num_logical_experts=E, num_physical_experts=P)
            p2l = [*range(E), *[i % E for i in range(R)]]
            self.physical_to_logical_map = torch.tensor([p2l] * L, device=device)
            cnt = np.bincount(p2l, minlength=E)
            self.logical_replica_count = torch.tensor(np.tile(cnt, (L, 1)), device=device)
            self.expert_load_pass = torch.zeros((L, P), dtype=torch.int32, device=device)
            self.model_name = "deepseek-ai/DeepSeek-V3"

    class EplbState:  # vLLM 0.32 layout (gated recording), step() does nothing
        def __init__(self):
            self.model_states = {"h": ModelState()}
            self.should_record_tensor = torch.ones((), dtype=torch.bool, device=device)
            self.parallel_config = types.SimpleNamespace(
                eplb_config=types.SimpleNamespace(window_size=1000, step_interval=3000, num_redundant_experts=R))
            self.is_async = True

        def step(self, is_dummy=False, is_profile=False, log_stats=False):
            return None

        def rearrange(self, is_profile=False):
            return None

    return EplbState


def bench_reader(L: int, E: int, pods: int, buckets: int = 120, bucket: float = 15.0) -> float:
    """Seconds for ``trace_from_raw_counters`` on synthetic Prometheus answers (raw samples)."""
    from moe_eplb.metrics.assemble import trace_from_raw_counters
    from moe_eplb.metrics.grid import grid_for
    from moe_eplb.metrics.series import parse_matrix

    grid = grid_for(1_000_000.0, buckets * bucket, bucket)
    ts = (np.arange(grid[0] - 10, grid[-1], bucket) + 3).tolist()
    rng = np.random.default_rng(0)
    res, steps, starts = [], [], []
    for p in range(pods):
        pod = {"pod": f"p{p}", "model_name": "m", "namespace": "ns", "moeinference": "x"}
        values = np.cumsum(rng.integers(0, 100, size=(L * E, len(ts))), axis=1).astype(str)
        for i in range(L * E):
            res.append({"metric": {**pod, "layer": str(i // E), "expert": str(i % E)},
                        "values": [[t, v] for t, v in zip(ts, values[i])]})
        steps.append({"metric": pod, "values": [[t, str(10 * k)] for k, t in enumerate(ts)]})
        starts.append({"metric": pod, "values": [[t, "5"] for t in ts]})

    def body(r):
        return {"status": "success", "data": {"resultType": "matrix", "result": r}}

    t0 = time.perf_counter()
    trace_from_raw_counters(parse_matrix(body(res), "e"), parse_matrix(body(steps), "s"), grid,
                            start_times=parse_matrix(body(starts), "t"))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--flush-seconds", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget-us", type=float, default=200.0)
    ap.add_argument("--reader-pods", type=int, default=2)
    args = ap.parse_args()
    import torch

    L, E, R, EP = args.layers, args.experts, args.redundant, args.ep
    device = torch.device(args.device)
    cls = make_state_class(torch, L, E, R, device)
    plain = cls()
    tmp = tempfile.mkdtemp(prefix="bench-exporter-")
    writer = SnapshotWriter(tmp)
    recs = []

    def factory(state, layout):
        rec = StateRecorder(state, layout, writer, flush_seconds=args.flush_seconds, ep_info=lambda: (0, EP))
        recs.append(rec)
        return rec

    # baseline: the unpatched no-op step
    rng = np.random.default_rng(0)
    loads = [torch.from_numpy(rng.integers(0, 64, size=(L, E + R)).astype(np.int32)).to(device) for _ in range(8)]

    def run(state, n):
        ms = state.model_states["h"]
        times = []
        for i in range(n):
            ms.expert_load_pass.copy_(loads[i % len(loads)])  # what the router would have recorded
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state.step()
            times.append(time.perf_counter() - t0)
        return times

    base = run(plain, args.steps)
    assert hook.patch_eplb_state(cls, factory)
    st = cls()
    run(st, 50)  # warm-up, attach
    timed = run(st, args.steps)
    rec = recs[0]
    rec.flush_now()
    writer.flush()
    # read-back bookkeeping alone
    fold = []
    for _ in range(20):
        t0 = time.perf_counter()
        rec.start_readback()
        rec.flush_now()
        fold.append(time.perf_counter() - t0)
    writer.flush()

    # scrape cost and series counts: a pod with all EP ranks (one snapshot file per rank)
    m = rec.models[0].to_snapshot()
    for r in range(EP):
        snapshot.write(tmp, snapshot.WorkerSnapshot(pid=100000 + r, time=0, models=[
            snapshot.ModelSnapshot(**{**m.__dict__, "ep_rank": r})]))
    scrape = {}
    for mode in ("full", "reduced"):
        coll = PodCollector(tmp, mode)
        reg = make_registry(coll)
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            body = generate_latest(reg)
            t.append(time.perf_counter() - t0)
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        scrape[mode] = (statistics.median(t) * 1e3, series, len(body))

    reader_s = bench_reader(L, E, args.reader_pods)
    per_step_us = (statistics.median(timed) - statistics.median(base)) * 1e6
    mean_step_us = (statistics.mean(timed) - statistics.mean(base)) * 1e6
    print(f"exporter cost, DeepSeek-V3 shape: {L} layers x {E} experts, {R} redundant, EP {EP}, "
          f"device {device.type}, flush every {args.flush_seconds:g} s")
    print(f"{'what':44s} {'value':>12s}")
    print(f"{'per engine step, median (us)':44s} {per_step_us:12.1f}")
    print(f"{'per engine step, mean incl. read-backs (us)':44s} {mean_step_us:12.1f}")
    print(f"{'  share of a 20 ms decode step (median)':44s} {per_step_us / 20000 * 100:11.3f}%")
    print(f"{'per read-back fold + snapshot submit (ms)':44s} {statistics.median(fold) * 1e3:12.2f}")
    for mode, (ms, series, size) in scrape.items():
        print(f"{'series per pod, ' + mode:44s} {series:12d}")
        print(f"{'  /metrics render, ' + mode + ' (ms / kB)':44s} {ms:8.1f} / {size // 1024:d}")
    print(f"{'reader, ' + str(args.reader_pods) + ' pods, 120 x 15 s buckets (s)':44s} {reader_s:12.2f}")
    ok = per_step_us <= args.budget_us
    print(f"budget {args.budget_us:g} us per step: {'OK' if ok else 'EXCEEDED'}; "
          f"reduced mode {'<' if scrape['reduced'][1] < 20000 else '>='} 20000 series")
    return 0 if ok and scrape["reduced"][1] < 20000 else 1


if __name__ == "__main__":
    sys.exit(main())
