"""The sharded margin-softmax head (models/partial_fc.py) against the unsharded MarginHead, and its row-sparse
AdamW and re-splittable checkpoints (engine/head_shard.py). Op level: 2 gloo processes vs 1 process."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.face_head import REL, check_partial_fc_rank
from tests.helpers.ports import free_port
from vtrain.config import ModelConfig, OptimConfig, RunConfig
from vtrain.engine.head_shard import ShardedHead
from vtrain.models.metric import MarginHead
from vtrain.models.partial_fc import PartialFC, shard_range

C, D, B = 7, 6, 3  # 7 classes over 2 ranks: shards of 4 and 3 (uneven on purpose)
CASES = [("arcface", 1.0), ("cosface", 1.0), ("arcface", 0.5), ("cosface", 0.3)]


def _batch():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2 * B, D, generator=g)
    labels = torch.tensor([0, 3, 3, 6, 4, 1])
    weight = torch.randn(C, D, generator=g)
    return emb, labels, weight


def _margin(kind):
    return 0.5 if kind == "arcface" else 0.4


def _reference(kind, classes=None):
    """MarginHead on the whole batch; over a subset of the classes (the sampled ones) when given."""
    emb, labels, weight = _batch()
    classes = torch.arange(C) if classes is None else classes
    head = MarginHead(D, len(classes), kind, _margin(kind), 16.0)
    head.weight.data.copy_(weight[classes])
    emb.requires_grad_(True)
    loss, _ = head(emb, torch.searchsorted(classes, labels))
    loss.backward()
    w_grad = torch.zeros(C, D)
    w_grad[classes] = head.weight.grad
    return loss.detach(), emb.grad, w_grad


def _sharded(rank, world, kind, sample_rate):
    torch.manual_seed(rank)
    emb, labels, weight = _batch()
    head = PartialFC(D, C, kind, _margin(kind), 16.0, sample_rate, rank, world)
    start, n = shard_range(C, rank, world)
    head.weight.data.copy_(weight[start:start + n])
    mine = emb[rank * B:(rank + 1) * B] if world > 1 else emb
    mine = mine.clone().requires_grad_(True)
    out = head(mine, labels[rank * B:(rank + 1) * B] if world > 1 else labels)
    out["loss"].backward()
    # the embedding gradient carries the factor W that undoes the engines' gradient averaging
    used = torch.arange(n) if head.last_index is None else head.last_index
    w_grad = head.weight.grad
    if w_grad is None:  # sampling: the sampled rows' own leaf holds their gradient
        w_grad = torch.zeros_like(head.weight)
        for rows, leaf in head.pending:
            w_grad.index_add_(0, rows, leaf.grad)
    return out["loss"].detach(), mine.grad / world, w_grad, used + start


def _worker(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # numpy: pickled by value (a torch tensor goes through a shared-memory handle that dies with this process)
        cases = [[t.numpy() for t in _sharded(rank, 2, kind, r)] for kind, r in CASES]
        # --head-update dense against PartialFC_V2 + AdamW on 2 gloo processes (tests/fixtures/face_head/)
        fixture = [check_partial_fc_rank(rank, 2, "dense", forced) for forced in (True, False)]
        q.put((rank, cases, fixture))
    finally:
        dist.destroy_process_group()


def _check(case, per_rank, world):
    kind, rate = case
    classes = torch.cat([touched for *_, touched in per_rank]).sort().values
    loss, emb_grad, w_grad = _reference(kind, None if rate == 1.0 else classes)
    _, labels, _ = _batch()
    assert set(labels.tolist()) <= set(classes.tolist())  # every positive class was kept
    for rank, (l, g, w, touched) in enumerate(per_rank):
        start, n = shard_range(C, rank, world)
        want = n if rate == 1.0 else max(int(rate * n), len({c for c in labels.tolist() if start <= c < start + n}))
        assert len(touched) == want
        assert torch.allclose(l, loss, atol=1e-5), (case, rank)  # the same global loss on every rank
        rows = slice(rank * B, (rank + 1) * B) if world > 1 else slice(None)
        assert torch.allclose(g, emb_grad[rows], atol=1e-5), (case, rank)
        assert torch.allclose(w, w_grad[start:start + n], atol=1e-5), (case, rank)


@pytest.mark.parametrize("case", CASES)
def test_one_shard_equals_margin_head(case):
    _check(case, [_sharded(0, 1, *case)], 1)


@pytest.mark.slow
def test_two_shards_equal_margin_head():
    """ArcFace and CosFace, full softmax and sampled: loss, embedding and weight-shard gradients of 2 gloo
    processes equal MarginHead's over the (sampled) classes on the whole batch in one process. And
    `--head-update dense` on 2 processes equals arcface_torch's PartialFC_V2 + AdamW on 2 processes over the
    fixture's 5 steps (tests/models/test_face_head_fixtures.py does 1 process)."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got, fixture = {}, {}
    for rank, cases, fx in (q.get(timeout=300) for _ in procs):
        got[rank], fixture[rank] = [[torch.from_numpy(a) for a in case] for case in cases], fx
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for i, case in enumerate(CASES):
        _check(case, [got[0][i], got[1][i]], 2)
    for rank, (forced, free) in fixture.items():  # the same rows were sampled (asserted in each process)
        assert max(forced.values()) <= REL, (rank, forced)
        assert max(free[k] for k in ("weight", "exp_avg", "exp_avg_sq")) <= REL, (rank, free)


def _cfg(update="dense", **optim):
    return RunConfig(task="metric", model=ModelConfig(embedding_dim=D, head_parallel="sharded", head_update=update),
                     optim=OptimConfig(**optim))


def _sampled_grad(head, rows, grad):
    """What a `sampled` forward + backward leaves: the rows' own leaf with their gradient."""
    leaf = head.fc.weight.detach()[rows].clone().requires_grad_(True)
    leaf.grad = grad.clone()
    head.fc.pending.append((torch.tensor(rows), leaf))


def test_sampled_update_matches_torch_adamw_on_the_rows_it_steps():
    cfg = _cfg("sampled", lr=0.01, weight_decay=0.1)
    head = ShardedHead(cfg, C, 0, 1, torch.device("cpu"))
    start = head.fc.weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    plan = [[0, 2, 5], [0, 5], list(range(C)), [2]]  # rows sampled per step; row 6 never, rows 1,3,4 once
    grads = [torch.randn(C, D, generator=g) for _ in plan]
    for rows, grad in zip(plan, grads):
        _sampled_grad(head, rows, grad[rows])
        head.step(1.0, None, 0.0)
        assert head.fc.weight.grad is None and not head.fc.pending and head.grad() == (None, None)
    # each row equals torch AdamW run over exactly the steps that touched it (per-row bias correction)
    for row in range(C):
        ref_row = torch.nn.Parameter(start[row].clone())
        opt = torch.optim.AdamW([ref_row], lr=0.01, weight_decay=0.1, betas=cfg.optim.betas)
        steps = 0
        for rows, grad in zip(plan, grads):
            if row in rows:
                ref_row.grad = grad[row].clone()
                opt.step()
                steps += 1
        assert int(head.row_steps[row]) == steps
        assert torch.allclose(head.fc.weight[row], ref_row.detach(), atol=1e-6, rtol=1e-5), row
        if steps == 0:  # never sampled: weight and moments bit-identical to the start (no decay at all)
            assert torch.equal(head.fc.weight[row], start[row])
            assert not head.exp_avg[row].any() and not head.exp_avg_sq[row].any()
        else:
            st = opt.state[ref_row]
            assert torch.allclose(head.exp_avg[row], st["exp_avg"], atol=1e-7)
            assert torch.allclose(head.exp_avg_sq[row], st["exp_avg_sq"], atol=1e-7)


def test_dense_update_is_torch_adamw_bit_for_bit_and_goes_on_from_sampled_steps(tmp_path):
    """`dense`: every row steps with torch's own AdamW (its fused kernel: bit-equal weights and moments, the rows
    with a zero gradient decayed and moved by their momentum). A checkpoint of a `sampled` run (rows with different step
    counts, the only kind earlier versions wrote) goes on under `dense` with each row's own bias correction."""
    cfg = _cfg("dense", lr=0.01, weight_decay=0.1)
    head = ShardedHead(cfg, C, 0, 1, torch.device("cpu"))
    ref = torch.nn.Parameter(head.fc.weight.detach().clone())
    opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, betas=cfg.optim.betas, fused=True)
    g = torch.Generator().manual_seed(2)
    for factor in (1.0, 0.5, 0.25):
        grad = torch.randn(C, D, generator=g)
        grad[[1, 4]] = 0.0  # rows not sampled this step
        head.fc.weight.grad = grad.clone()
        head.step(factor, None, 0.0)
        ref.grad = grad.clone()
        opt.param_groups[0]["lr"] = 0.01 * factor
        opt.step()
        assert torch.equal(head.fc.weight.detach(), ref.detach())
        assert torch.equal(head.exp_avg, opt.state[ref]["exp_avg"])
        assert torch.equal(head.exp_avg_sq, opt.state[ref]["exp_avg_sq"])
    assert head.uniform_step == 3 and torch.equal(head.row_steps, torch.full((C,), 3))
    sampled = ShardedHead(_cfg("sampled", lr=0.01, weight_decay=0.1), C, 0, 1, torch.device("cpu"))
    _sampled_grad(sampled, [0, 3], torch.randn(2, D, generator=g))
    sampled.step(1.0, None, 0.0)
    sampled.save(tmp_path)
    dense = ShardedHead(cfg, C, 0, 1, torch.device("cpu"))
    dense.load(tmp_path)
    assert dense.uniform_step is None and dense.row_steps.tolist() == [1, 0, 0, 1, 0, 0, 0]
    start = dense.fc.weight.detach().clone()
    grad = torch.randn(C, D, generator=g)
    dense.fc.weight.grad = grad.clone()
    dense.step(1.0, None, 0.0)
    assert dense.row_steps.tolist() == [2, 1, 1, 2, 1, 1, 1]
    for row in range(C):  # torch AdamW on the row, from its saved moments and step count
        p = torch.nn.Parameter(start[row].clone())
        o = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
        p.grad = grad[row].clone()
        if sampled.row_steps[row]:
            o.state[p] = {"step": torch.tensor(1.0), "exp_avg": sampled.exp_avg[row].clone(),
                          "exp_avg_sq": sampled.exp_avg_sq[row].clone()}
        o.step()
        assert torch.allclose(dense.fc.weight[row], p.detach(), atol=1e-7, rtol=1e-6), row


def test_sampled_gradient_is_the_sampled_rows_summed_over_micro_batches():
    """With sampling the head's gradient never exists at the shard's size: each micro-batch's sampled rows are a
    leaf of their own; the window's gradient is their union with a twice-sampled row's gradients summed, which is
    what clipping, the finiteness check and the update read. Reference: autograd through `weight[index]` (as
    arcface_torch indexes its weight), a gradient over the whole shard."""
    cfg = RunConfig(task="metric", model=ModelConfig(embedding_dim=D, head_parallel="sharded", sample_rate=0.3))
    heads = [ShardedHead(cfg, 50, 0, 1, torch.device("cpu")) for _ in range(2)]
    heads[1].fc.weight.data.copy_(heads[0].fc.weight.data)
    heads[1].fc.rows = lambda index: heads[1].fc.weight[index]  # the reference's indexing
    emb, labels = torch.randn(2, 4, D), torch.tensor([[3, 7, 7, 40], [7, 12, 3, 3]])
    for head in heads:
        torch.manual_seed(5)
        for micro in range(2):
            head.loss({"embedding": emb[micro]}, labels[micro])["loss"].backward()
    sampled, reference = heads
    assert sampled.fc.weight.grad is None and [leaf.shape[0] for _, leaf in sampled.fc.pending] == [15, 15]
    windows = torch.cat([r for r, _ in sampled.fc.pending])
    rows, grad = sampled.grad()
    assert rows.tolist() == sorted(set(windows.tolist()))
    assert grad.shape == (len(rows), D) and len(rows) < 30  # the two windows' samples overlap (3 and 7)
    want = reference.fc.weight.grad
    assert torch.allclose(grad, want[rows], atol=1e-7) and not want[~torch.isin(torch.arange(50), rows)].any()
    assert torch.allclose(sampled.grad_sq_norm(), (want ** 2).sum(), rtol=1e-6)


def test_clipping_scales_the_head_like_clip_grad_norm():
    for update in ("dense", "sampled"):
        head = ShardedHead(_cfg(update, lr=0.1, weight_decay=0.0), C, 0, 1, torch.device("cpu"))
        start = head.fc.weight.detach().clone()
        ref = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
        grad = torch.randn(C, D) * 10
        if update == "dense":
            head.fc.weight.grad = grad.clone()
        else:
            _sampled_grad(head, list(range(C)), grad)
        total = torch.tensor(25.0)  # the global norm over backbone and head, as the engine passes it
        head.step(1.0, total, 1.0)
        ref.grad = grad * (1.0 / (25.0 + 1e-6))
        opt.step()
        assert torch.allclose(head.fc.weight, ref.detach(), atol=1e-6), update


def test_checkpoint_resplits_for_another_world_size(tmp_path):
    """Two ranks' files (uneven shards) re-read by one rank and by three: bit-equal rows of every tensor."""
    cfg = _cfg()
    heads = [ShardedHead(cfg, C, r, 2, torch.device("cpu")) for r in range(2)]
    for r, h in enumerate(heads):
        for t in (h.fc.weight.data, h.exp_avg):
            t.copy_(torch.randn_like(t))
        h.exp_avg_sq.copy_(torch.rand_like(h.exp_avg_sq))  # a second moment is >= 0 (the reader checks it)
        h.row_steps.copy_(torch.randint(0, 9, h.row_steps.shape))
        h.save(tmp_path)
    full = {k: torch.cat([getattr(h, k) if k != "weight" else h.fc.weight.detach() for h in heads])
            for k in ("weight", "exp_avg", "exp_avg_sq", "row_steps")}
    for world in (1, 3):
        for r in range(world):
            h = ShardedHead(cfg, C, r, world, torch.device("cpu"))
            h.load(tmp_path)
            s, n = shard_range(C, r, world)
            assert torch.equal(h.fc.weight.detach(), full["weight"][s:s + n])
            assert torch.equal(h.exp_avg, full["exp_avg"][s:s + n])
            assert torch.equal(h.exp_avg_sq, full["exp_avg_sq"][s:s + n])
            assert torch.equal(h.row_steps, full["row_steps"][s:s + n])
    (tmp_path / "head" / sorted(p.name for p in (tmp_path / "head").iterdir())[1]).unlink()
    with pytest.raises(Exception, match="end at class 4"):
        ShardedHead(cfg, C, 0, 1, torch.device("cpu")).load(tmp_path)


def test_config_rejects_bad_head_flags():
    from vtrain.errors import VtrainError

    with pytest.raises(VtrainError, match="--head-update.*needs --head-parallel sharded"):
        ModelConfig(head_update="sampled")
    with pytest.raises(VtrainError, match="--arcface-grad.*needs --head arcface"):
        ModelConfig(head="cosface", arcface_grad="chain")
    with pytest.raises(VtrainError, match="--arcface-grad"):
        ModelConfig(arcface_grad="exact")

    with pytest.raises(VtrainError, match="--sample-rate"):
        ModelConfig(sample_rate=0.0, head_parallel="sharded")
    with pytest.raises(VtrainError, match="needs --head-parallel sharded"):
        ModelConfig(sample_rate=0.5)
    with pytest.raises(VtrainError, match="--head-parallel"):
        ModelConfig(head_parallel="ring")


def test_full_head_weight_is_split_into_rank_rows():
    """A consolidated head.weight (--pretrained / --resume-weights-only) gives each rank its rows."""
    from vtrain.errors import VtrainError

    full = torch.randn(C, D)
    for r in range(2):
        h = ShardedHead(_cfg(), C, r, 2, torch.device("cpu"))
        sd = {"head.weight": full.clone(), "neck.proj.weight": torch.zeros(1)}
        assert "loaded" in h.take_rows(sd)
        s, n = shard_range(C, r, 2)
        assert torch.equal(h.fc.weight.detach(), full[s:s + n]) and "head.weight" not in sd
    h = ShardedHead(_cfg(), C, 0, 1, torch.device("cpu"))
    assert "re-initialised" in h.take_rows({"head.weight": torch.randn(C + 1, D)})
    with pytest.raises(VtrainError, match="head.weight is none"):
        h.take_rows({}, required=True)


class _Zero12:
    """The two members of DeepSpeed's ZeRO-1/2 optimizer that `_zero_norm_with_head` hooks into."""
    loss_scale = 2.0

    def scaled_global_norm(self):
        return torch.tensor(6.0)  # loss-scaled: the backbone's norm is 3


class _Zero3(_Zero12):
    def _get_norm_groups(self):
        return [torch.tensor(6.0), torch.tensor(0.0)]


def test_zero_norm_hook_adds_the_head_to_deepspeeds_norm_for_one_step():
    from deepspeed.runtime.utils import combine_grad_norm_groups

    from vtrain.engine.engines.ds_internals import zero_norm_with_head as _zero_norm_with_head
    from vtrain.errors import VtrainError

    head = torch.tensor(4.0)
    opt = _Zero12()
    with _zero_norm_with_head(opt, 2, head) as seen:
        assert float(opt.scaled_global_norm()) == pytest.approx(10.0)  # sqrt(3^2 + 4^2) x loss scale 2
    assert float(seen["norm"]) == pytest.approx(3.0) and float(opt.scaled_global_norm()) == 6.0  # restored
    opt = _Zero3()
    with _zero_norm_with_head(opt, 3, head) as seen:  # ZeRO-3 step L2-combines the groups itself
        assert float(combine_grad_norm_groups(opt._get_norm_groups())) == pytest.approx(10.0)
    assert float(seen["norm"]) == pytest.approx(3.0) and "_get_norm_groups" not in vars(opt)
    for stage, bare in ((0, _Zero12()), (3, _Zero12()), (2, object())):  # no ZeRO, or another DeepSpeed
        with pytest.raises(VtrainError, match=r"DeepSpeed \d"):
            with _zero_norm_with_head(bare, stage, head):
                pass


@pytest.mark.parametrize("update", ["dense", "sampled"])
def test_a_sampled_step_allocates_nothing_of_the_shards_size(update):
    """With sampling, a whole step (forward, backward, clip norm, update) allocates only what the sampled rows need:
    no gradient over the shard, no full-size square for the norm, no full-size gather or scatter (before: a
    shard-sized gradient every step, and its square). `dense` writes into the one buffer it keeps."""
    from torch.profiler import ProfilerActivity, profile

    rows, dim = 20_000, 64
    cfg = RunConfig(task="metric", model=ModelConfig(embedding_dim=dim, head_parallel="sharded", sample_rate=0.05,
                                                     head_update=update))
    head = ShardedHead(cfg, rows, 0, 1, torch.device("cpu"))
    emb, labels = torch.randn(32, dim), torch.randint(0, rows, (32,))

    def step():
        head.loss({"embedding": emb}, labels)["loss"].backward()
        head.step(1.0, head.grad_sq_norm().sqrt(), 1.0)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert sizes and max(sizes) < rows * dim * 4 / 10, max(sizes)  # the sampled rows: 1,000 of 20,000
    assert int(head.row_steps.max()) == 2 and (update == "dense") == bool((head.row_steps == 2).all())
