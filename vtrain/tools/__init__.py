"""Offline commands that work on finished checkpoints (not part of a training run)."""
