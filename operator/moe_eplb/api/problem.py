"""``Problem``: one thing wrong with a resource, naming the field and the fix."""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import field as _field

MAX_MESSAGE = 400  # characters of one message (a value quoted in it is cut well before)
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
