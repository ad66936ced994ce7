"""The step plan ([Note: the step plan] in src/mixprec/kernels.py and
csrc/engines/step/optimizer_plan.h) and the clip that shares it ([Note: the clip shares the
step plan] in src/mixprec/engines/clip_sources.py).

- Python's work per step does not grow with the number of tensors: the count of Python
  function calls of a steady-state step (clip + step + zero_grad) is the same for 24 and for
  384 tensors.
- The plan follows what changes under it: a param group added, an optimizer state loaded,
  a param that gets its first gradient late, a gradient the kernels cannot take, a
  parameter registered after prepare. Each is compared with plain torch on the same loop
  (same arithmetic as the fused kernel's parity tests: exact where mixprec's update equals
  torch's, else within a few fp32 ulps).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from mixprec import Accelerator, kernels


def _blocks(n_blocks: int, d: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d))
                           for _ in range(n_blocks)])


def _python_calls(fn) -> int:
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _prepared(n_blocks: int, **kw):
    acc = Accelerator(cpu=True, log_policy=False, **kw)
    model = _blocks(n_blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc, *acc.prepare(model, opt)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_python_calls_per_step_do_not_grow_with_the_tensor_count(mixed_precision):
    counts = {}
    for n_blocks in (4, 64):  # 24 and 384 tensors
        acc, model, opt = _prepared(n_blocks, mixed_precision=mixed_precision)
        x = torch.randn(3, 8)

        def forward_backward():
            with acc.autocast():
                loss = model(x).float().pow(2).mean()
            acc.backward(loss)

        def optimizer_side():
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        for _ in range(3):  # state creation, plan building
            forward_backward()
            optimizer_side()
        forward_backward()
        counts[n_blocks] = _python_calls(optimizer_side)
        acc.end_training()
    assert counts[4] == counts[64], counts


def _torch_loop(model, opt, xs, clip=1.0, between=None, variant="f32"):
    """Plain torch steps; ``variant`` ``f64`` (the model already converted: inputs too) or
    ``blocks`` (every Linear summed as a 2-way split) for the judge of ``_judged``."""
    import contextlib

    from _numerics import block_sums

    for i, x in enumerate(xs):
        with block_sums()() if variant == "blocks" else contextlib.nullcontext():
            loss = model(x.double() if variant == "f64" else x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(i, model, opt)


def _judged(replay, got: nn.Module, context=None):
    """mixprec's result against torch's loop, as fp32 runs are against float64: mixprec's
    fused AdamW rounds an element's update an ulp or two away from torch's (tests/kernels),
    and Adam can amplify that where a gradient is near zero, by an amount that depends on the
    CPU ([Note: calibrated bounds] in tests/_numerics.py); a plan that stepped stale state or
    skipped a param is a change of the computation, far outside it. ``replay(variant)``
    runs torch's loop as ``f64``, ``f32`` or ``blocks`` and returns the model."""
    from _numerics import Judge, assert_verdict

    def state(m):
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    judge = Judge(state(replay("f64")), [state(replay(v)) for v in ("f32", "blocks")])
    assert_verdict(judge.verdict(state(got)), context)


def _as(variant: str, built):
    """``built`` (a model, or (model, optimizer) before any step) in float64 for ``f64``."""
    model = built[0] if isinstance(built, tuple) else built
    if variant == "f64":
        model.double()  # in place: an optimizer built on its parameters still holds them
    return built


def test_an_added_param_group_and_a_late_first_gradient_are_stepped_as_torch_does():
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def between(i, model, opt):
        if i == 2:  # unfreeze the last block and give it its own group
            for p in model[-1].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[-1].parameters()), "lr": 5e-3})

    def build():
        model = _blocks(3)
        for p in model[-1].parameters():
            p.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def replay(variant):
        ref_model, ref_opt = _as(variant, build())
        _torch_loop(ref_model, ref_opt, xs, between=between, variant=variant)
        return ref_model

    acc = Accelerator(cpu=True, log_policy=False)
    model, opt = acc.prepare(*build())

    def between_prepared(i, m, o):
        between(i, m, o)

    for i, x in enumerate(xs):
        acc.backward(model(x).pow(2).mean())
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        between_prepared(i, model, opt)
    _judged(replay, model)
    assert kernels.step_plan(opt.optimizer) is not None
    assert kernels.step_plan(opt.optimizer).num_params == sum(1 for _ in model.parameters())


def test_a_loaded_optimizer_state_is_what_the_next_step_updates():
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    def replay(variant):
        ref_model = _as(variant, _blocks(2))
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        _torch_loop(ref_model, ref_opt, xs, variant=variant)
        return ref_model

    ref_model = _blocks(2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _torch_loop(ref_model, ref_opt, xs[:3])
    saved_model = {k: v.clone() for k, v in ref_model.state_dict().items()}
    saved_opt = copy.deepcopy(ref_opt.state_dict())  # state_dict() holds the live tensors

    acc = Accelerator(cpu=True, log_policy=False)
    model = _blocks(2, seed=1)  # other weights and other state: all of it must be replaced
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for x in xs[:2]:  # the plan exists and holds this state
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert kernels.step_plan(opt.optimizer) is not None
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    for x in xs[3:]:
        acc.backward(model(x).pow(2).mean())
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    _judged(replay, model)  # the loaded state is the one the steps went on from


def test_a_state_tensor_replaced_in_place_is_seen_after_forget_plan():
    acc, model, opt = _prepared(2)
    x = torch.randn(3, 8)
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    p = next(model.parameters())
    fresh = torch.zeros_like(p)
    opt.optimizer.state[p]["exp_avg"] = fresh
    kernels.forget_plan(opt.optimizer)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    assert fresh.abs().sum() > 0  # the new tensor is the one updated


def test_a_param_the_kernels_cannot_take_any_more_falls_back_to_torchs_step():
    """``p.data`` swapped for a transposed (non-contiguous) layout after the plan was built:
    the plan declines (a kernel reading it as contiguous would update the transpose), the
    optimizer's own step runs, and the result is torch's."""
    acc, model, opt = _prepared(1)
    x = torch.randn(3, 8)
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert kernels.step_plan(opt.optimizer) is not None
    ref = _blocks(1)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.optimizer.state_dict()))
    for m in (model, ref):
        w = m[0][1].weight
        w.data = w.data.t().contiguous().t()
        assert not w.is_contiguous()
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # The same weights, gradients, state and torch step on both sides: the same bits.
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_sgd_momentum_turned_on_later_creates_its_buffers():
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def between(i, model, opt):
        if i == 2:
            opt.param_groups[0]["momentum"] = 0.9

    def replay(variant):
        ref_model = _as(variant, _blocks(2))
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-2, momentum=0.0)
        _torch_loop(ref_model, ref_opt, xs, between=between, variant=variant)
        return ref_model

    acc = Accelerator(cpu=True, log_policy=False)
    model = _blocks(2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.0))
    for i, x in enumerate(xs):
        acc.backward(model(x).pow(2).mean())
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        between(i, model, opt)
    _judged(replay, model)


def test_the_clip_does_not_walk_the_module_tree_and_sees_a_parameter_added_later(monkeypatch):
    acc, model, opt = _prepared(3)
    x = torch.randn(3, 8)
    acc.backward(model(x).pow(2).mean())
    acc.clip_grad_norm_(model.parameters(), 1.0)  # the first clip walks once
    opt.step()
    opt.zero_grad()
    walks = []
    original = nn.Module.named_modules

    def counting(self, *a, **k):
        walks.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    acc.backward(model(x).pow(2).mean())
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in list(model.parameters())]))
    walks.clear()
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    assert walks == []
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    opt.step()
    opt.zero_grad()
    # A parameter registered after prepare: the cached tuple is dropped, the clip sees it.
    model[0][0].extra = nn.Parameter(torch.full((2,), 100.0))
    acc.backward(model(x).pow(2).mean() + model[0][0].extra.sum())
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in list(model.parameters())
                                                     if p.grad is not None]))
    walks.clear()
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    assert walks, "the clip must walk again after a parameter was registered"
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


def test_zero_grad_drops_every_gradient_and_keeps_an_optimizers_own_zero_grad():
    """zero_grad(set_to_none=True) of a planned optimizer sets every param's .grad to None
    from the plan's lists (kernels.drop_grads), a param added in a second group included;
    an optimizer class with its own zero_grad, or set_to_none=False, runs torch's code."""

    class Counting(torch.optim.AdamW):
        calls = 0

        def zero_grad(self, set_to_none: bool = True):
            type(self).calls += 1
            super().zero_grad(set_to_none)

    for cls in (torch.optim.AdamW, Counting):
        acc = Accelerator(cpu=True, log_policy=False)
        model = _blocks(3)
        extra = nn.Parameter(torch.randn(4))
        opt = cls(model.parameters(), lr=1e-3)
        opt.add_param_group({"params": [extra]})
        model, opt = acc.prepare(model, opt)
        for _ in range(2):
            loss = model(torch.randn(2, 8)).square().mean() + extra.square().sum()
            acc.backward(loss)
            assert opt.step().stepped
            params = list(model.parameters()) + [extra]
            assert all(p.grad is not None for p in params)
            opt.zero_grad()
            assert all(p.grad is None for p in params)
        assert Counting.calls == (2 if cls is Counting else 0)
        acc.backward(model(torch.randn(2, 8)).square().mean())
        opt.zero_grad(set_to_none=False)
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        acc.end_training()


# Review findings (each was a silent wrong result or a crash of the fused plan only; the
# unfused path matched torch): containers edited in place at the same size, a param outside
# the optimizer unfrozen, a param in two optimizers, a hand-set strided gradient, a model
# switched to channels_last. [Note: the plan's sources] in csrc/bindings/step.cpp.
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3))


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _reset_state(m, o):
    o.state[m[0].weight] = {}


def _reset_momentum(m, o):
    o.state[m[0].weight] = {"momentum_buffer": None}


def _replace_param(m, o):
    new = nn.Parameter(torch.full_like(m[0].weight, 0.05))
    m[0].weight = new
    o.param_groups[0]["params"][0] = new


def _two_groups(m):
    return torch.optim.AdamW([{"params": list(m[0].parameters()), "lr": 1e-2},
                              {"params": list(m[2].parameters()), "lr": 3e-3}], weight_decay=0.1)


def _swap_group_lists(m, o):
    a, b = o.param_groups[0]["params"], o.param_groups[1]["params"]
    a[:], b[:] = list(b), list(a)


def _frozen_first(m):
    m[0].weight.requires_grad_(False)
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _unfreeze(m, o):
    m[0].weight.requires_grad_(True)


def _strided_data(m, o):
    with torch.no_grad():
        m[0].weight.data = m[0].weight.detach().t().contiguous().t()


def _channels_last(m, o):
    m.to(memory_format=torch.channels_last)


CASES = {
    "state_entry_replaced": (_mlp, _adamw, _reset_state, 1.0),
    "sgd_momentum_entry_replaced": (_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
                                    _reset_momentum, 1.0),
    "param_list_item_replaced": (_mlp, _adamw, _replace_param, 1.0),
    "group_lists_swapped_in_place": (_mlp, _two_groups, _swap_group_lists, 1.0),
    "outside_param_unfrozen": (_mlp, _frozen_first, _unfreeze, 0.05),
    "strided_param_data": (_mlp, _adamw, _strided_data, 1.0),
    "channels_last": (_conv, _adamw, _channels_last, 1.0),
}


def _run(kind, build, make_opt, action, max_norm, steps=4, at=2, variant="f32"):
    import contextlib

    from _numerics import block_sums

    model = _as(variant, build())
    opt = make_opt(model)
    acc = None
    if kind == "mixprec":
        acc = Accelerator(cpu=True, log_policy=False)
        model, opt = acc.prepare(model, opt)
    inner = getattr(opt, "optimizer", opt)
    norms = []
    for i in range(steps):
        if i == at:
            action(model, inner)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(4, 3, 8, 8, generator=g) if build is _conv else torch.randn(64, 16, generator=g)
        with block_sums()() if variant == "blocks" else contextlib.nullcontext():
            loss = model(x.double() if variant == "f64" else x).pow(2).mean()
        if acc is not None:
            acc.backward(loss)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), max_norm)))
        else:
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    if acc is not None:
        acc.end_training()
    return norms, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_sees_what_torch_sees(case):
    build, make_opt, action, max_norm = CASES[case]
    norms, got = _run("mixprec", build, make_opt, action, max_norm)
    _judged_with_norms(lambda variant: _run("torch", build, make_opt, action, max_norm, variant=variant), norms, got,
                       case)


def _judged_with_norms(replay, norms, got, context=None):
    """``_judged`` of the weights, and the clip norms of every step against the float64
    run's, as fp32 runs' are (``scalar_excess``). ``replay(variant)`` -> (norms, model)."""
    from _numerics import scalar_excess

    runs = {v: replay(v) for v in ("f64", "f32", "blocks")}
    assert scalar_excess(norms, runs["f64"][0], [runs["f32"][0], runs["blocks"][0]]) <= 1.0, (context, norms)
    _judged(lambda v: runs[v][1], got, context)


def test_a_param_in_two_optimizers_is_counted_once_by_the_clip():
    import contextlib

    from _numerics import block_sums

    def run(kind, variant="f32"):
        model = _as(variant, _mlp())
        o1 = torch.optim.AdamW(list(model[0].parameters()) + [model[2].bias], lr=1e-2)
        o2 = torch.optim.SGD(list(model[2].parameters()), lr=1e-2)
        acc = None
        if kind == "mixprec":
            acc = Accelerator(cpu=True, log_policy=False)
            model, o1, o2 = acc.prepare(model, o1, o2)
        norms = []
        for i in range(3):
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(i))
            with block_sums()() if variant == "blocks" else contextlib.nullcontext():
                loss = model(x.double() if variant == "f64" else x).pow(2).mean()
            if acc is not None:
                acc.backward(loss)
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            else:
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
        if acc is not None:
            acc.end_training()
        return norms, model

    norms, got = run("mixprec")
    _judged_with_norms(lambda variant: run("torch", variant), norms, got)


def test_a_hand_set_strided_gradient_is_clipped_as_torch_does():
    import contextlib

    from _numerics import block_sums

    def run(kind, variant="f32"):
        model = _as(variant, _mlp())
        opt = _adamw(model)
        acc = None
        if kind == "mixprec":
            acc = Accelerator(cpu=True, log_policy=False)
            model, opt = acc.prepare(model, opt)
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            with block_sums()() if variant == "blocks" else contextlib.nullcontext():
                loss = model(x.double() if variant == "f64" else x).pow(2).mean()
            (acc.backward(loss) if acc is not None else loss.backward())
            w = model[0].weight
            w.grad = w.grad.t().contiguous().t()  # same values, column-major
            norm = (acc.clip_grad_norm_(model.parameters(), 0.1) if acc is not None
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
            opt.step()
            opt.zero_grad()
        if acc is not None:
            acc.end_training()
        return [float(norm)], model

    norm, got = run("mixprec")
    _judged_with_norms(lambda variant: run("torch", variant), norm, got)
