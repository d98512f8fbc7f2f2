"""One class per parallel engine behind one interface (base.Engine): the torch engine (torch_engine.py) shared by
one process and DDP (ddp.py) and FSDP2 (fsdp.py), and DeepSpeed ZeRO (deepspeed.py). build.py chooses the class once
from the launch plan; plan.py resolves that plan, accelerator.py builds the Accelerator for it, ds_config.py fills
the DeepSpeed JSON, ds_writes.py routes DeepSpeed's checkpoint writes through the guarded writer, fsdp_units.py
applies `fully_shard` per block."""
