"""Model code: backbones (timm), metric-learning neck and margin heads. Knows nothing of ZeRO or FSDP."""
