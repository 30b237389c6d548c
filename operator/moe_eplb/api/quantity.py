"""Kubernetes quantities (``8Gi``, ``500M``, ``1024``) as bytes: the one parser the project uses.

Parsing is Kubernetes' own (``kubernetes.utils.quantity.parse_quantity``, the maintained client's
implementation of the apiserver's grammar); a trailing ``B`` (``8GiB``, a common spelling on the
command line) is accepted by :func:`parse_bytes`.
"""

from __future__ import annotations

from typing import Any


class QuantityError(ValueError):
    """Not a quantity of bytes; the message names the field and shows valid spellings."""


def _parse_quantity(value: Any):
    # imported on use: the kubernetes client takes ~0.3 s to import and most callers never need it
    from kubernetes.utils.quantity import parse_quantity

    return parse_quantity(value)


def quantity_bytes(value: Any) -> int | None:
    """A Kubernetes quantity as whole bytes; None when absent or malformed (validation names it)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        q = _parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        return None
    return int(q) if q >= 0 else None


def quantity_number(value: str) -> float:
    """A Kubernetes quantity as a number, as the metrics APIs write values (``"1500m"`` -> 1.5, ``"12"``);
    the parser's error (``ValueError``) for a malformed one."""
    return float(_parse_quantity(value))


def parse_bytes(value: Any, where: str = "memory budget") -> int:
    """Bytes from plain digits (``8589934592``), a Kubernetes quantity (``8Gi``, ``500M``) or either
    with a trailing ``B`` (``8GiB``, ``8GB``); :class:`QuantityError` naming ``where`` otherwise."""
    text = str(value).strip()
    if text.endswith("B") and len(text) > 1 and not text[:-1].rstrip().endswith("B"):
        text = text[:-1].rstrip()
    q = quantity_bytes(text)
    if q is None:
        raise QuantityError(f"{where}: {value!r} is not a byte count; use plain bytes or a quantity such as "
                            "8Gi, 512Mi, 10G")
    return q


#: Kubernetes' quantity grammar (Quantity's own description) as the regular expression the CRD puts
#: on generated quantity fields (scripts/gen_podspec_schema.py)
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
