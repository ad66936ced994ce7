"""The C++ DDP engine against torch's DistributedDataParallel, 2 processes over Gloo."""

import pytest

from harness import run_distributed


def _ddp_parity(state, mixed_precision, steps=10):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _helpers import AUTOCAST_DTYPE, loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    rank = dist.get_rank()
    ref = DDP(make_transformer(), bucket_cap_mb=25)
    ours = make_transformer(seed=rank)  # different init per rank: prepare() broadcasts rank 0's
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    acc = Accelerator(mixed_precision=mixed_precision, backend="ddp", cpu=True, log_policy=False,
                      fused_optimizer=False)
    model, opt = acc.prepare(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.01))
    dtype = AUTOCAST_DTYPE[mixed_precision]
    scaler = torch.amp.GradScaler("cpu", enabled=mixed_precision == "fp16")
    worst = 0.0
    for x, y in transformer_batches(steps, seed=100 + rank):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = ref(x)
        scaler.scale(loss_fn(out, y)).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        acc.backward(loss_fn(model(x), y))
        assert opt.step().stepped
        opt.zero_grad()
        for a, b in zip(ref.module.parameters(), model.parameters()):
            worst = max(worst, ((a - b).abs() / (a.abs() + 1e-12)).max().item())
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return worst, acc.engine.bytes_reduced_last_backward(), grad_bytes


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_matches_torch_ddp_every_step(mixed_precision):
    # Same bucket arithmetic as torch's Reducer (x * 1/N fused into the copy, SUM): the same
    # arithmetic, so bitwise equal on any CPU, and asserted so.
    for worst, reduced, grad_bytes in run_distributed(_ddp_parity, 2, args=(mixed_precision,)):
        assert worst == 0.0, worst
        assert reduced == grad_bytes  # fp32 reduction: exactly the gradient size per step


def _accumulation(state):
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_mlp
    from mixprec import Accelerator

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]

    def train(ga):
        acc = Accelerator(gradient_accumulation_steps=ga, backend="ddp", cpu=True, log_policy=False)
        model = make_mlp()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        chunks = [(x[i::ga], y[i::ga]) for x, y in data for i in range(ga)] if ga > 1 else data
        for x, y in chunks:
            with acc.accumulate(model):
                acc.backward(loss_fn(model(x), y))
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    big, small = train(1), train(2)
    return max((a - b).abs().max().item() for a, b in zip(big, small))


def test_accumulate_equals_larger_batch():
    for worst in run_distributed(_accumulation, 2):
        assert worst <= 1e-6, worst


def _unused(state, find_unused):
    import torch
    from torch import nn

    from mixprec import Accelerator

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.used = nn.Linear(4, 1)
            self.spare = nn.Linear(4, 1)

        def forward(self, x):
            return self.used(self.body(x))

    acc = Accelerator(backend="ddp", cpu=True, log_policy=False,
                      engine_options={"find_unused_parameters": find_unused})
    model = TwoHeads()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        acc.backward(model(torch.randn(3, 4)).sum())
    except ValueError as e:
        return str(e)
    opt.step()
    return [model.spare.weight.grad is None, model.body.weight.grad is not None]


def test_unused_parameters_are_named():
    for message in run_distributed(_unused, 2, args=(False,)):
        assert "spare.weight, spare.bias" in message and "find_unused_parameters=True" in message


def test_find_unused_parameters_handles_them():
    for spare_grad_none, body_has_grad in run_distributed(_unused, 2, args=(True,)):
        assert spare_grad_none and body_has_grad


def _low_precision_storage(state):
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_mlp, mlp_batches
    from mixprec import Accelerator

    rank = dist.get_rank()
    acc = Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16, backend="ddp", cpu=True,
                      log_policy=False, gradient_accumulation_steps=2)
    model = make_mlp(seed=rank)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in mlp_batches(6, seed=rank):
        with acc.accumulate(model):
            acc.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))
    gathered = [torch.zeros_like(masters[0]) for _ in range(2)]
    dist.all_gather(gathered, masters[0])
    return torch.equal(gathered[0], gathered[1])


def test_bf16_storage_keeps_fp32_masters_in_sync():
    assert all(run_distributed(_low_precision_storage, 2))


def _buckets(state):
    import torch
    from torch import nn

    from mixprec import Accelerator

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16.6 KB per layer (w+b)
    acc = Accelerator(backend="ddp", cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 10e3 / 2**20, "bucket_cap_mb": 40e3 / 2**20})
    model = acc.prepare(model)
    return acc.engine.comm.reducers[id(model)].bucket_indices()


def test_buckets_in_reverse_order_with_a_small_first_bucket():
    indices = run_distributed(_buckets, 2)
    assert indices[0] == indices[1]
    buckets = indices[0]
    # 12 params (w, b per layer), registered 0..11; buckets filled from the last one.
    assert buckets[0] == [11, 10]  # first bucket: ~10 KB cap -> one weight closes it
    flat = [i for b in buckets for i in b]
    assert flat == list(range(11, -1, -1))
    assert all(sum(64 * 64 * 4 if i % 2 == 0 else 256 for i in b) >= 40e3 for b in buckets[1:-1])


def _bf16_reduction(state):
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_mlp, mlp_batches
    from mixprec import Accelerator, PrecisionPolicy

    x, y = mlp_batches(1, seed=dist.get_rank())[0]
    grads, reduced = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        policy = PrecisionPolicy.from_mixed_precision("bf16", reduce_dtype=dtype)
        acc = Accelerator(policy=policy, backend="ddp", cpu=True, log_policy=False)
        model = acc.prepare(make_mlp())
        acc.backward(loss_fn(model(x), y))
        grads[dtype] = [p.grad.clone() for p in model.parameters()]
        reduced[dtype] = acc.engine.bytes_reduced_last_backward()
    worst = max(((a - b).abs().max() / a.abs().max()).item()
                for a, b in zip(grads[torch.float32], grads[torch.bfloat16]))
    dtypes = {g.dtype for g in grads[torch.bfloat16]}
    return reduced[torch.float32], reduced[torch.bfloat16], worst, dtypes


def test_bf16_gradient_reduction_halves_the_bytes():
    for fp32_bytes, bf16_bytes, worst, dtypes in run_distributed(_bf16_reduction, 2):
        assert bf16_bytes * 2 == fp32_bytes
        assert dtypes == {__import__("torch").float32}  # reduced in bf16, handed back in fp32
        assert worst < 2**-7  # within bf16 rounding of the largest gradient element


def _copy_in_check(state, where, reduce_bf16):
    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec import Accelerator, PrecisionPolicy

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    policy = PrecisionPolicy.from_mixed_precision(
        "bf16", **({"reduce_dtype": torch.bfloat16} if reduce_bf16 else {}))
    acc = Accelerator(policy=policy, backend="ddp", cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 10e3 / 2**20, "bucket_cap_mb": 40e3 / 2**20})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    reducer = acc.engine.comm.reducers[id(model)]
    params = list(model.parameters())
    # The last layer's weight is reduced in the first bucket; the first layer's weight in
    # the last one (the bucket that carries the flag).
    target = params[-2] if where == "first_bucket" else params[0]
    outcomes, takes, same = [], [], []
    for i in range(4):
        handle = None
        if i == 1 and rank == 1:  # inf on one rank, before the copy-in
            handle = target.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf")))
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * i + rank))
        acc.backward(model(x).float().square().mean())
        if handle is not None:
            handle.remove()
        if i == 2 and not reduce_bf16:
            # Taken here, so the step finds no flag and must check the gradients itself.
            takes.append((reducer.take_nonfinite_check().tolist(), reducer.take_nonfinite_check()))
        if i >= 2:  # inf written AFTER backward on every rank: only a pass at the step sees it
            with torch.no_grad():
                target.grad[0, 0] = float("inf")
        gathered = [torch.zeros_like(params[0]) for _ in range(2)]
        dist.all_gather(gathered, params[0].detach())
        same.append(torch.equal(gathered[0], gathered[1]))
        r = opt.step()
        opt.zero_grad()
        outcomes.append((r.stepped, r.reason))
    return reducer.checks_nonfinite, outcomes, takes, all(same)


@pytest.mark.parametrize("where", ["first_bucket", "last_bucket"])
def test_copy_in_checks_and_agrees_the_nonfinite_flag(where):
    # [Note: non-finite check in the copy-in]: inf on rank 1 only, in the bucket reduced
    # first or in the one carrying the flag: every rank skips. The step makes no pass of
    # its own when the Reducer's flag is there (iteration 4: an inf written after backward
    # goes unseen, by design), and makes one when it is not (iteration 3).
    for checks, outcomes, takes, same in run_distributed(_copy_in_check, 2, args=(where, False)):
        assert checks
        assert outcomes == [(True, "ok"), (False, "nonfinite"), (False, "nonfinite"), (True, "ok")]
        assert takes == [([0.0], None)]  # a clean backward; a second take finds nothing
        assert same


def test_bf16_reduction_of_fp32_grads_checks_at_the_step():
    # Buckets that cast cannot hold the gradients as views: every step checks them itself.
    for checks, outcomes, _, same in run_distributed(_copy_in_check, 2, args=("last_bucket", True)):
        assert not checks
        assert outcomes == [(True, "ok"), (False, "nonfinite"), (False, "nonfinite"), (False, "nonfinite")]
        assert same


def _stale_flag(state):
    import torch
    from torch import nn

    from mixprec import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="bf16", backend="ddp", cpu=True, log_policy=False)
    model = acc.prepare(nn.Linear(8, 8))
    reducer = acc.engine.comm.reducers[id(model)]
    x = torch.randn(4, 8)
    acc.backward(model(x).sum())
    fresh = reducer.take_nonfinite_check() is not None
    acc.backward(model(x).sum())  # a synchronising backward: a flag, not taken
    with acc.no_sync(model):
        acc.backward(model(x).sum())  # new gradients, no reduction: that flag is stale now
    return fresh, reducer.take_nonfinite_check()


def test_a_backward_without_sync_leaves_no_flag():
    for fresh, after_no_sync in run_distributed(_stale_flag, 2):
        assert fresh
        assert after_no_sync is None
