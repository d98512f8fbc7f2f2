"""Evaluation metrics (pure functions) and their tables."""
