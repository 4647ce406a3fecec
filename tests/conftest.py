"""Fixtures every test directory shares: the tiny checkpoints of each model family (tests/families.py)."""

from tests.families import family_checkpoints  # noqa: F401
