"""The fused update writes the forward's bf16/fp16 weights ([Note: the update writes the
forward's weights] in src/mixprec/engines/weight_casts.py): training is bitwise the same
as with autocast casting every forward (``cache_weight_casts=False``), the copies are
really used, and any write to a weight outside the update falls back to autocast's cast
until the next update, a skipped one included."""

import copy
import pickle

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from mixprec.engines.weight_casts import MIN_NUMEL, _CachedCastLinear, _UseCast

IN, BIG = 128, 256  # Linear(IN, BIG) and Linear(BIG, BIG) have >= MIN_NUMEL weights: cached


def _model(shared=False):
    torch.manual_seed(0)
    if shared:
        return _Shared()
    return nn.Sequential(nn.Linear(IN, BIG), nn.GELU(), nn.Linear(BIG, BIG), nn.GELU(), nn.Linear(BIG, 8))


class _Shared(nn.Module):
    """One Linear applied twice per forward (its two gradients meet in the compute dtype)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, BIG)
        self.mid = nn.Linear(BIG, BIG)
        self.out = nn.Linear(BIG, 8)

    def forward(self, x):
        h = torch.tanh(self.mid(self.inp(x)))
        return self.out(torch.tanh(self.mid(h)))


def _data(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, IN, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def _prepared(precision, cache, *, shared=False, optimizer=torch.optim.AdamW, **kw):
    model = _model(shared)
    acc = Accelerator(mixed_precision=precision, cpu=True, log_policy=False, cache_weight_casts=cache, **kw)
    model, opt = acc.prepare(model, optimizer(model.parameters(), lr=1e-2))
    return acc, model, opt


def _train(acc, model, opt, *, poison_at=None, between=None, n=6):
    out = []
    for i, (x, y) in enumerate(_data(n)):
        loss = nn.functional.mse_loss(model(x).float(), y)
        if i == poison_at:
            loss = loss * float("nan")
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        r = opt.step()
        opt.zero_grad()
        out.append((repr(loss.item()), r.stepped))
        if between is not None:
            between(i, model)
    return out


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _uses_copies(model, x):
    """How many _UseCast nodes the forward's graph holds."""
    seen, stack, count = set(), [model(x).grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += type(fn).__name__ == "_UseCastBackward"
        stack.extend(f for f, _ in fn.next_functions)
    return count


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("shared", [False, True])
def test_bitwise_same_training_as_autocast_casts(precision, shared):
    runs = {}
    for cache in (True, False):
        acc, model, opt = _prepared(precision, cache, shared=shared)
        log = _train(acc, model, opt, poison_at=3)
        runs[cache] = (log, _weights(model), opt.state_dict())
    assert runs[True][0] == runs[False][0]  # losses (repr: bitwise) and the skipped step 4
    assert runs[True][0][3][1] is False
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    for k, st in runs[True][2]["state"].items():
        for name, v in st.items():
            assert torch.equal(v, runs[False][2]["state"][k][name]), (k, name)


def test_copies_are_used_and_only_for_large_plain_linears():
    acc, model, opt = _prepared("bf16", True)
    casts = acc.engine.precision.casts
    x = _data(1)[0][0]
    # Linear(128, 256) and Linear(256, 256) qualify; Linear(256, 8) (2048 weights) does not.
    assert [type(m) is nn.Linear for m in model if isinstance(m, nn.Linear)] == [False, False, True]
    assert repr(model[0]).startswith("Linear(")
    assert len(casts.entries) == 2 and IN * BIG >= MIN_NUMEL > 8 * BIG
    # No copy before the first update: prepare() holds no second copy of the weights, and
    # the forward casts as autocast does.
    assert _uses_copies(model, x) == 0 and all(e.copy.numel() == 0 for e in casts.entries.values())
    _train(acc, model, opt, n=2)
    assert _uses_copies(model, x) == 2
    assert all(e.copy.dtype == torch.bfloat16 for e in casts.entries.values())
    for e in casts.entries.values():  # rewritten by the update: the weight rounded to bf16
        assert e.fresh() and torch.equal(e.copy, e.param.detach().to(torch.bfloat16))
    off, model_off, _ = _prepared("bf16", False)
    assert acc.engine.precision.casts is not None and off.engine.precision.casts is None
    assert _uses_copies(model_off, x) == 0


@pytest.mark.parametrize("precision", ["no", "bf16-pure"])
def test_not_used_without_fp32_weights_under_low_precision_autocast(precision):
    acc, model, _ = _prepared(precision, True)
    assert acc.engine.precision.casts is None
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))


def test_not_used_for_a_non_fused_optimizer_or_keep_fp32_module():
    acc, model, _ = _prepared("bf16", True, optimizer=torch.optim.RMSprop)
    assert acc.engine.precision.casts.entries == {}  # swapped, but nothing keeps copies current
    assert _uses_copies(model, _data(1)[0][0]) == 0
    acc, model, _ = _prepared("bf16", True, keep_fp32_modules=("0",))
    assert not isinstance(model[0], _CachedCastLinear) and isinstance(model[2], _CachedCastLinear)


def _write(i, model):
    if i == 1:
        with torch.no_grad():
            model[2].weight.mul_(0.5)  # seen through the weight's version


@pytest.mark.parametrize("poison_at", [None, 2])
def test_a_weight_written_outside_the_update_falls_back_then_recovers(poison_at):
    # Written after step 2; step 3 is either a real step or skipped on the device (nan):
    # both leave copy and weight in agreement, as with autocast's casts.
    runs = {}
    for cache in (True, False):
        acc, model, opt = _prepared("bf16", cache)
        log = _train(acc, model, opt, poison_at=poison_at, between=_write)
        runs[cache] = (log, _weights(model))
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_stale_copy_is_not_used_in_forward():
    _, model, _ = _prepared("bf16", True)
    _, ref, _ = _prepared("bf16", False)
    x = _data(1)[0][0]
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.add_(1.0)
            q.add_(1.0)
    assert _uses_copies(model, x) == 0
    assert torch.equal(model(x), ref(x))
    model.load_state_dict(ref.state_dict())  # a load is a write too
    assert _uses_copies(model, x) == 0
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))  # no_grad forward: the fallback cast as well


def test_autocast_off_region_gets_fp32_weights():
    acc, model, opt = _prepared("bf16", True)
    _train(acc, model, opt, n=1)
    x = _data(1)[0][0]
    with acc.autocast(enabled=False):
        out = model(x)
    assert _uses_copies(model, x) == 2
    with torch.autocast("cpu", enabled=False):
        ref = nn.functional.linear(x, model[0].weight, model[0].bias)
    assert out.dtype == torch.float32
    with acc.autocast(enabled=False):
        assert torch.equal(model[0](x), ref)


def test_backward_after_the_step_through_an_old_graph_raises():
    acc, model, opt = _prepared("bf16", True)
    _train(acc, model, opt, n=1)
    x, y = _data(1)[0]
    loss = nn.functional.mse_loss(model(x).float(), y)
    acc.backward(loss, retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_eval_forward_uses_the_copies_and_matches():
    acc, model, opt = _prepared("bf16", True)
    ref_acc, ref, ref_opt = _prepared("bf16", False)
    _train(acc, model, opt, n=2)
    _train(ref_acc, ref, ref_opt, n=2)
    x = _data(1)[0][0]
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


def test_copies_and_pickles_are_plain_linears_and_unwrap_restores():
    acc, model, opt = _prepared("bf16", True)
    _train(acc, model, opt, n=1)
    x = _data(1)[0][0]
    twin = copy.deepcopy(model)  # e.g. an EMA copy: same policy, autocast's own casts
    assert type(twin[0]) is nn.Linear and twin._mixprec_ctx.pre_forward is None
    assert torch.equal(twin(x), model(x))
    assert twin[0].weight is not model[0].weight
    plain = pickle.loads(pickle.dumps(model[0]))
    assert type(plain) is nn.Linear and torch.equal(plain.weight, model[0].weight)
    acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))
    assert not hasattr(model[0], "_mixprec_casts")


def test_use_cast_backward_is_autocasts_cast_backward():
    w = torch.randn(4, 4, requires_grad=True)
    g = torch.randn(4, 4).to(torch.bfloat16)
    out = _UseCast.apply(w, w.detach().to(torch.bfloat16))
    (gw,) = torch.autograd.grad(out, w, g)
    (ref,) = torch.autograd.grad(w.to(torch.bfloat16), w, g)
    assert gw.dtype == torch.float32 and torch.equal(gw, ref)


class _Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(64, 128, 5, padding=2)  # 40960 weights: cached
        self.c2 = nn.Conv2d(16, 64, 3, padding=1)  # 9216 weights: autocast's cast
        self.c3 = nn.Conv2d(64, 64, 3, padding=1, padding_mode="reflect")  # 36864: cached
        self.head = nn.Linear(192, 8)

    def forward(self, x1, x2):
        a = self.c1(x1).mean(-1)
        b = self.c3(torch.relu(self.c2(x2))).mean((-1, -2))
        return self.head(torch.cat([a, b], -1))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_convolutions_bitwise_same_as_autocast_casts(precision):
    runs = {}
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 64, 12, generator=g), torch.randn(4, 16, 6, 6, generator=g)) for _ in range(4)]
    for cache in (True, False):
        torch.manual_seed(0)
        model = _Convs()
        acc = Accelerator(mixed_precision=precision, cpu=True, log_policy=False, cache_weight_casts=cache)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x1, x2 in data:
            loss = model(x1, x2).float().square().mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(repr(loss.item()))
        runs[cache] = (losses, _weights(model), acc.engine.precision.casts, model)
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    casts, model = runs[True][2], runs[True][3]
    assert {id(model.c1.weight), id(model.c3.weight)} == set(casts.entries)
    assert type(model.c2) is nn.Conv2d and repr(model.c1).startswith("Conv1d(")
    assert type(pickle.loads(pickle.dumps(model.c3))) is nn.Conv2d


def test_free_memory_drops_the_copies_and_a_new_prepare_uses_new_ones():
    acc, model, opt = _prepared("bf16", True)
    _train(acc, model, opt, n=1)
    old = acc.engine.precision.casts
    x = _data(1)[0][0]
    model, opt = acc.free_memory(model, opt)
    assert old.entries == {} and old.targets == {}  # the copies are not kept alive
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(acc, model, opt, n=2)
    assert acc.engine.precision.casts is not old and len(acc.engine.precision.casts.entries) == 2
    assert _uses_copies(model, x) == 2
    # The same module prepared again by another Accelerator answers to the new one.
    other = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    ref, ref_opt = other.prepare(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    again = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    ref, ref_opt = again.prepare(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    assert ref[0]._mixprec_casts is again.engine.precision.casts


def test_resume_from_checkpoint_matches_autocast_casts(tmp_path):
    # load_state writes the weights in place: the fresh run's copies (cast from its initial
    # weights at prepare) go stale, the forward casts, and the first step re-casts them.
    runs = {}
    for cache in (True, False):
        acc, model, opt = _prepared("bf16", cache)
        _train(acc, model, opt, n=2)
        acc.save_state(str(tmp_path / f"ckpt{cache}"))
        acc2, model2, opt2 = _prepared("bf16", cache)
        acc2.load_state(str(tmp_path / f"ckpt{cache}"))
        if cache:
            assert _uses_copies(model2, _data(1)[0][0]) == 0  # stale: autocast's cast
        log = _train(acc2, model2, opt2, n=3)
        if cache:
            assert _uses_copies(model2, _data(1)[0][0]) == 2
        runs[cache] = (log, _weights(model2))
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
