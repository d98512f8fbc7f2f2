"""Offline commands that work on finished checkpoints (export, predict), not part of a training run."""
