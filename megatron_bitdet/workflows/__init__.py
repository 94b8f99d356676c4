"""Workflows that launch runs and read them back: prove, verify-resume, the localize ladder, the tax, replay."""
