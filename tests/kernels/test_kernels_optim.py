"""Fused Adam/AdamW/SGD against torch.optim (single-tensor CPU path).

SGD is bitwise equal. Adam/AdamW are compared within a small ulp budget: the
op order and every fp32 rounding follow torch (see [Note: Adam op order]),
but torch's vectorised CPU sqrt is not correctly rounded (up to 1 ulp off on
~20% of lanes, AVX512 build) while ours is IEEE sqrt; a 1-ulp change of
sqrt(v) moves the update by ~1 ulp of the update, never of the param, so
after 50 steps params agree to ~1e-6 relative (plus tiny absolute slack near 0).
"""

import copy

import pytest
import torch

from mixprec import kernels as K

SHAPES = [(1,), (7,), (33, 17), (65537,), (129,)] + [(5,)] * 12


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _groups(params, lrs):
    k = len(params) // len(lrs)
    return [{"params": params[i * k:(i + 1) * k] if i < len(lrs) - 1 else params[i * k:],
             "lr": lr} for i, lr in enumerate(lrs)]


def _set_grads(a, b, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p, q in zip(a, b):
        grad = torch.randn(p.shape, generator=g)
        p.grad, q.grad = grad.clone(), grad.clone()


def _run_pair(make_opt, steps=50, lrs=(1e-2, 3e-3, 1e-3), lowp=False):
    ref_params, our_params = _model(), _model()
    ref = make_opt(_groups(ref_params, lrs))
    ours = make_opt(_groups(our_params, lrs))
    lowp_of = {id(p): torch.empty_like(p, dtype=torch.bfloat16) for p in our_params} if lowp else None
    for s in range(steps):
        _set_grads(ref_params, our_params, s)
        ref.step()
        assert K.fused_optimizer_step(ours, lowp_of=lowp_of)
        if lowp:
            for p in our_params:
                assert torch.equal(lowp_of[id(p)], p.detach().to(torch.bfloat16))
    return ref, ours, ref_params, our_params


ADAM_CASES = [
    (torch.optim.Adam, dict(weight_decay=0.0)),
    (torch.optim.Adam, dict(weight_decay=0.1)),
    (torch.optim.Adam, dict(weight_decay=0.1, maximize=True, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.AdamW, dict(weight_decay=0.0)),
    (torch.optim.AdamW, dict(weight_decay=0.05)),
    (torch.optim.AdamW, dict(weight_decay=0.05, maximize=True, betas=(0.3, 0.99))),  # lerp w >= .5
]


@pytest.mark.parametrize("cls,kw", ADAM_CASES)
def test_adam_matches_torch(cls, kw):
    ref, ours, rp, op = _run_pair(lambda g: cls(g, foreach=False, **kw), lowp=True)
    for p, q in zip(rp, op):
        torch.testing.assert_close(q, p, rtol=2e-6, atol=1e-7)
        st_r, st_o = ref.state[p], ours.state[q]
        assert st_o["step"].dtype == torch.float32 and st_o["step"].item() == 50
        torch.testing.assert_close(st_o["exp_avg"], st_r["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st_o["exp_avg_sq"], st_r["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_adam_one_step_exp_avgs_bitwise():
    # The moments do not go through sqrt: they match torch bit for bit.
    ref, ours, rp, op = _run_pair(lambda g: torch.optim.AdamW(g, weight_decay=0.1, foreach=False),
                                  steps=1)
    for p, q in zip(rp, op):
        assert torch.equal(ours.state[q]["exp_avg"], ref.state[p]["exp_avg"])
        assert torch.equal(ours.state[q]["exp_avg_sq"], ref.state[p]["exp_avg_sq"])


SGD_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.5, maximize=True),
    dict(weight_decay=1e-2, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_bitwise_equal_to_torch(kw):
    ref, ours, rp, op = _run_pair(lambda g: torch.optim.SGD(g, foreach=False, **kw), lowp=True)
    for p, q in zip(rp, op):
        assert torch.equal(p, q)
        if kw.get("momentum"):
            assert torch.equal(ref.state[p]["momentum_buffer"], ours.state[q]["momentum_buffer"])
        else:
            assert "momentum_buffer" not in ours.state[q] or ours.state[q]["momentum_buffer"] is None


@pytest.mark.parametrize("make", [lambda g: torch.optim.AdamW(g, weight_decay=0.1),
                                  lambda g: torch.optim.SGD(g, momentum=0.9)])
def test_found_inf_leaves_everything_untouched(make):
    params = _model()
    opt = make([{"params": params, "lr": 1e-2}])
    _set_grads(params, _model(), 0)
    assert K.fused_optimizer_step(opt)
    before_p = [p.detach().clone() for p in params]
    before_s = copy.deepcopy(opt.state_dict())
    _set_grads(params, _model(), 1)
    assert K.fused_optimizer_step(opt, found_inf=torch.ones(1), inv_scale=torch.tensor([0.5]))
    assert all(torch.equal(a, b) for a, b in zip(before_p, params))
    after_s = opt.state_dict()["state"]
    for i, st in before_s["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after_s[i][k]), k


def test_kernel_found_inf_skips_and_inv_scale_applies():
    p, g = torch.randn(100), torch.randn(100)
    m, v = torch.zeros(100), torch.zeros(100)
    p0 = p.clone()
    K.fused_adam_([p], [g * 4], [m], [v], [], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.0, step=1.0, decoupled=True, maximize=False,
                  inv_scale=torch.tensor([0.25]), found_inf=torch.ones(1))
    assert torch.equal(p, p0) and not m.any() and not v.any()
    K.fused_adam_([p], [(g * 4).bfloat16()], [m], [v], [], lr=1e-2, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.0, step=1.0, decoupled=True, maximize=False,
                  inv_scale=torch.tensor([0.25]), found_inf=torch.zeros(1))
    torch.testing.assert_close(m, 0.1 * (g * 4).bfloat16().float() * 0.25)


def test_state_dict_round_trip_with_plain_torch():
    params_a, params_b = _model(), _model()
    ours = torch.optim.AdamW(params_a, lr=1e-2, weight_decay=0.1)
    for s in range(3):
        _set_grads(params_a, params_b, s)
        assert K.fused_optimizer_step(ours)
    plain = torch.optim.AdamW(params_b, lr=1e-2, weight_decay=0.1, foreach=False)
    with torch.no_grad():
        for a, b in zip(params_a, params_b):
            b.copy_(a)
    plain.load_state_dict(copy.deepcopy(ours.state_dict()))
    _set_grads(params_a, params_b, 3)
    plain.step()
    ours2 = torch.optim.AdamW(_model(), lr=1e-2, weight_decay=0.1)
    ours2.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert all(st["step"].item() == 4 for st in ours2.state_dict()["state"].values())
    assert K.fused_optimizer_step(ours)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_unsupported_optimizers_fall_back():
    ps = _model()
    assert not K.supports_fused(torch.optim.Adam(ps, amsgrad=True))
    assert not K.fused_optimizer_step(torch.optim.RMSprop(ps))
    assert not K.supports_fused(torch.optim.Adam([torch.nn.Parameter(torch.randn(3).double())]))

    class MyAdam(torch.optim.Adam):
        pass

    assert not K.supports_fused(MyAdam(ps))
    assert K.supports_fused(torch.optim.Adam(ps, foreach=True))


def test_tensor_lr_and_late_param_group():
    pa, pb = _model(), _model()
    ref = torch.optim.Adam(pa[:5], lr=torch.tensor(1e-2), foreach=False)
    ours = torch.optim.Adam(pb[:5], lr=torch.tensor(1e-2))
    for s in range(4):
        if s == 2:  # params joining later carry a smaller step: separate buckets
            ref.add_param_group({"params": pa[5:], "lr": 1e-3})
            ours.add_param_group({"params": pb[5:], "lr": 1e-3})
        _set_grads(pa, pb, s)
        ref.step()
        assert K.fused_optimizer_step(ours)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)


def test_optimizer_kernel_errors():
    p, g = [torch.randn(4)], [torch.randn(4)]
    with pytest.raises(ValueError, match=r"exp_avgs has 0 tensors but params has 1"):
        K.fused_adam_(p, g, [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, step=1.0, decoupled=True, maximize=False,
                      inv_scale=None, found_inf=None)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype BFloat16 but must be float32"):
        K.fused_sgd_([p[0].bfloat16()], g, [], [], lr=0.1, momentum=0.0, dampening=0.0,
                     nesterov=False, weight_decay=0.0, maximize=False, first_step=True,
                     inv_scale=None, found_inf=None)
    with pytest.raises(TypeError, match=r"lowp_params\[0\] has dtype Float but must be bfloat16"):
        K.fused_sgd_(p, g, [], [torch.randn(4)], lr=0.1, momentum=0.0, dampening=0.0,
                     nesterov=False, weight_decay=0.0, maximize=False, first_step=True,
                     inv_scale=None, found_inf=None)
    with pytest.raises(ValueError, match=r"grads\[0\] is not contiguous"):
        K.fused_sgd_([torch.randn(2, 2)], [torch.randn(2, 2).t()], [], [], lr=0.1,
                     momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
                     maximize=False, first_step=True, inv_scale=None, found_inf=None)
    with pytest.raises(ValueError, match="beta2 must be in"):
        K.fused_adam_(p, g, p, p, [], lr=1e-3, beta1=0.9, beta2=1.5, eps=1e-8,
                      weight_decay=0.0, step=1.0, decoupled=True, maximize=False,
                      inv_scale=None, found_inf=None)
