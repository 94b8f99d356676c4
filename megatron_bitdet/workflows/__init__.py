"""Workflows that launch runs and combine analyses: fixcheck, doctor."""
