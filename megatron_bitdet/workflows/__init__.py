"""Workflows that launch runs and analyse them (replay)."""
