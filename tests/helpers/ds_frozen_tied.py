"""Plain DeepSpeed (no vtrain) training of a model with BatchNorm, a frozen layer and tied weights, then
`save_checkpoint`. Writes the live model gathered on rank 0 as truth.safetensors next to the checkpoint.

usage: accelerate launch ... ds_frozen_tied.py STAGE OUT_DIR
"""

import os
import sys

import deepspeed
import torch
from safetensors.torch import save_file
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.bn = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.frozen(self.bn(self.emb(idx))))


def main() -> None:
    stage, out = int(sys.argv[1]), sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.bn.running_var.copy_(torch.tensor([1.2345678, 1e5, 7e4, 65504.0, 2.0**20, 3.0, 0.5, 9.0]))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
           "torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "steps_per_print": 10**9}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3):
        idx = torch.randint(0, 16, (4,), generator=g)
        loss = nn.functional.cross_entropy(engine(idx).float(), idx)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        truth = {k: v.detach().float().clone() if v.is_floating_point() else v.clone()
                 for k, v in module.state_dict().items()}
    if engine.global_rank == 0:
        save_file(truth, f"{out}/truth.safetensors")
    # Leave the process group, then skip interpreter teardown: after a complete run rank 1 still aborted at exit
    # now and then ("terminate called without an active exception", SIGABRT) with the group already destroyed, a
    # native thread of the plain DeepSpeed engine left running. Everything this script is for is on disk by now.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
