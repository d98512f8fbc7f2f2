"""vtrain: train large vision models on small GPUs."""

__version__ = "0.1.0"
