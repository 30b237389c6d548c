"""``Problem``: one thing wrong with a resource, naming the field and the fix."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

MAX_MESSAGE = 640  # characters of one message (a value quoted in it is cut well before; the layout advice is the longest)
_LEADING_PATH = re.compile(r"^((?:metadata|spec|status)(?:\.[A-Za-z0-9_]+|\[[^\]]*\])*)(?::\s*|\s+(?=is |must |has ))")


@dataclass(frozen=True)
class Problem:
    """One validation finding.

    ``field`` is a dotted path from the resource root (``spec.eplb.numRedundantExperts``,
    ``spec.engine.extraArgs[2]``); ``message`` says what is wrong and how to fix it.
    """

    field: str
    message: str
    rule: str | None = _field(default=None, compare=False, repr=False)  # the CRD's CEL rule, if from one
    #: the fix the message suggests, as edits of the resource (:func:`apply_fix`): ``(path, value)``
    #: pairs, the path a tuple of keys (and list indexes) from the root, the value :data:`REMOVE` to
    #: delete the key or a :class:`Rename` to move its value to another key
    fix: tuple[tuple[tuple[Any, ...], Any], ...] | None = _field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        field, message = self.field, " ".join(str(self.message).split())
        m = _LEADING_PATH.match(message)
        if m and (m.group(1) == field or field == "<root>"):
            # "spec.x: spec.x: ..." -> once; "<root>: metadata.name is too long" -> at metadata.name
            field, message = m.group(1), message[len(m.group(1)):].lstrip(": ")
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 1].rstrip() + "…"
        object.__setattr__(self, "field", field)
        object.__setattr__(self, "message", message)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


#: a fix's value that deletes the key
REMOVE: Any = _Remove()


@dataclass(frozen=True)
class Rename:
    """A fix's value that moves the key's value to ``to`` (a typo: ``operater`` -> ``operator``)."""

    to: str


def apply_fix(resource: Mapping[str, Any], fix: tuple[tuple[tuple[Any, ...], Any], ...]) -> dict[str, Any]:
    """A deep copy of ``resource`` with the edits of a :attr:`Problem.fix` made (maps are created
    along a path that is not there yet)."""
    import copy

    out = copy.deepcopy(dict(resource))
    for path, value in fix:
        node: Any = out
        for key in path[:-1]:
            if isinstance(node, list):
                node = node[key]
            else:
                node = node.setdefault(key, {})
        last = path[-1]
        if value is REMOVE:
            if isinstance(node, dict):
                node.pop(last, None)
        elif isinstance(value, Rename):
            if isinstance(node, dict) and last in node:
                node[value.to] = node.pop(last)
        else:
            node[last] = copy.deepcopy(value)
    return out
