"""``Problem``: one thing wrong with a resource, naming the field and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as _field


@dataclass(frozen=True)
class Problem:
    """One validation finding.

    ``field`` is a dotted path from the resource root (``spec.eplb.numRedundantExperts``,
    ``spec.engine.extraArgs[2]``); ``message`` says what is wrong and how to fix it.
    """

    field: str
    message: str
    rule: str | None = _field(default=None, compare=False, repr=False)  # the CRD's CEL rule, if from one

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
