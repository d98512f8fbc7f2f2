"""Every storage one traced training step creates and frees, which module made it, and the FLOPs of each op.

`LiveBytes` is a TorchDispatchMode below which a fake-tensor step runs (memory/trace.py). It records each new
storage once, with its size rounded up to the target allocator's block (512 bytes for the CUDA caching
allocator; the CPU allocator reports the size asked for, `granularity=1`), and its release (a weak
finaliser): O(1) per op, where torch's MemTracker rescans every live storage on every op (minutes for Swin-L DINO).

Attribution. Global module hooks keep a stack of the modules whose forward is running. A storage made in the
forward belongs to the innermost one (its qualified name). One made during backward is marked so: `recompute`
when a forward runs again inside backward (a checkpointed unit, or a tensor models/lean.py remakes), else
`backward`, attributed to the module whose forward created the autograd node being executed. That node's owner is
found from its sequence number: autograd numbers nodes in creation order, and the hooks log at which sequence
number each module's forward was entered and left (`torch._C._autograd._get_sequence_nr`).

FLOPs are counted with the formulas of `torch.utils.flop_counter.FlopCounterMode` (its registry: matrix products,
convolutions, attention kernels; elementwise work counts zero), per module and phase, so the planner knows what
a forward costs and what a recomputation adds.
"""

from __future__ import annotations

import bisect
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

from vtrain.models.lean import in_checkpoint, is_remaking

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"
ROOT = ""  # the model itself (ops of its own forward outside any submodule)
_FLOPS = FlopCounterMode(display=False).flop_registry


def rounded(nbytes: int, granularity: int) -> int:
    """Bytes an allocator holds for a storage of `nbytes`: rounded up to its block size."""
    return -(-nbytes // granularity) * granularity


@dataclass
class Row:
    """Activation bytes at the peak made by one module in one phase."""

    module: str
    phase: str
    bytes: int
    unit: int  # the recompute unit the module belongs to (index into the trace's units), -1 for none


@dataclass
class Recording:
    """What a traced step left behind (plain data; the tracker's hooks are gone)."""

    events: list[tuple[int, int]]  # (storage key, +bytes) at creation, (key, -bytes) at release
    label_of: list[int]  # storage key -> label index
    labels: list[tuple[int, str]]  # (module index, phase)
    modules: list[str]  # module index -> qualified name
    unit_of: list[int]  # module index -> recompute unit index, -1 outside every unit
    # (first event index, direction 0 forward / 1 backward, unit index or -1): where a unit's forward or backward
    # begins (ops outside every unit continue the context before them)
    marks: list[tuple[int, int, int]]
    flops: dict[tuple[int, str], int] = field(default_factory=dict)  # (module index, phase) -> FLOPs
    forward_end: int = -1  # event index where the model's forward returned (inside autocast)
    inputs: dict[int, list[int]] = field(default_factory=dict)  # storage key -> units whose forward took it in

    def live_curve(self, exclude: set[int]) -> tuple[int, int]:
        """(peak bytes, event index of its first occurrence) over the storages not in `exclude`."""
        live = peak = 0
        at = -1
        for i, (key, n) in enumerate(self.events):
            if key >= 0 and key not in exclude:
                live += n
                if live > peak:
                    peak, at = live, i
        return peak, at

    def breakdown(self, exclude: set[int]) -> list[Row]:
        """The storages live at the peak, grouped by (module, phase), largest first; they sum to the peak."""
        peak, at = self.live_curve(exclude)
        live: dict[int, int] = {}
        for key, n in self.events[: at + 1]:
            if key >= 0 and key not in exclude:
                if n > 0:
                    live[key] = n
                else:
                    live.pop(key, None)
        sums: dict[int, int] = defaultdict(int)
        for key, n in live.items():
            sums[self.label_of[key]] += n
        rows = [Row(self.modules[m], phase, n, self.unit_of[m]) for (m, phase), n in
                ((self.labels[i], n) for i, n in sums.items())]
        rows.sort(key=lambda r: (-r.bytes, r.module, r.phase))
        return rows

    def flops_by(self, phase: str) -> int:
        return sum(f for (_, p), f in self.flops.items() if p == phase)


class LiveBytes(TorchDispatchMode):
    """Records the step (see the module docstring). `existing`: storages that are not the step's (parameters,
    buffers, inputs), never counted, and their views neither. `model`: names modules and installs the hooks;
    `units`: recompute unit name -> its blocks (models/recompute_units.recompute_units), for the unit attribution."""

    def __init__(self, existing: list[torch.Tensor], model: nn.Module | None = None,
                 units: dict[str, tuple[nn.Module, ...]] | None = None, extra: dict[str, nn.Module] | None = None,
                 granularity: int = 512) -> None:
        super().__init__()
        self.granularity = granularity
        self.events: list[tuple[int, int]] = []
        self.keys = WeakIdKeyDictionary()
        self.next_key = 0
        for t in existing:  # views of what already exists (`weight.t()` in every fp32 linear) are not new memory
            self.keys[t.untyped_storage()] = -1
        self.modules: list[str] = [ROOT]
        self.unit_of: list[int] = [-1]
        self.index: dict[int, int] = {}
        unit_index = {id(m): u for u, blocks in enumerate((units or {}).values()) for b in blocks
                      for m in b.modules()}
        self.first_block = {id(blocks[0]): u for u, blocks in enumerate((units or {}).values()) if blocks}
        self.inputs: dict[int, list[int]] = {}
        if model is not None:
            self.index[id(model)] = 0
        named = ([("", model)] if model is not None else []) + list((extra or {}).items())
        for prefix, root in named:
            for name, m in root.named_modules(prefix=prefix):
                if id(m) not in self.index:
                    self.index[id(m)] = len(self.modules)
                    self.modules.append(name)
                    self.unit_of.append(unit_index.get(id(m), -1))
        self.labels: list[tuple[int, str]] = []
        self.label_ids: dict[tuple[int, str], int] = {}
        self.label_of: list[int] = []
        self.marks: list[tuple[int, int, int]] = []
        self.flops: dict[tuple[int, str], int] = defaultdict(int)
        self.stack: list[int] = []
        self.seq_at: list[int] = []  # sequence numbers where the running module changed ...
        self.seq_mod: list[int] = []  # ... and the module from there on
        self.backward = False
        self.forward_end = -1
        self.handles: list = []

    # ---- module stack ------------------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args) -> None:
        self.stack.append(self.index.get(id(module), self.stack[-1] if self.stack else 0))
        self._log_seq()
        unit = self.first_block.get(id(module))
        if unit is not None and not self.backward:  # what a unit takes in (a checkpoint keeps exactly that)
            for t in tree_leaves(args):
                key = self.keys.get(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
                if key is not None and key >= 0 and unit not in self.inputs.setdefault(key, []):
                    self.inputs[key].append(unit)

    def _post(self, module: nn.Module, args, out) -> None:
        if self.stack:
            self.stack.pop()
        self._log_seq()

    def _log_seq(self) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        top = self.stack[-1] if self.stack else 0
        if self.seq_at and self.seq_at[-1] == seq:
            self.seq_mod[-1] = top
        else:
            self.seq_at.append(seq)
            self.seq_mod.append(top)

    def __enter__(self):
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                        nn.modules.module.register_module_forward_hook(self._post, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return super().__exit__(*exc)

    # ---- attribution -------------------------------------------------------------------------------------------
    def _owner(self) -> tuple[int, str]:
        """(module index, phase) of the op running now."""
        if not self.backward:
            return (self.stack[-1] if self.stack else 0), FORWARD
        # a forward inside backward: checkpoint recomputation runs with grad mode on, lean.py's remakes inside a
        # module's forward; the backward ops themselves run with grad mode off and no forward on the stack
        # ... and chunked_mlp's hidden layer, remade inside its Function's backward (lean.remaking)
        again = bool(self.stack) or torch.is_grad_enabled() or is_remaking() or in_checkpoint()
        if self.stack:
            return self.stack[-1], RECOMPUTE
        node = torch._C._current_autograd_node()
        module = 0
        if node is not None:
            i = bisect.bisect_right(self.seq_at, node._sequence_nr()) - 1
            module = self.seq_mod[i] if i >= 0 else 0
        return module, RECOMPUTE if again else BACKWARD

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        module, phase = self._owner()
        unit = self.unit_of[module]
        # a context change: a unit's forward or backward begins. Ops outside every unit (a neck, a loss, parameter
        # gradients accumulating) continue the context before them, except where the direction changes
        ctx = (int(self.backward), unit)
        if not self.marks or (self.marks[-1][1:] != ctx and (unit >= 0 or self.marks[-1][1] != ctx[0])):
            self.marks.append((len(self.events), *ctx))
        count = _FLOPS.get(func._overloadpacket)
        if count is not None:
            self.flops[(module, phase)] += count(*args, **kwargs, out_val=out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self.keys:
                    key, n = self.next_key, rounded(st.nbytes(), self.granularity)
                    self.next_key += 1
                    self.keys[st] = key
                    label = self.label_ids.setdefault((module, phase), len(self.labels))
                    if label == len(self.labels):
                        self.labels.append((module, phase))
                    self.label_of.append(label)
                    self.events.append((key, n))
                    weakref.finalize(st, self.events.append, (key, -n))
        return out

    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(t.untyped_storage())

    def peak(self, exclude: set[int]) -> int:
        return self.recording().live_curve(exclude)[0]

    def recording(self) -> Recording:
        return Recording(self.events, self.label_of, self.labels, self.modules, self.unit_of, self.marks,
                         dict(self.flops), self.forward_end, self.inputs)
