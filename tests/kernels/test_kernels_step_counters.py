"""fused_adam_'s device step counters and its argument checks (issue #23, G1).

On CUDA, fused_adam_ advances its fp32 `steps` counters on the device by 1, or by 0
when found_inf is set, with _C._advance_step_counters_; that function runs on any device,
so its found_inf shapes (the scalers' [1] and a 0-dim flag) are tested here on CPU.
A call with a bad argument must raise before anything is written, on every device.
"""

import pytest
import torch

from mixprec import _C

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
            maximize=False)


def _counters(*values):
    # One [1] and one 0-dim counter when two values: both layouts torch's state uses.
    return [torch.tensor([v]) if i % 2 == 0 else torch.tensor(v) for i, v in enumerate(values)]


@pytest.mark.parametrize("flag_shape", [(1,), ()])
@pytest.mark.parametrize("flag, expect", [(0.0, [4.0, 8.0]), (1.0, [3.0, 7.0]),
                                          (float("nan"), [3.0, 7.0]), (2.0, [3.0, 7.0])])
def test_counters_advance_unless_found_inf(flag_shape, flag, expect):
    steps = _counters(3.0, 7.0)
    found_inf = torch.full(flag_shape, flag)
    _C._advance_step_counters_(steps, found_inf)
    assert [s.item() for s in steps] == expect
    assert [s.shape for s in steps] == [torch.Size([1]), torch.Size([])]
    torch.testing.assert_close(found_inf, torch.full(flag_shape, flag), equal_nan=True,
                               rtol=0, atol=0)  # read, never written


def test_counters_advance_without_found_inf():
    steps = _counters(0.0, 41.0)
    _C._advance_step_counters_(steps)
    assert [s.item() for s in steps] == [1.0, 42.0]
    _C._advance_step_counters_([])  # nothing to do


def test_counter_errors_name_the_bad_value():
    steps = _counters(1.0, 2.0)
    with pytest.raises(ValueError, match="found_inf must have exactly one element, got 2"):
        _C._advance_step_counters_(steps, torch.zeros(2))
    with pytest.raises(TypeError, match="steps\\[i\\] must be float32, got Double"):
        _C._advance_step_counters_(steps + [torch.zeros(1, dtype=torch.float64)])
    assert [s.item() for s in steps] == [1.0, 2.0]


def _adam_state(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5,), (4, 3), (17,)][:n]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    m = [torch.randn(s, generator=g).abs() for s in shapes]
    v = [torch.randn(s, generator=g).abs() for s in shapes]
    lowp = [p.bfloat16() for p in params]
    steps = _counters(*[float(i + 2) for i in range(n)])
    return params, grads, m, v, lowp, steps


def _snapshot(*lists):
    return [[t.clone() for t in lst] for lst in lists]


def _bad_calls():
    """(name, mutate(args) -> kwargs overrides, exception) for one bad argument each."""
    return [
        ("one counter short", lambda a: dict(steps=a["steps"][:-1]), ValueError),
        ("fp64 counter", lambda a: dict(steps=a["steps"][:-1] + [torch.ones(1).double()]),
         TypeError),
        ("two-element counter", lambda a: dict(steps=a["steps"][:-1] + [torch.ones(2)]),
         ValueError),
        ("two-element found_inf", lambda a: dict(found_inf=torch.zeros(2)), ValueError),
        ("fp64 inv_scale", lambda a: dict(inv_scale=torch.ones(1).double()), TypeError),
        ("lowp list short", lambda a: dict(lowp_params=a["lowp_params"][:-1]), ValueError),
        ("fp16 moment", lambda a: dict(exp_avg_sqs=a["exp_avg_sqs"][:-1]
                                       + [a["exp_avg_sqs"][-1].half()]), TypeError),
        ("grad size", lambda a: dict(grads=a["grads"][:-1] + [torch.zeros(3)]), ValueError),
        ("beta2 = 1", lambda a: dict(beta2=1.0), ValueError),
        ("negative lr", lambda a: dict(lr=-1.0), ValueError),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
@pytest.mark.parametrize("flag_shape", [(1,), ()])
def test_failed_adam_step_changes_nothing(case, flag_shape):
    _, mutate, exc = case
    params, grads, m, v, lowp, steps = _adam_state()
    args = dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, lowp_params=lowp,
                steps=steps, inv_scale=torch.full(flag_shape, 0.5),
                found_inf=torch.zeros(flag_shape), **ADAM)
    args.update(mutate(args))
    before = _snapshot(params, m, v, lowp, steps)
    with pytest.raises(exc, match="mixprec.fused_adam_: "):
        _C.fused_adam_(args.pop("params"), args.pop("grads"), args.pop("exp_avgs"),
                       args.pop("exp_avg_sqs"), args.pop("lowp_params"), **args)
    after = _snapshot(params, m, v, lowp, steps)
    for b, a in zip(before, after):
        assert all(torch.equal(x, y) for x, y in zip(b, a))


@pytest.mark.parametrize("flag_shape", [(1,), ()])
def test_adam_with_counters_takes_both_found_inf_shapes(flag_shape):
    params, grads, m, v, lowp, steps = _adam_state()
    p0 = [p.clone() for p in params]
    _C.fused_adam_(params, grads, m, v, lowp, steps=steps, found_inf=torch.ones(flag_shape),
                   **ADAM)
    assert [s.item() for s in steps] == [2.0, 3.0, 4.0]
    assert all(torch.equal(a, b) for a, b in zip(p0, params))
    _C.fused_adam_(params, grads, m, v, lowp, steps=steps, found_inf=torch.zeros(flag_shape),
                   **ADAM)
    assert [s.item() for s in steps] == [3.0, 4.0, 5.0]
    assert not any(torch.equal(a, b) for a, b in zip(p0, params))
