"""The one pair of functions between the CRD's camelCase objects and the typed values inside.

:func:`from_crd` reads a mapping (part of the custom resource: spec or status) into a dataclass;
:func:`to_crd` writes a dataclass back as the mapping the CRD stores. Nothing else in the project
spells a camelCase key of the resource (besides the CRD schema itself).

Field names are snake_case and map to camelCase keys (``window_size`` -> ``windowSize``); a field's
``metadata`` can say otherwise:

* ``key``: the CRD key or a dotted path (``"async"``, ``"storage.pvc"``, ``"from"``);
* ``raw``: keep the value as it is (Kubernetes objects such as ``env`` or ``resources``, free-form
  status maps) -- copied, never converted;
* ``read`` / ``write``: a function ``(value, path) -> typed`` / ``typed -> value`` for values that
  are not dataclasses (quantities, timestamps, bounds);
* ``omit_none``: (default True) leave the key out when the value is None; ``omit_empty``: also when
  it is empty;
* ``skip``: not part of the CRD object (bookkeeping of the typed value).

Supported field types: ``int``, ``float``, ``str``, ``bool``, ``X | None``, ``tuple[X, ...]``,
``list[X]``, ``dict[str, X]``, nested dataclasses (``Knobs`` included) and ``Any`` (raw).
Type errors raise :class:`ConvertError` naming the path (``spec.parallelism.tensor: ...``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

_MISSING = object()


class ConvertError(ValueError):
    """A value that does not have the type its field needs; the message starts with its path."""


def camel(name: str) -> str:
    """``num_redundant_experts`` -> ``numRedundantExperts``."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any, str], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name], f.metadata.get("key") or camel(f.name))
                 for f in dataclasses.fields(cls) if f.init and not f.metadata.get("skip"))


def _dig(data: Mapping[str, Any], key: str) -> Any:
    cur: Any = data
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _read(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return copy.deepcopy(value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _read(args[0], value, path) if len(args) == 1 else copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConvertError(f"{path}: expected an object, got {type(value).__name__}")
        return from_crd(tp, value, path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConvertError(f"{path}: expected a list, got {type(value).__name__}")
        item = typing.get_args(tp)[0]
        out = [_read(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConvertError(f"{path}: expected an object, got {type(value).__name__}")
        item = typing.get_args(tp)[1]
        return {str(k): _read(item, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConvertError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConvertError(f"{path}: expected a whole number, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConvertError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConvertError(f"{path}: expected a string, got {value!r}")
        return value
    return copy.deepcopy(value)


def _read_field(f: dataclasses.Field, tp: Any, value: Any, path: str) -> Any:
    reader = f.metadata.get("read")
    if reader is not None:
        return reader(value, path)
    if f.metadata.get("raw"):
        return copy.deepcopy(value)
    return _read(tp, value, path)


def read_field(cls: type, name: str, value: Any, path: str) -> Any:
    """Field ``name`` of dataclass ``cls`` read from its CRD value (for records read one by one)."""
    for f, tp, _key in _fields(cls):
        if f.name == name:
            return _read_field(f, tp, value, path)
    raise KeyError(name)


def from_crd(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """The dataclass ``cls`` read from the CRD mapping ``data`` (missing keys take the field's
    default; a missing key without a default is an error). ``path`` prefixes error messages."""
    kwargs: dict[str, Any] = {}
    for f, tp, key in _fields(cls):
        where = f"{path}.{key}" if path else key
        value = _dig(data, key)
        if value is _MISSING or value is None:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
                kwargs[f.name] = None
                continue
            raise ConvertError(f"{where}: required")
        kwargs[f.name] = _read_field(f, tp, value, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConvertError):
            raise
        raise ConvertError(f"{path or cls.__name__}: {exc}") from None


def _write(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_crd(value)
    if isinstance(value, (list, tuple)):
        return [_write(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _write(v) for k, v in value.items()}
    return value


def to_crd(obj: Any) -> dict[str, Any]:
    """The CRD mapping of dataclass ``obj`` (the inverse of :func:`from_crd`). Keys of ``None``
    values are left out unless the field's metadata says ``omit_none=False``."""
    out: dict[str, Any] = {}
    for f, _tp, key in _fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none", True):
            continue
        if f.metadata.get("omit_empty") and not value:
            continue
        writer = f.metadata.get("write")
        if value is not None and writer is not None:
            value = writer(value)
        elif f.metadata.get("raw"):
            value = copy.deepcopy(value)
        else:
            value = _write(value)
        parts = key.split(".")
        cur = out
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
    return out
