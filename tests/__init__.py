"""moe-eplb's test suite, a package: helpers are imported as ``tests.<area>.<module>`` and helper
scripts run as ``python -m tests.<area>.<module>`` from :data:`ROOT`."""

from pathlib import Path

#: the repository root (what ``python -m tests....`` runs from)
ROOT = Path(__file__).resolve().parent.parent
