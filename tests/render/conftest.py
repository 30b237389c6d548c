"""Fixtures shared with the other manifest tests (see tests/example_manifests.py)."""

from tests.example_manifests import seed, variant  # noqa: F401  (pytest fixtures)
