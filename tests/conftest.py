"""Shared fixtures: a tiny job config that trains in a second on bundled data."""

from __future__ import annotations

import os

import pytest

from helpers.tiny import tiny_overrides

# Keep the measured-peak cache out of the user's home during tests.
os.environ.setdefault("SCALETRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))


@pytest.fixture
def tiny():
    return tiny_overrides
