"""ZeRO stages 1 and 2 against the DDP engine, 2 (and 4) processes over Gloo."""

import pytest

from harness import run_distributed

STAGES = ["zero1", "zero2"]


def _train(backend, mixed_precision, steps, clip=None, fused=False, inject_inf_at=None, sgd=False,
           norm_type=2.0, **opts):
    """10 steps of the small transformer; per-step params (full) and step results."""
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    rank = dist.get_rank()
    acc = Accelerator(mixed_precision=mixed_precision, backend=backend, cpu=True, log_policy=False,
                      fused_optimizer=fused, engine_options=opts or None)
    model = make_transformer(seed=rank)  # prepare() broadcasts rank 0's weights
    if sgd:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = acc.prepare(model, optimizer)
    hook = None
    history, results, norms = [], [], []
    for step, (x, y) in enumerate(transformer_batches(steps, seed=100 + rank)):
        if inject_inf_at == step and rank == 0:
            def poison(g):
                g = g.clone()
                g.view(-1)[3] = float("inf")
                return g
            hook = model.head.weight.register_hook(poison)
        acc.backward(loss_fn(model(x), y))
        if hook is not None:
            hook.remove()
            hook = None
        if clip is not None:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type)))
        results.append(opt.step())
        opt.zero_grad()
        history.append([p.detach().float().clone() for p in model.parameters()])
    return history, [(r.stepped, r.reason) for r in results], norms


def _worst(a, b):
    return max(((x - y).abs() / (y.abs() + 1e-12)).max().item() for x, y in zip(a, b))


def _parity(state, backend, mixed_precision, fused):
    ref, _, _ = _train("ddp", mixed_precision, 10, fused=fused)
    ours, results, _ = _train(backend, mixed_precision, 10, fused=fused)
    assert all(stepped for stepped, _ in results), results
    return max(_worst(a, b) for a, b in zip(ours, ref))


# Exact, in every precision: the same forward/backward, the same fp32 gradient sums (at N=2
# a sum of two terms has one order, all-reduce and reduce-scatter alike) and the same
# torch.optim update on the same fp32 masters: the same arithmetic, so the same bits on any
# CPU (an element-wise tolerance would only hide a real difference: issue #46).
TOL = {"no": 0.0, "bf16": 0.0, "fp16": 0.0}


@pytest.mark.parametrize("backend", STAGES)
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_matches_ddp_engine_every_step(backend, mixed_precision):
    for worst in run_distributed(_parity, 2, args=(backend, mixed_precision, False)):
        assert worst <= TOL[mixed_precision], worst


def _overflow(state, backend, loss_scaler):
    import torch.distributed as dist

    from mixprec import Accelerator  # noqa: F401  (imported in the child)

    history, results, _ = _train(backend, "fp16", 4, inject_inf_at=2, loss_scaler=loss_scaler)
    unchanged = all(a.equal(b) for a, b in zip(history[1], history[2]))
    moved = not all(a.equal(b) for a, b in zip(history[2], history[3]))
    return results, unchanged, moved, dist.get_rank()


@pytest.mark.parametrize("backend", STAGES)
def test_inf_on_one_rank_skips_on_every_rank(backend):
    # The inf goes into one element of head.weight's gradient on rank 0 only; after the
    # reduction only the rank owning that element sees it: found_inf must be agreed.
    for results, unchanged, moved, _ in run_distributed(_overflow, 2, args=(backend, "torch")):
        assert results[2] == (False, "overflow"), results
        assert [r[0] for r in results] == [True, True, False, True]
        assert unchanged and moved


def _scaler_after_overflow(state, backend, loss_scaler):
    from mixprec import Accelerator  # noqa: F401

    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_transformer, transformer_batches

    acc = Accelerator(mixed_precision="fp16", backend=backend, cpu=True, log_policy=False,
                      engine_options={"loss_scaler": loss_scaler})
    model = make_transformer()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    scales = []
    for x, y in transformer_batches(3, seed=dist.get_rank()):
        loss = loss_fn(model(x), y) * (float("inf") if len(scales) < 2 else 1.0)
        acc.backward(loss)
        scales.append((opt.step().stepped, acc.loss_scale))
        opt.zero_grad()
    return scales


def test_deepspeed_scaler_hysteresis():
    torch_like = run_distributed(_scaler_after_overflow, 2, args=("zero2", "torch"))[0]
    deepspeed = run_distributed(_scaler_after_overflow, 2, args=("zero2", "deepspeed"))[0]
    assert [s for s, _ in torch_like] == [False, False, True]
    assert [v for _, v in torch_like] == [32768.0, 16384.0, 16384.0]
    # hysteresis=2: the first overflow is tolerated, the second backs off.
    assert [v for _, v in deepspeed] == [65536.0, 32768.0, 32768.0]


def _clip(state, backend):
    import torch

    # SGD: the global norm is summed in another order than DDP's (owned shards, then one
    # all-reduce), so the clip coefficient may differ in its last bit. Adam would turn that
    # bit into an O(lr) step on the attention key bias, whose true gradient is zero (see
    # [Note: the attention key bias] in tests/test_parity_single.py); SGD keeps it a bit.
    # Which elements each rank's partial sum covers follows the shard boundaries, which the
    # 16-byte slot alignment ([Note: aligned slots] in csrc/engines/sharded/layout.h) moves;
    # a near-zero tensor (that bias: |w| < 1e-4) turns the last-bit difference into 1.5e-5
    # relative to its own elements, 7e-12 absolute. So the difference is measured against
    # each tensor's largest value.
    hist_ref, _, ref = _train("ddp", "fp16", 4, clip=0.05, sgd=True)
    hist, _, ours = _train(backend, "fp16", 4, clip=0.05, sgd=True)
    worst = max(((x - y).abs().max() / (y.abs().max() + 1e-12)).item() for x, y in zip(hist[-1], hist_ref[-1]))
    # The inf-norm is a max: exact in any order, so equal to DDP's bitwise (and computed with
    # one device reduction, no host read per gradient).
    inf_ref = _train("ddp", "fp16", 4, clip=0.01, sgd=True, norm_type=float("inf"))
    inf_ours = _train(backend, "fp16", 4, clip=0.01, sgd=True, norm_type=float("inf"))
    inf_equal = inf_ours[2] == inf_ref[2] and all(
        torch.equal(a, b) for a, b in zip(inf_ours[0][-1], inf_ref[0][-1]))
    return ref, ours, worst, inf_ref[2], inf_equal


@pytest.mark.parametrize("backend", STAGES)
def test_clip_grad_norm_same_on_all_ranks_and_equal_to_ddp(backend):
    out = run_distributed(_clip, 2, args=(backend,))
    (ref0, ours0, worst0, inf_norms, inf_equal0), (_, ours1, _, _, inf_equal1) = out
    assert ours0 == ours1  # one all-reduce: bitwise the same value everywhere
    assert all(n > 0.05 for n in ref0)  # the clip is active on every step
    for a, b in zip(ours0, ref0):
        assert abs(a - b) <= 1e-5 * b, (a, b)
    assert worst0 <= 1e-5, worst0  # clipped updates match DDP's
    assert all(n > 0.01 for n in inf_norms), inf_norms  # the inf-norm clip is active too
    assert inf_equal0 and inf_equal1


def _accumulation(state, backend):
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_mlp
    from mixprec import Accelerator, GradientAccumulationPlugin

    g = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]

    def train(ga, mode):
        # sync_each_batch: accumulate() leaves sync on, so zero2 reduces every micro-batch into
        # its 1/N shard, which sums them (docs/zero.md, "Accumulating over micro-batches").
        plugin = GradientAccumulationPlugin(num_steps=ga, sync_each_batch=mode == "sync_each_batch")
        acc = Accelerator(gradient_accumulation_plugin=plugin, backend=backend, cpu=True, log_policy=False)
        model = make_mlp()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for x, y in data:
            if mode in ("accumulate", "sync_each_batch"):
                for i in range(ga):
                    with acc.accumulate(model):
                        acc.backward(loss_fn(model(x[i::ga]), y[i::ga]))
                        if i == 0 and ga > 1:  # full fp32 buckets still held between micro-batches
                            held[mode] = sum(c.grad_bucket_bytes() for c in acc.engine.comm.all_cores())
                        opt.step()
                        opt.zero_grad()
            else:  # one coalesced reduction for the micro-batches
                with acc.engine.coalesce_grad_reduction(model):
                    for i in range(ga):
                        acc.backward(loss_fn(model(x[i::ga]), y[i::ga]))  # divided by ga
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    held = {}
    big = train(1, "accumulate")
    worst = [max((a - b).abs().max().item() for a, b in zip(big, train(2, mode)))
             for mode in ("accumulate", "coalesce", "sync_each_batch")]
    return worst, held


@pytest.mark.parametrize("backend", STAGES)
def test_accumulate_and_coalesce_equal_larger_batch(backend):
    for worst, held in run_distributed(_accumulation, 2, args=(backend,)):
        assert max(worst) <= 1e-6, worst
        assert held["accumulate"] > 0, held  # accumulate() keeps the full fp32 gradient
        # sync_each_batch: zero2 reduced the micro-batch into its shard and freed the buckets;
        # zero1 reduces only at the step
        assert (held["sync_each_batch"] == 0) == (backend == "zero2"), held


def _refused(state, optimizer_name):
    import torch

    from _helpers import make_mlp
    from mixprec import Accelerator

    acc = Accelerator(backend="zero2", cpu=True, log_policy=False)
    model = make_mlp()
    opt = getattr(torch.optim, optimizer_name)(model.parameters(), lr=0.1)
    try:
        acc.prepare(model, opt)
    except ValueError as e:
        return str(e)
    return None


def test_lbfgs_is_refused_with_the_fix():
    message = run_distributed(_refused, 2, args=("LBFGS",))[0]
    assert message is not None and "LBFGS" in message and "backend='ddp'" in message
    assert run_distributed(_refused, 2, args=("RMSprop",))[0] is None  # element-wise: accepted


def _memory(state, backend):
    import torch

    from _helpers import loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 0.01, "bucket_cap_mb": 0.02})
    model = make_transformer()
    full = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in transformer_batches(2):
        acc.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad()
    mem = acc.engine.persistent_bytes()
    owned = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return full, owned, mem["master"] + mem["optimizer_state"]


def test_persistent_memory_is_a_1_over_n_share():
    for backend, world in (("zero2", 4), ("zero1", 2)):
        out = run_distributed(_memory, world, args=(backend,))
        full = out[0][0]
        assert sum(owned for _, owned, _ in out) == full  # every element owned exactly once
        for _, owned, persistent in out:
            # fp32 master + Adam's exp_avg and exp_avg_sq = 12 bytes per element, / N
            # (padding: < world elements per bucket).
            assert persistent == pytest.approx(12 * full / world, rel=0.02), (persistent, full)




def _bf16_params(state, backend):
    import torch
    import torch.distributed as dist

    from _helpers import loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    out = []
    for b in ("ddp", backend):
        acc = Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16, backend=b, cpu=True,
                          log_policy=False)
        model = make_transformer()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for x, y in transformer_batches(5, seed=dist.get_rank()):
            acc.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        state = acc.get_state_dict(model)
        out.append({k: v for k, v in state.items() if k in dict(model.named_parameters())})
    ddp, ours = out
    masters_match = max((ddp[k] - ours[k]).abs().max().item() for k in ddp)
    lowp_is_rounded_master = all(
        torch.equal(p, ours[n].to(torch.bfloat16)) for n, p in model.named_parameters())
    return masters_match, lowp_is_rounded_master, all(v.dtype == torch.float32 for v in ours.values())


@pytest.mark.parametrize("backend", STAGES)
def test_bf16_storage_gathers_rounded_fp32_masters(backend):
    for worst, rounded, fp32 in run_distributed(_bf16_params, 2, args=(backend,)):
        assert worst == 0.0 and rounded and fp32, (worst, rounded, fp32)  # the same arithmetic: exact


def _layout(state):
    import torch
    from torch import nn

    from mixprec import Accelerator

    model = nn.Sequential(*[nn.Linear(33, 7) for _ in range(5)])  # odd sizes force padding
    acc = Accelerator(backend="zero2", cpu=True, log_policy=False,
                      engine_options={"first_bucket_cap_mb": 1e-3, "bucket_cap_mb": 2e-3})
    model = acc.prepare(model)
    core = acc.engine.comm.cores[id(model)][0]
    return core.partition_map(), core.bucket_indices(), core.bucket_shards(), core.world_size


def test_layout_reverse_order_even_split():
    maps = run_distributed(_layout, 4)
    pmap, buckets, shards, world = maps[0]
    assert all(m[0] == pmap for m in maps)
    assert [i for b in buckets for i in b] == list(range(9, -1, -1))  # [Note: bucket order]
    assert pmap["0.weight"][1:] == (231, (7, 33))
    assert all(offset % 4 == 0 for offset, _numel, _shape in pmap.values())  # 16-byte slots
    per_rank = [s for _, s in shards]
    for b, s in zip(buckets, per_rank):
        end = 0  # [Note: aligned slots]: each slot at the first 4-element boundary after the last
        for i in b:
            end = -(-end // 4) * 4 + (231 if i % 2 == 0 else 7)
        # padded to a multiple of N * 4 elements, minimally
        assert s % 4 == 0 and s * world >= end > (s - 4) * world



def _comm_per_step(state, backend, steps, opts):
    """Per-step collective payload (the engine's cumulative counters over ``steps`` steps,
    after one warm-up step) of a model whose every parameter is a whole number of 16-byte
    bf16 slots and every bucket a multiple of 2 x 8 elements (so no bucket needs padding at
    N=2: [Note: aligned slots] in csrc/engines/sharded/layout.h) and, for zero3/fsdp, lives
    in a Linear unit."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    n_params = sum(p.numel() for p in model.parameters())
    acc = Accelerator(mixed_precision="bf16", param_dtype=torch.bfloat16, backend=backend, cpu=True,
                      log_policy=False, engine_options={"first_bucket_cap_mb": 0.002,
                                                        "bucket_cap_mb": 0.004, **opts})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(steps + 1)]

    def step(x, y):
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()

    step(*batches[0])
    before_reset = acc.engine.comm_counters()
    acc.engine.reset_comm_counters()
    assert all(v == 0 for v in acc.engine.comm_counters().values())
    for x, y in batches[1:]:
        step(x, y)
    counters = acc.engine.comm_counters()
    return n_params, before_reset, counters


@pytest.mark.parametrize("backend,opts,gathers_per_step", [
    ("zero1", {}, 1), ("zero2", {}, 1), ("zero2", {"collective": "reduce_scatter"}, 1),
    ("zero3", {"units": ["Linear"]}, 2),  # forward gather + backward re-gather
    ("fsdp", {"units": ["Linear"], "reshard_after_forward": False}, 1),  # kept until backward ends
])
def test_comm_counters_count_2p_or_3p_elements_per_step(backend, opts, gathers_per_step):
    steps = 3
    for n_params, before_reset, c in run_distributed(_comm_per_step, 2, args=(backend, steps, opts)):
        assert before_reset["elements_reduced"] == n_params  # the warm-up step alone
        # Reduction: every gradient element once per step, in fp32.
        assert c["elements_reduced"] == steps * n_params, (c, n_params)
        assert c["bytes_reduced"] == 4 * c["elements_reduced"]
        # Gathers: every parameter element once (zero1/2, fsdp keep) or twice (zero3) per
        # step, in the bf16 storage dtype: 2P (zero1/2) or 3P (zero3) elements per step.
        assert c["elements_gathered"] == gathers_per_step * steps * n_params, (c, n_params)
        assert c["bytes_gathered"] == 2 * c["elements_gathered"]
        total = (c["elements_reduced"] + c["elements_gathered"]) / steps
        assert total == (2 if gathers_per_step == 1 else 3) * n_params
        assert c["reductions"] > 0 and c["gathers"] > 0


def _low_precision_reduction(state, backend):
    import torch
    from torch import nn

    from mixprec import Accelerator, PrecisionPolicy

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        acc = Accelerator(backend=backend, log_policy=False,
                          policy=PrecisionPolicy.from_mixed_precision("bf16", reduce_dtype=dtype))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.engine.reset_comm_counters()
        g = torch.Generator().manual_seed(10 + state.rank)
        for _ in range(3):
            acc.backward(model(torch.randn(8, 16, generator=g)).float().square().mean())
            opt.step()
            opt.zero_grad()
        out[name] = (acc.engine.comm_counters()["bytes_reduced"],
                     {k: v.clone() for k, v in acc.get_state_dict(model).items()})
    return out


def _bf16_reduction_against_torch(state, backend):
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from mixprec import Accelerator, PrecisionPolicy

    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))
    model = copy.deepcopy(reference)
    acc = Accelerator(backend=backend, cpu=True, log_policy=False,
                      policy=PrecisionPolicy.from_mixed_precision("no", reduce_dtype=torch.bfloat16),
                      engine_options={"bucket_cap_mb": 64, "first_bucket_cap_mb": 64})
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    buckets = sum(len(c.bucket_indices()) for c in acc.engine.comm.all_cores())
    worst = 0.0
    for step in range(3):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(100 * step + rank))
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        reference(x).square().mean().backward()
        for p in reference.parameters():
            sent = (p.grad * 0.5).to(torch.bfloat16)  # grad/N in fp32, rounded once
            dist.all_reduce(sent)
            p.grad = sent.float()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        got = acc.get_state_dict(model)
        worst = max(worst, max((got[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    acc.engine.release()
    return buckets, worst


@pytest.mark.parametrize("backend", STAGES)
def test_bf16_reduction_is_a_rounded_fp32_sum_exactly(backend):
    """reduce_dtype=bf16 with a bucket of 1.06M elements, which the engine rounds in 256K
    chunks, giving back each chunk's fp32 pages ([Note: rounding a bucket page by page] in
    csrc/engines/sharded/core.cpp), and whose bf16 result it adds into the fp32 shard in
    chunks: 3 SGD steps equal plain PyTorch's, which rounds each grad/N to bf16 whole,
    all-reduces it and steps on its fp32 value, bitwise."""
    for buckets, worst in run_distributed(_bf16_reduction_against_torch, 2, args=(backend,)):
        assert buckets == 1
        assert worst == 0.0, worst


@pytest.mark.parametrize("backend", ["zero2", "fsdp"])
def test_bf16_reduction_halves_the_bytes_and_stays_close(backend):
    """reduce_dtype=bf16 on 2 ranks ([Note: low-precision reduction] in
    csrc/engines/sharded/core.h): half the bytes per reduction; after 3 SGD steps the
    weights are within bf16 rounding of the fp32-reduced run, and differ from it."""
    for out in run_distributed(_low_precision_reduction, 2, args=(backend,)):
        (fp32_bytes, fp32), (bf16_bytes, bf16) = out["fp32"], out["bf16"]
        assert bf16_bytes * 2 == fp32_bytes
        worst = max(float(((bf16[k] - fp32[k]).abs() / (fp32[k].abs() + 1e-3)).max()) for k in fp32)
        assert 0 < worst < 2e-2, worst
