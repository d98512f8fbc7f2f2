"""Plain DeepSpeed ZeRO-3 (every parameter partitioned, torch_autocast bf16, memory_efficient_linear false, as
vtrain fills it) training a model that calls one head twice in a forward, from another module and then its own,
as DINO calls its box heads (decoder reference, then outputs). One step, forward under vtrain's
`forward_context` for the plan, or under none with `bare`. Prints `trained` when backward and the step succeed.

usage: MASTER_ADDR=127.0.0.1 MASTER_PORT=P RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 python ds_z3_reused_head.py vtrain|bare
"""

import contextlib
import sys
import types

import deepspeed
import torch
from torch import nn

from vtrain.engine.engines.deepspeed import DeepSpeedEngine
from vtrain.engine.engines.plan import Plan


class Refiner(nn.Module):
    """DINO's decoder in miniature: each layer refines the reference boxes with the model's head for that layer."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, ref: torch.Tensor, heads: nn.ModuleList):
        hidden, refs = [], [ref]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            ref = (heads[i](x).float() + torch.logit(ref.detach(), eps=1e-3)).sigmoid()
            hidden.append(self.norm(x))
            refs.append(ref)
        return hidden, refs[:-1]


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 4) for _ in range(layers + 1))
        self.refiner = Refiner(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        ref = self.heads[-1](x).float().sigmoid()
        hidden, refs = self.refiner(x, ref.detach(), self.heads)
        return sum((self.heads[i](h).float() + torch.logit(r, eps=1e-3)).sigmoid().mean()
                   for i, (h, r) in enumerate(zip(hidden, refs)))


def main() -> None:
    mode = sys.argv[1]
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    net = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "memory_efficient_linear": False},
           "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    plan = Plan("deepspeed", 1, "bf16", zero_stage=3, ds_precision_mode="torch_autocast")
    # the engine's own choice of context for this plan (no other engine state is read)
    holder = types.SimpleNamespace(plan=plan, device=torch.device("cpu"))
    context = DeepSpeedEngine.forward_context(holder) if mode == "vtrain" else contextlib.nullcontext()
    with context:
        loss = engine(torch.randn(2, 8, 16))
    engine.backward(loss)
    engine.step()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
