"""One class per parallel engine behind one interface (base.py): DDP and one process (ddp.py), FSDP2 (fsdp.py),
DeepSpeed ZeRO (deepspeed.py). build.py chooses the class once from the launch plan; plan.py resolves
that plan, accelerator.py builds the Accelerator for it, ds_config.py fills the DeepSpeed JSON, ds_writes.py routes
DeepSpeed's checkpoint writes through the guarded writer, fsdp_units.py applies `fully_shard` per block."""
