"""Every class of hostile input, through the real CLI: outcome, time and memory.

    python bench/bench_hostile_inputs.py [--only PREFIX] [--timeout 60]

Builds each hostile file in a temporary directory (the big ones in a few MB: gzip members repeated,
zeros streamed into an ``.npz``, a sparse file), runs ``python -m moe_eplb ...`` on it as a fresh
process, and prints one row per run: class, input, command, exit status, seconds, peak RSS of the
process (``wait4``) and the first line of its stderr. Expected: exit 1 (a bad file) or 2 (a bad
flag) with one line naming the file and field, in a few seconds and well under 1 GB; exit 0 only
where the row says the input is accepted on purpose. A ``Traceback`` anywhere is a failure (the
script exits 1).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))  # this checkout's code, as in the CLI runs below
EXAMPLES = REPO / "examples"
SIM = ["--ep-size", "4", "--window", "10", "--interval", "10", "--redundant", "0"]


def _trace(**changes) -> dict:
    d = {"num_layers": 2, "num_experts": 8, "bucket_steps": [40] * 6, "load": [[[5] * 8] * 2] * 6,
         "bucket_seconds": 15.0}
    d.update(changes)
    return d


def _json(tmp: Path, name: str, value) -> Path:
    path = tmp / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def _npz(tmp: Path, name: str, members: list[tuple[str, np.ndarray]]) -> Path:
    import warnings

    path = tmp / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for member, arr in members:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr, allow_pickle=False)
            z.writestr(member, buf.getvalue())
    return path


def gzip_bomb(tmp: Path, name: str, gigabytes: float, unit: bytes = b"0,") -> Path:
    """``[0,0,0,...`` (or another ``unit``) expanding to ``gigabytes`` GB: one 64 MiB gzip member, repeated."""
    chunk = gzip.compress(unit * (64 * 2**20 // len(unit)), 9)
    path = tmp / name
    with open(path, "wb") as fh:
        fh.write(gzip.compress(b"["))
        for _ in range(int(gigabytes * 1e9 / (64 * 2**20))):
            fh.write(chunk)
    return path


def npz_declaring(tmp: Path, name: str, shape: tuple[int, ...]) -> Path:
    """A real ``.npz`` whose ``load`` is ``shape`` float64 zeros, streamed (tiny on disk)."""
    path = tmp / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for key, arr in (("num_layers", np.array(shape[1])), ("num_experts", np.array(shape[2])),
                         ("bucket_steps", np.full(shape[0], 400))):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr)
            z.writestr(f"{key}.npy", buf.getvalue())
        with z.open("load.npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array_header_1_0(fh, {"descr": "<f8", "fortran_order": False, "shape": shape})
            left = int(np.prod(shape)) * 8
            zeros = bytes(16 * 2**20)
            while left:
                fh.write(zeros[: min(left, len(zeros))])
                left -= min(left, len(zeros))
    return path


def _manifest(tmp: Path, name: str, change) -> Path:
    doc = [d for d in yaml.safe_load_all((EXAMPLES / "qwen3-30b-a3b-autotune.yaml").read_text())
           if d and d.get("kind") == "MoEInference"][0]
    change(doc)
    path = tmp / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _set(path: str, value):
    def change(doc):
        obj = doc
        keys = path.split(".")
        for k in keys[:-1]:
            obj = obj.setdefault(k, {})
        obj[keys[-1]] = value
    return change


def cases(tmp: Path):
    """(class, input, argv) of every row."""
    deep = "[" * 100_000 + "]" * 100_000
    routing = {"kind": "token_routing_sequence", "num_experts": 8, "top_k": 2, "experts": [[[0, 1], [2, 3]]] * 4}
    bomb = gzip_bomb(tmp, "bomb.json.gz", 1.9)
    bomb_small = gzip_bomb(tmp, "bomb-0.2.json.gz", 0.25)
    spaces = gzip_bomb(tmp, "spaces.json.gz", 1.9, b" ")
    big = npz_declaring(tmp, "big.npz", (1900, 1000, 125))
    yield "memory", f"1.9 GB of `0,` in {bomb.stat().st_size / 1e6:.1f} MB .json.gz", ["trace", "info", bomb]
    yield "memory", "same, tune", ["tune", "--trace", bomb, "--ep-size", "4"]
    yield "memory", f"0.25 GB of `0,` (under the size cap) in {bomb_small.stat().st_size / 1e6:.2f} MB .json.gz", \
        ["trace", "info", bomb_small]
    yield "memory", f"1.9 GB of spaces in {spaces.stat().st_size / 1e6:.1f} MB .json.gz", ["trace", "info", spaces]
    yield "memory", f".npz declaring a 1.9 GB load, {big.stat().st_size / 1e6:.1f} MB on disk", ["trace", "info", big]
    yield "memory", "same, simulate", ["simulate", "--trace", big, *SIM]
    yield "memory", "same, tune", ["tune", "--trace", big, "--ep-size", "4"]
    sparse = tmp / "huge-routing.json"
    with open(sparse, "wb") as fh:
        fh.write(b'{"kind": "token_routing_sequence", ')
        fh.truncate(954_000_000)
    for label, value in (("num_experts 10**12", dict(routing, num_experts=10**12)),
                         ("num_experts null", dict(routing, num_experts=None)),
                         ('top_k "abc"', dict(routing, top_k="abc")),
                         ("100,000-deep nesting", '{"kind": "token_routing_sequence", "x": ' + deep + "}")):
        path = _json(tmp, f"routing-{len(label)}.json", value)
        yield "routing", label, ["trace", "info", path]
    yield "routing", "num_experts 10**12, synth --from", [
        "trace", "synth", "--profile", "qwen3-vl-30b-a3b-steady", "--hours", "0.1",
        "--from", _json(tmp, "routing-big.json", dict(routing, num_experts=10**12)), "-o", tmp / "out.json"]
    yield "routing", "954 MB routing file (sparse)", ["trace", "info", sparse]
    inf_layers = _json(tmp, "inf-layers.json", json.dumps(_trace()).replace('"num_layers": 2', '"num_layers": Infinity'))
    for cmd in (["trace", "info", inf_layers], ["calibrate", "--trace", inf_layers],
                ["tune", "--trace", inf_layers, "--ep-size", "4"], ["simulate", "--trace", inf_layers, *SIM]):
        yield "NaN/Infinity", '"num_layers": Infinity', cmd
    nan_bucket = _json(tmp, "nan-bucket.json", json.dumps(_trace(rearrangements=[{"bucket": 1, "seconds": 1}]))
                       .replace('"bucket": 1', '"bucket": NaN'))
    yield "NaN/Infinity", '"rearrangements[0].bucket": NaN', ["calibrate", "--trace", nan_bucket]
    inf_cfg = _json(tmp, "inf-config.json", json.dumps(_trace(config={"window_size": 1, "step_interval": 10,
                                                                        "num_redundant_experts": 0}))
                    .replace('"window_size": 1', '"window_size": Infinity'))
    yield "NaN/Infinity", '"config.window_size": Infinity', ["tune", "--trace", inf_cfg, "--ep-size", "4"]
    ok = [("bucket_steps.npy", np.full(6, 40)), ("load.npy", np.full((6, 2, 8), 5.0)), ("num_experts.npy", np.array(8))]
    yield "NaN/Infinity", ".npz num_layers = inf", ["trace", "info", _npz(tmp, "inf.npz", ok + [
        ("num_layers.npy", np.array(np.inf))])]
    yield "nesting", ".npz config text 100,000 deep", ["tune", "--trace", _npz(tmp, "deep.npz", ok + [
        ("num_layers.npy", np.array(2)), ("config.npy", np.str_(deep))]), "--ep-size", "4"]
    yield "nesting", "rebalance --weights 100,000 deep", [
        "rebalance", "--weights", _json(tmp, "w.json", deep), "--replicas", "8", "--groups", "1", "--nodes", "1",
        "--gpus", "1"]
    for label, changes in (("bucket_steps 1e308", dict(bucket_steps=[1e308] * 6)),
                           ("bucket_steps 2**62", dict(bucket_steps=[2**62] * 6)),
                           ("config knobs 10**30", dict(config={"window_size": 10**30, "step_interval": 10**30,
                                                               "num_redundant_experts": 0})),
                           ("load 1e39 (above float32)", dict(load=[[[1e39] * 8] * 2] * 6)),
                           ("rank sums 10^6 x the load", dict(rank_load=[[[20e6, 20e6]] * 2] * 6)),
                           ("1e6 s rearrangement in a 15 s bucket",
                            dict(rearrangements=[{"bucket": 2, "seconds": 1e6}]))):
        yield "wrong acceptance", label, ["tune", "--trace", _json(tmp, f"w{len(label)}.json", _trace(**changes)),
                                          "--ep-size", "4"]
    dup = json.dumps(_trace()).replace('"num_layers": 2', '"num_layers": 2, "num_layers": 3')
    yield "wrong acceptance", "duplicate key in trace JSON", ["trace", "info", _json(tmp, "dup.json", dup)]
    yield "wrong acceptance", "duplicate .npz member", ["trace", "info", _npz(tmp, "dup.npz", ok + [
        ("num_layers.npy", np.array(2)), ("num_layers.npy", np.array(3))])]
    nul = tmp / "nul.yaml"
    nul.write_bytes((EXAMPLES / "qwen3-30b-a3b-autotune.yaml").read_bytes().replace(b"spec:", b"spec:\0", 1))
    many = tmp / "many.yaml"
    many.write_text("---\n".join(["a: 1\n"] * 6000))
    for cmd in ("validate", "render"):
        yield "manifests", "NUL byte", [cmd, "-f", nul]
        yield "manifests", f"6,000 documents ({many.stat().st_size} bytes)", [cmd, "-f", many]
    for label, change in (("maxModelLen 2**62", _set("spec.engine.maxModelLen", 2**62)),
                          ("shmSize 8Ei", _set("spec.engine.shmSize", "8Ei")),
                          ("memoryBudgetPerGpu 8Ei", _set("spec.autotune.memoryBudgetPerGpu", "8Ei"))):
        yield "manifests", label, ["validate", "-f", _manifest(tmp, f"m{len(label)}.yaml", change)]
    evil = tmp / "evil.yaml"
    doc = [d for d in yaml.safe_load_all((EXAMPLES / "deepseek-v3-multinode.yaml").read_text())
           if d and d.get("kind") == "MoEInference"][0]
    doc["spec"]["engine"]["env"] = [{"name": "EVIL", "value": "'; id; echo '"}]
    doc["spec"]["engine"]["extraArgs"] = ["$(EVIL)"]
    evil.write_text(yaml.safe_dump(doc))
    yield "injection", "env EVIL=\"'; id; echo '\", extraArgs [$(EVIL)]: worker command", ["render", "-f", evil]


def _worker_script(stdout: str) -> str:
    for d in yaml.safe_load_all(stdout):
        if d and d.get("kind") == "LeaderWorkerSet":
            return d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["command"][2]
    return "?"


def run(argv: list, timeout: float) -> tuple[int, float, float, str, str]:
    """(exit status, seconds, peak RSS MB, stdout, stderr) of ``python -m moe_eplb ARGV``."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "operator") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "moe_eplb", *map(str, argv)], stdout=out, stderr=err, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return code, seconds, usage.ru_maxrss / 1024, out.read().decode(errors="replace"), err.read().decode(
            errors="replace")


def _python_depth_scan(text: str, limit: int) -> bool:
    """The per-character pre-scan the bounded reader replaced (for the speed comparison only)."""
    depth = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def scan_speed() -> None:
    """MB/s of the JSON checks on a one-hour DeepSeek-V3-shaped trace (240 x 58 x 256 counts)."""
    from moe_eplb.contracts import bounded_read

    rng = np.random.default_rng(0)
    raw = json.dumps({"model": 'a "quoted" [name]', "load": rng.poisson(40, (240, 58, 256)).tolist()}).encode()
    mb = len(raw) / 1e6
    rows = []
    for name, fn, part in (("value count (bytes.count)", lambda b: bounded_read.json_values(b), raw),
                           ("depth scan (translate + re + NumPy)", lambda b: bounded_read.json_depth(b, 16), raw),
                           ("json.loads (for scale)", json.loads, raw),
                           ("old pure-Python depth pre-scan", lambda b: _python_depth_scan(b.decode(), 16),
                            raw[: len(raw) // 8])):
        start = time.perf_counter()
        fn(part)
        rows.append((name, len(part) / 1e6 / (time.perf_counter() - start)))
    print(f"\nJSON checks on a {mb:.0f} MB trace text:")
    for name, speed in rows:
        print(f"  {name:<38} {speed:>8.0f} MB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="Run only the classes starting with this.")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    failed = False
    print(f"{'class':<17} {'input':<52} {'command':<10} {'exit':>4} {'s':>6} {'MB':>6}  first line of stderr")
    with tempfile.TemporaryDirectory() as tmpdir:
        for klass, label, argv in cases(Path(tmpdir)):
            if not klass.startswith(args.only):
                continue
            code, seconds, rss, stdout, stderr = run(argv, args.timeout)
            lines = [x for x in stderr.splitlines() if x.strip()]
            line = next((x for x in lines if x.startswith("Error")), lines[0] if lines else "")
            if klass == "injection":
                line = "worker script: " + _worker_script(stdout)
            line = line.replace(tmpdir + "/", "")
            failed |= "Traceback" in stderr or code not in (0, 1, 2) or seconds > args.timeout
            print(f"{klass:<17} {label[:52]:<52} {argv[0]:<10} {code:>4} {seconds:>6.2f} {rss:>6.0f}  {line[:160]}",
                  flush=True)
    if not args.only:
        scan_speed()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
