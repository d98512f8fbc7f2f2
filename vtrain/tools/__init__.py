"""Offline commands that work on a finished run (export)."""
