"""One class per parallel engine behind one interface (base.py): DDP and one process (ddp.py), FSDP2 (fsdp.py),
DeepSpeed ZeRO (deepspeed.py). engine/parallel.py chooses the class once from the launch plan."""
