"""Bounded reading of the files moe-eplb is handed (a contract: imports nothing of the project).

Traces (JSON, gzip JSON, ``.npz``), real routing data, ``rebalance --weights`` and manifests come
from live clusters, colleagues and the internet. Every reader goes through the functions here, so a
hostile or broken file gives ONE :class:`InputError` (one line: the file, the field or place, what is
wrong, the limit and the fix) in bounded time and memory -- never a traceback, a hang or an
allocation the file merely declares. The checks are small functions, each usable on its own:

* :func:`read_bytes`: the file's size on disk, and gzip stream-decompressed with a cap (never
  inflated unbounded);
* :func:`check_json_text`: at C speed before any Python object is built -- the values the text
  would create (commas counted; each costs ~:data:`JSON_BYTES_PER_VALUE` once parsed) and the
  nesting depth (brackets outside strings, counted with ``bytes.translate``, ``re`` and NumPy);
* :func:`parse_json`: ``json.loads`` with duplicate keys refused (``object_pairs_hook``) and
  ``NaN`` / ``Infinity`` refused (not JSON; a missing value is ``null``);
* :func:`whole_number`, :func:`finite_number`: one scalar field, finite, integral, in range
  (int64 and the CRD's bounds are passed in by the caller);
* :func:`check_working_set`: what a command would allocate, computed from declared shapes
  before allocating.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

#: Deepest JSON nesting any file of ours needs (a trace: 4; routing data: 4; weights: 2).
MAX_JSON_DEPTH = 16
#: Most values a JSON file may create when parsed (about 1 GB at :data:`JSON_BYTES_PER_VALUE`);
#: larger data belongs in ``.npz``.
MAX_JSON_VALUES = 16_000_000
#: Most bytes of JSON text read (on disk or gunzipped): 16 M values of up to ~16 characters.
MAX_JSON_TEXT_BYTES = 256 * 2**20
#: Estimated peak memory per JSON value while a trace is read: measured (peak RSS over the bare
#: import, ``load_trace`` of 400 x 48 x 128 values) 58 B for 5-digit integers (17 MB of text) and
#: 77 B for 19-character floats (47 MB of text), text and its decoded copy included.
JSON_BYTES_PER_VALUE = 60
#: Largest integer a count may be: the largest a float64 holds exactly (2**53), so sums and casts to
#: int64 neither wrap nor round.
MAX_COUNT = 2**53
INT64_MAX = 2**63 - 1


class InputError(ValueError):
    """A file (or a value in it) that cannot be used. ``str()`` is one line: the file, the field or
    place, what is wrong and how to fix it. TraceError and ManifestError are kinds of it."""


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


# --- bytes ----------------------------------------------------------------------------------------


def read_bytes(path: str | os.PathLike, *, max_bytes: int, gz: bool | None = None,
               error: type[InputError] = InputError, what: str = "file", fix: str = "",
               max_values: int | None = None) -> bytes:
    """The bytes of ``path`` (gunzipped when ``gz``, default: name ends in ``.gz``), at most
    ``max_bytes`` on disk and after decompression (streamed in pieces of at most 16 MiB with a
    cap). With ``max_values``, decompression also stops as soon as the JSON text holds more values
    than that (:func:`json_values`, counted piece by piece)."""
    path = Path(path)
    gz = path.name.lower().endswith(".gz") if gz is None else gz
    more = f"; {fix}" if fix else ""
    try:
        if not path.is_file():
            raise error(f"{path}: cannot read it ({'no such file' if not path.exists() else 'not a regular file'})")
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes on disk, more than the {max_bytes} a {what} may have{more}")
        if gz:
            return _gunzip_capped(path, max_bytes, error, what, fix, max_values)
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
        if len(raw) > max_bytes:  # grew since stat()
            raise error(f"{path}: more than the {max_bytes} bytes a {what} may have{more}")
        return raw
    except InputError:
        raise
    except OSError as exc:
        raise error(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _gunzip_capped(path: Path, max_bytes: int, error: type[InputError], what: str, fix: str,
                   max_values: int | None) -> bytes:
    out = bytearray()
    more = f"; {fix}" if fix else ""
    values = 1
    with open(path, "rb") as fh:
        pending = fh.read(1 << 20)
        while True:  # one gzip member after the other (gzip allows concatenation)
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            data = pending
            try:
                while True:
                    piece = d.decompress(data, min(max_bytes + 1 - len(out), 1 << 24))
                    out += piece
                    if len(out) > max_bytes:
                        raise error(f"{path}: expands to more than the {max_bytes} bytes a {what} may have "
                                    f"({path.stat().st_size} bytes compressed){more}")
                    if max_values is not None:
                        values += piece.count(b",") + piece.count(b":")
                        if values > max_values:
                            raise error(_too_many_values(
                                str(path), f"{values} JSON values in its first {len(out)} bytes gunzipped", values,
                                max_values, fix))
                    if d.eof:
                        break
                    data = d.unconsumed_tail or fh.read(1 << 20)
                    if not data:
                        raise error(f"{path}: corrupt or truncated gzip file (ends inside the data)")
            except zlib.error as exc:
                raise error(f"{path}: corrupt or truncated gzip file ({exc})") from None
            pending = d.unused_data or fh.read(1 << 20)
            if not pending.strip(b"\0"):
                return bytes(out)


def _too_many_values(source: str, what: str, values: int, max_values: int, fix: str) -> str:
    return (f"{source}: {what} would take ~{_gib(values * JSON_BYTES_PER_VALUE)} to parse; at most {max_values} JSON "
            "values are read" + (f"; {fix}" if fix else ""))


# --- JSON -----------------------------------------------------------------------------------------

_KEEP = b'[]{}"'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_STRING = re.compile(rb'"[^"]*"')
_NONFINITE = re.compile(rb"(?<![\w.\"])(-?Infinity|NaN)(?![\w\"])")
_KEY = re.compile(rb'"([^"\\]{1,80})"\s*:')


def _near_key(raw: bytes, offset: int) -> str:
    """The last object key written before ``offset`` (within 4 kB), for messages."""
    keys = _KEY.findall(raw, max(0, offset - 4096), offset)
    return f" (in {keys[-1].decode(errors='replace')!r})" if keys else ""


def json_values(raw: bytes) -> int:
    """Upper bound of the values parsing ``raw`` creates (separators + 1; commas inside strings
    count too, so it only over-estimates). C speed: ``bytes.count``."""
    return raw.count(b",") + raw.count(b":") + 1


def json_depth(raw: bytes, stop_above: int | None = None) -> int:
    """Deepest ``[``/``{`` nesting of the JSON text ``raw`` outside strings, at C/NumPy speed.

    Escaped backslashes and quotes are removed first (``\\\\``, then ``\\"``), every byte but
    brackets and quotes dropped (``bytes.translate``), strings cut out (``re``); what is left is
    only brackets, whose running depth NumPy sums in pieces. Stops early above ``stop_above``."""
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw  # no copy without escapes
    s = s.translate(None, _DROP)
    s = _STRING.sub(b"", s)
    depth, deepest = 0, 0
    piece = 1 << 24
    for i in range(0, len(s), piece):
        a = np.frombuffer(s, np.uint8, count=min(piece, len(s) - i), offset=i)
        step = (a == 91).astype(np.int32) + (a == 123) - (a == 93) - (a == 125)
        run = np.cumsum(step, dtype=np.int64) + depth
        deepest = max(deepest, int(run.max()))
        depth = int(run[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def check_json_text(raw: bytes, source: str, *, error: type[InputError] = InputError,
                    max_values: int = MAX_JSON_VALUES, max_depth: int = MAX_JSON_DEPTH,
                    need_depth: int = 4, fix: str = "") -> None:
    """Refuse, before parsing, JSON text that would build more than ``max_values`` values or nest
    deeper than ``max_depth``."""
    values = json_values(raw)
    if values > max_values:
        raise error(_too_many_values(source, f"up to {values} JSON values", values, max_values, fix))
    depth = json_depth(raw, stop_above=max_depth)
    if depth > max_depth:
        raise error(f"{source}: JSON nested deeper than {max_depth} levels; this file needs {need_depth}")


class _NonFinite(Exception):
    pass


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


class _Duplicate(Exception):
    pass


def _position(raw: bytes, offset: int) -> str:
    line = raw.count(b"\n", 0, offset) + 1
    col = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
    return f"line {line}, column {col}"


def parse_json(raw: bytes, source: str, *, error: type[InputError] = InputError, **limits: Any) -> Any:
    """The value of the JSON text ``raw``, strictly: UTF-8, within :func:`check_json_text`'s
    limits (``limits`` are passed on), no duplicate keys, no ``NaN`` / ``Infinity``."""
    check_json_text(raw, source, error=error, **limits)
    try:
        text = raw.decode("utf-8-sig") if raw[:3] == b"\xef\xbb\xbf" else raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not UTF-8 text at byte {exc.start}; JSON is UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise error(f"{source}: not usable JSON ({str(exc)[:120]})") from None
    except _Duplicate as exc:
        raise error(f"{source}: duplicate key {str(exc.args[0])[:80]!r} in one JSON object (readers would silently "
                    "keep the last); keep one") from None
    except _NonFinite as exc:
        m = _NONFINITE.search(raw)
        where = f"{_position(raw, m.start())}{_near_key(raw, m.start())}" if m else "?"
        raise error(f"{source}: {exc.args[0]} at {where} is not a JSON number; numbers must be finite "
                    "(write null where a value is missing)") from None
    except RecursionError:  # belt and braces: json_depth refuses deep nesting first
        raise error(f"{source}: JSON nested too deeply") from None


# --- scalars and sizes ----------------------------------------------------------------------------


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else \
        value.item() if isinstance(value, np.generic) else value


def whole_number(value: Any, field: str, lo: int, hi: int = INT64_MAX, *,
                 error: type[InputError] = InputError, unit: str = "") -> int:
    """``value`` as an int: a finite whole number (JSON int or float, NumPy scalar) in
    ``[lo, hi]``; else ``error`` naming ``field``, the range and what it got."""
    v = _item(value)
    unit = f" {unit}" if unit else ""
    rng = ("an integer > 0" if lo == 1 else f"an integer >= {lo}") + ("" if hi == INT64_MAX else f" and <= {hi}")
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise error(f"{field}: expected {rng}{unit}, got {_short(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise error(f"{field}: expected {rng}{unit}, got {v!r} (numbers must be finite)")
    if v != int(v):
        raise error(f"{field}: expected {rng}{unit}, got {v!r} (not a whole number)")
    if not lo <= v <= hi:
        raise error(f"{field}: expected {rng}{unit}, got {_short(v)}")
    return int(v)


def finite_number(value: Any, field: str, lo: float = -math.inf, hi: float = math.inf, *,
                  error: type[InputError] = InputError, strict_lo: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``strict_lo``)."""
    v = _item(value)
    want = ("a number" + (f" > {lo:g}" if strict_lo else f" >= {lo:g}" if lo > -math.inf else "")
            + (f" and <= {hi:g}" if hi < math.inf else ""))
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise error(f"{field}: expected {want}, got {_short(v)}")
    if v < lo or (strict_lo and v == lo) or v > hi:
        raise error(f"{field}: expected {want}, got {v!r}")
    return float(v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_working_set(nbytes: float, limit: int, source: str, what: str, *,
                      error: type[InputError] = InputError, fix: str = "") -> None:
    """Refuse, before allocating, when ``what`` would take ``nbytes`` (from declared shapes) and
    that is more than ``limit``."""
    if nbytes > limit:
        raise error(f"{source}: {what} would take {_gib(nbytes)} in memory; at most {_gib(limit)} ({limit} bytes)"
                    + (f"; {fix}" if fix else ""))
