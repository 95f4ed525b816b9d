"""Helpers for testing DLRover and training scripts under failures (fault injection)."""
