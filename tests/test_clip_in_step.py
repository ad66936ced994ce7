"""clip_grad_norm_ with the clip applied inside the fused update ([Note: clip inside the
update] in src/mixprec/engines/base.py): the same weights, norms and skips as clipping in
place (``clip_in_step=False``), bitwise, and close to torch's own loop; the gradients a
caller reads through mixprec are clipped; what cannot take the fused path clips in place."""

import copy
import math

import pytest
import torch
from torch import nn

from mixprec import Accelerator

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def _data(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def _run(precision, clip_in_step, *, optimizer=torch.optim.AdamW, poison_at=3, max_norm=0.1,
         between=None):
    model = _model()
    acc = Accelerator(mixed_precision=precision, cpu=True, log_policy=False, clip_in_step=clip_in_step)
    model, opt = acc.prepare(model, optimizer(model.parameters(), lr=1e-2))
    out = []
    for i, (x, y) in enumerate(_data()):
        loss = nn.functional.mse_loss(model(x).float(), y)
        if i == poison_at:
            loss = loss * float("inf")
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), max_norm)
        if between is not None:
            between(acc, model, opt)
        r = opt.step()
        opt.zero_grad()
        out.append((r.stepped, r.reason, repr(float(norm))))
    return out, [p.detach().clone() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_same_weights_as_clipping_in_place(precision):
    fused, w_fused, sd_fused = _run(precision, True)
    inplace, w_inplace, sd_inplace = _run(precision, False)
    assert fused == inplace  # norms (bitwise, as repr), outcomes, the skipped step 4
    assert fused[3][:2] == (False, "overflow" if precision == "fp16" else "nonfinite")
    assert all(torch.equal(a, b) for a, b in zip(w_fused, w_inplace))
    for k, st in sd_fused["state"].items():
        for name, v in st.items():
            assert torch.equal(v, sd_inplace["state"][k][name]), (k, name)


def test_close_to_torch_loop_fp32():
    """fp32: torch's loop, but the norm's summation order and the fused update's arithmetic:
    as accurate as fp32 runs of the same training against float64 ([Note: calibrated
    bounds] in tests/_numerics.py); torch's own AdamW(fused=True) loop passes the same judge."""
    import functools

    from _numerics import assert_verdict, judge_runs

    eps = 1e-6
    _, ours, _ = _run("no", True, poison_at=None, optimizer=functools.partial(torch.optim.AdamW, eps=eps))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=eps, fused=True)
    for x, y in _data():
        nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    judge = judge_runs(_model, _data(), loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), lr=1e-2, eps=eps,
                       clip=0.1)[0]
    names = [n for n, _ in _model().named_parameters()]
    assert_verdict(judge.verdict(dict(zip(names, ours))), "mixprec")
    assert_verdict(judge.verdict(dict(zip(names, (p.detach() for p in ref.parameters())))), "torch fused")


def test_fp16_close_to_torch_gradscaler_loop():
    _, ours, _ = _run("fp16", True, poison_at=None)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for x, y in _data():
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    for a, b in zip(ours, ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gradients_untouched_until_step_then_clipped_for_readers(precision):
    def check(acc, model, opt):
        raw = [p.grad.clone() for p in model.parameters()]
        st = opt._state
        assert st.grad_scale is not None  # the clip is owed by the update
        acc.unscale_gradients()  # a reader through mixprec: applied in place now
        assert st.grad_scale is None
        for g, r in zip((p.grad for p in model.parameters()), raw):
            assert not torch.equal(g, r)  # clipped (and, fp16, unscaled)

    deferred, w_deferred, _ = _run(precision, True, poison_at=None, between=check)
    inplace, w_inplace, _ = _run(precision, False, poison_at=None)
    assert deferred == inplace
    assert all(torch.equal(a, b) for a, b in zip(w_deferred, w_inplace))


def test_clip_value_and_second_clip_after_a_deferred_clip():
    def more(acc, model, opt):
        acc.clip_grad_value_(model.parameters(), 0.004)
        second = acc.clip_grad_norm_(model.parameters(), 0.05)
        assert math.isfinite(float(second))

    a, wa, _ = _run("bf16", True, poison_at=None, between=more)
    b, wb, _ = _run("bf16", False, poison_at=None, between=more)
    assert a == b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_not_deferred_for_an_optimizer_without_fused_kernels():
    def check(acc, model, opt):
        assert opt._state.grad_scale is None  # RMSprop: clipped in place, as torch

    a, wa, _ = _run("bf16", True, optimizer=torch.optim.RMSprop, poison_at=None, between=check)
    b, wb, _ = _run("bf16", False, optimizer=torch.optim.RMSprop, poison_at=None)
    assert a == b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def test_not_deferred_for_a_subset_of_the_parameters():
    model = _model()
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _data(1)[0]
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    first = list(model.parameters())[:2]
    before = [p.grad.clone() for p in first]
    norm = acc.clip_grad_norm_(first, 1e-3)
    assert opt._state.grad_scale is None
    coef = 1e-3 / (float(norm) + 1e-6)
    for p, g in zip(first, before):
        torch.testing.assert_close(p.grad, g * coef)  # clipped in place, now


def test_zero_grad_after_a_clip_forgets_it():
    # clip, then zero_grad without a step: the next iteration is clipped afresh.
    def run(clip_in_step):
        model = _model()
        acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, clip_in_step=clip_in_step)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for i, (x, y) in enumerate(_data(4)):
            acc.backward(nn.functional.mse_loss(model(x).float(), y))
            acc.clip_grad_norm_(model.parameters(), 0.1)
            if i == 1:
                opt.zero_grad()  # dropped iteration
                continue
            assert opt.step().stepped
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ref = copy.deepcopy(run(False))
    assert all(torch.equal(a, b) for a, b in zip(run(True), ref))
