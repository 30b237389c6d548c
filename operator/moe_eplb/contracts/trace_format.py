"""The load-trace file format (a contract: imports nothing of the project).

Written by the exporter's trace capture (inside vLLM pods), ``moe-eplb trace synth`` and the load
reader; read by ``moe-eplb tune|simulate|calibrate|trace info`` and the tests. JSON, gzip JSON
(``.json.gz``) or NumPy ``.npz`` (one array per key; the keys marked JSON below are stored as JSON
text in a 0-d string array), chosen by the file name's suffix. T = buckets, L = MoE layers,
E = logical experts, ep = EP size.

=========================== ============================== =========================================
key                         type                           meaning
=========================== ============================== =========================================
``num_layers``              int > 0                        MoE layers L
``num_experts``             int > 0                        logical experts per layer E
``bucket_steps``            T ints >= 0                    engine steps in each bucket
``load``                    T x L x E numbers >= 0         tokens routed to each logical expert
                                                           (one count per (token, top-k slot))
``bucket_seconds``          number > 0, optional           wall-clock length of one bucket
``top_k``                   int > 0, optional              experts per token
``model``                   str, optional                  served model name the load came from
``step_seconds``            T numbers > 0, optional        mean wall time of one engine step (null /
                                                           NaN only where ``bucket_steps`` is 0)
``rank_load``               T x L x ep numbers >= 0, opt.  tokens each EP rank served per MoE layer
                                                           (physical, under the running placement)
``kv_cache_usage``          T numbers in [0, 1], optional  mean KV-cache usage (``vllm:kv_cache_usage_perc``)
``preemptions``             T numbers >= 0, optional       preemptions in the bucket
``requests_waiting``        T numbers >= 0, optional       mean waiting requests
``rearrangements``          JSON list, optional            ``[{"bucket": int, "seconds": number}]``, each
                                                           observed rearrangement and its duration
``config``                  JSON object, optional          ``{"window_size", "step_interval",
                                                           "num_redundant_experts", "ep_size",
                                                           "use_async"}`` running while recorded
``kv_cache_bytes_per_gpu``  number > 0, optional           KV-cache size of one GPU
``prefix_cache_queries``    T numbers >= 0, optional       prompt tokens looked up in the prefix cache
                                                           in the bucket (``vllm:prefix_cache_queries``)
``prefix_cache_hit_rate``   T numbers in [0, 1] or null,   hits / queries of the prefix cache in the
                            optional                       bucket (null where nothing was queried)
``kv_cache_blocks``         int > 0, optional              KV-cache blocks of one engine's workers
                                                           (``vllm:cache_config_info`` num_gpu_blocks)
``kv_block_size``           int > 0, optional              tokens per KV-cache block (block_size)
=========================== ============================== =========================================

This module reads and writes the raw key -> value mapping and bounds what a hostile file can make
it allocate (through :mod:`moe_eplb.contracts.bounded_read`); :mod:`moe_eplb.eplb.workload.tracefile` validates the
values strictly into a ``LoadTrace``.
"""

from __future__ import annotations

import gzip
import json
import os
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import moe_eplb.contracts.bounded_read as bounded_read

REQUIRED_KEYS = ("num_layers", "num_experts", "bucket_steps", "load")
OPTIONAL_KEYS = ("bucket_seconds", "top_k", "model")
TELEMETRY_KEYS = ("step_seconds", "rank_load", "kv_cache_usage", "preemptions", "requests_waiting",
                  "rearrangements", "config", "kv_cache_bytes_per_gpu", "prefix_cache_queries",
                  "prefix_cache_hit_rate", "kv_cache_blocks", "kv_block_size")
ALL_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS + TELEMETRY_KEYS
JSON_VALUED_KEYS = ("rearrangements", "config")  # stored as JSON text inside .npz
CONFIG_KEYS = ("window_size", "step_interval", "num_redundant_experts", "ep_size", "use_async")
#: The CRD's bounds (spec.eplb) of the recorded knobs in ``config`` (tests/eplb check them against
#: crds/), and of ``ep_size`` (EP ranks).
CONFIG_RANGES = {"window_size": (1, 100_000), "step_interval": (1, 2_147_483_647),
                 "num_redundant_experts": (0, 1023), "ep_size": (1, 65_536)}
SUFFIXES = (".json", ".json.gz", ".npz")

#: Most bytes a trace may take: on disk, decompressed JSON text, and the arrays an ``.npz``
#: declares as the float64 the commands hold them in (``simulate`` and ``tune`` need about 3x
#: that at peak). A 24 h DeepSeek-V3 trace of 15 s buckets (5760 x 58 x 256) is 0.68 GB.
#: ``--max-trace-bytes`` raises it.
MAX_TRACE_BYTES = 1024**3
#: Deepest JSON nesting accepted (the format needs 4: load[t][l][e] inside the object).
MAX_JSON_DEPTH = bounded_read.MAX_JSON_DEPTH
#: The fix a too-large JSON trace gets.
NPZ_FIX = "write large traces as .npz (same keys, one array each; `moe-eplb trace synth -o x.npz` writes one)"


class TraceError(bounded_read.InputError):
    """A trace that cannot be used; the message names the file or key at fault and the fix."""


def suffix_of(path: str | os.PathLike) -> str:
    """The format ``path`` names (one of :data:`SUFFIXES`); anything else raises TraceError."""
    name = Path(path).name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise TraceError(f"{path}: unknown trace file type; use one of {', '.join(SUFFIXES)}")


def _npz_members(zf: zipfile.ZipFile, path: Path) -> list[zipfile.ZipInfo]:
    """The members of an ``.npz``, each key once (a duplicate member: which one wins is undefined)."""
    seen: set[str] = set()
    for info in zf.infolist():
        if info.filename in seen:
            raise TraceError(f"{path}: member {info.filename!r} appears twice in the .npz (a reader would silently "
                             "take one); write each key once")
        seen.add(info.filename)
    return zf.infolist()


def _npz_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, key: str) -> tuple[tuple[int, ...], np.dtype]:
    with zf.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(fh)  # the header only: what the array would take
    if dtype.hasobject:
        raise TraceError(f"{path}: array {key!r} holds Python objects; a trace holds numbers and text")
    return tuple(shape), dtype


def _read_npz(path: Path, max_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with zipfile.ZipFile(path) as zf:
        members = _npz_members(zf, path)
        total = 0.0
        for info in members:  # every declared shape first: refuse before allocating anything
            key = info.filename.removesuffix(".npy")
            shape, dtype = _npz_header(zf, info, path, key)
            # numbers become float64 (8 bytes each) in the trace, whatever their dtype in the file
            nbytes = float(np.prod(shape, dtype=np.float64)) * (dtype.itemsize if dtype.kind in "US" else 8)
            total += nbytes
            bounded_read.check_working_set(
                total, max_bytes, str(path), f"array {key!r} {shape} (with the arrays before it)", error=TraceError,
                fix="cut the trace into shorter ones, or raise the limit with --max-trace-bytes")
        for info in members:
            key = info.filename.removesuffix(".npy")
            with zf.open(info) as fh:
                arr = np.lib.format.read_array(fh, allow_pickle=False)
            if key in JSON_VALUED_KEYS and arr.ndim == 0 and arr.dtype.kind == "U":
                out[key] = bounded_read.parse_json(str(arr).encode("utf-8"), f"{path}: {key}", error=TraceError)
            else:
                out[key] = arr
    return out


def read_trace_file(path: str | os.PathLike, *, max_bytes: int = MAX_TRACE_BYTES) -> dict[str, Any]:
    """The raw key -> value mapping of a trace file (arrays for ``.npz``, JSON values otherwise).

    Every problem -- missing, unreadable, truncated or corrupt file, wrong encoding, more than
    ``max_bytes`` on disk, decompressed or as declared arrays, more JSON values than
    :data:`moe_eplb.contracts.bounded_read.MAX_JSON_VALUES`, nesting deeper than :data:`MAX_JSON_DEPTH`,
    duplicate keys or ``.npz`` members, ``NaN``/``Infinity`` in JSON -- is a :class:`TraceError`
    naming the file; nothing larger than ``max_bytes`` is allocated."""
    path = Path(path)
    suffix = suffix_of(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    try:
        if suffix == ".npz":
            if path.stat().st_size > max_bytes:
                raise TraceError(f"{path}: {path.stat().st_size} bytes on disk, more than the {max_bytes} a trace may "
                                 "have; raise the limit with --max-trace-bytes")
            return _read_npz(path, max_bytes)
        raw = bounded_read.read_bytes(path, max_bytes=min(max_bytes, bounded_read.MAX_JSON_TEXT_BYTES),
                                      gz=suffix == ".json.gz", error=TraceError, what="JSON trace", fix=NPZ_FIX,
                                      max_values=bounded_read.MAX_JSON_VALUES)
        data = bounded_read.parse_json(raw, str(path), error=TraceError, fix=NPZ_FIX)
    except TraceError:
        raise
    except (zipfile.BadZipFile, zlib.error, gzip.BadGzipFile, EOFError) as exc:
        raise TraceError(f"{path}: corrupt or truncated {suffix} file ({exc or type(exc).__name__})") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: cannot read as {suffix} ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected a JSON object with keys {', '.join(REQUIRED_KEYS)}, "
                         f"got {type(data).__name__}")
    return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f" and np.isnan(value).any():  # JSON has no NaN: null (no measurement)
            return np.where(np.isnan(value), None, value.astype(object)).tolist()
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def write_trace_file(data: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write the key -> value mapping ``data`` in the format ``path``'s suffix names; returns the path.

    Written to a temporary name and renamed: a failed write leaves nothing behind, a reader never
    sees half a file. Whole-number ``load`` is stored as integers."""
    path = Path(path)
    suffix = suffix_of(path)
    unknown = sorted(set(data) - set(ALL_KEYS))
    if unknown:
        raise TraceError(f"{unknown[0]}: unknown trace key (known: {', '.join(ALL_KEYS)})")
    tmp = path.with_name(path.name + ".tmp")
    try:
        if suffix == ".npz":
            # np.savez_compressed's layout (one .npy per key in a zip), with fast deflate level 1
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
                for key, value in data.items():
                    if key in JSON_VALUED_KEYS:
                        arr = np.str_(json.dumps(_jsonable(value), separators=(",", ":")))
                    elif isinstance(value, str):
                        arr = np.str_(value)
                    else:
                        arr = np.asanyarray(value)
                        if key == "load" and arr.size and np.all(arr == np.round(arr)) and arr.max() < 2**32 \
                                and arr.min() >= 0:
                            arr = arr.astype(np.uint32)  # whole counts: smaller and faster to compress
                    with zf.open(f"{key}.npy", "w", force_zip64=True) as fh:
                        np.lib.format.write_array(fh, np.asanyarray(arr), allow_pickle=False)
        else:
            plain = {}
            for key, value in data.items():
                value = _jsonable(value)
                if key == "load":
                    arr = np.asarray(value, dtype=np.float64)
                    if arr.size and np.all(arr == np.round(arr)) and np.abs(arr).max() < 2**53:
                        value = arr.astype(np.int64).tolist()
                plain[key] = value
            text = json.dumps(plain, separators=(",", ":"))
            if suffix == ".json.gz":
                with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as fh:
                    fh.write(text)
            else:
                tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
