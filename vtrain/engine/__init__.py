"""Engine: launch plan and accelerator, precision, parallelism (FSDP2 / DDP / DeepSpeed), optimiser,
checkpoints, logging and the training loop."""
