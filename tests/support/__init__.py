"""Test helpers, imported as ``tests.support.<area>`` (one way only)."""
