"""State-dict adapters that fill vtrain's metric model (models/metric.py) from published face checkpoints, one
module per source (`vtrain convert --from ...`, tools/convert.py; docs/convert.md)."""
