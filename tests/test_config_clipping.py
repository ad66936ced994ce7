"""gradient_clipping: automatic clipping before each real step equals a manual
clip_grad_norm_ loop bitwise, and is skipped when the user clipped that step."""

from __future__ import annotations

import pytest
import torch

from _helpers import loss_fn, make_mlp, mlp_batches
from mixprec import Accelerator

MAX_NORM = 0.05  # small enough that every step clips


def _train(mixed_precision, *, auto, manual, ga=2, seed=0):
    acc = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=ga, cpu=True,
                      log_policy=False, gradient_clipping=MAX_NORM if auto else None)
    model = make_mlp(seed)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    norms = []
    for x, y in mlp_batches(8):
        with acc.accumulate(model):
            acc.backward(loss_fn(model(x), y))
            if manual and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), MAX_NORM)
            result = opt.step()
            opt.zero_grad()
        if result.reason != "accumulating":
            norms.append(result.grad_norm)
    return [p.detach().clone() for p in acc.get_state_dict(model).values()], norms


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_auto_clipping_equals_manual_loop_bitwise(mixed_precision):
    auto, auto_norms = _train(mixed_precision, auto=True, manual=False)
    manual, manual_norms = _train(mixed_precision, auto=False, manual=True)
    plain, plain_norms = _train(mixed_precision, auto=False, manual=False)
    assert all(torch.equal(a, b) for a, b in zip(auto, manual))
    assert auto_norms == manual_norms and all(n is not None and n > MAX_NORM for n in auto_norms)
    assert not all(torch.equal(a, b) for a, b in zip(auto, plain))  # clipping changed the run
    assert plain_norms == [None] * len(plain_norms)


def test_no_second_clip_when_the_user_clipped_that_step():
    both, _ = _train("no", auto=True, manual=True)
    manual, _ = _train("no", auto=False, manual=True)
    assert all(torch.equal(a, b) for a, b in zip(both, manual))


def test_auto_clipping_from_a_config_file(tmp_path):
    f = tmp_path / "mixprec.yaml"
    f.write_text(f"gradient_clipping: {MAX_NORM}\ncpu: true\nlog_policy: false\n")
    acc = Accelerator(config=str(f))
    model = make_mlp(0)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_batches(1)[0]
    acc.backward(loss_fn(model(x), y))
    opt.step()
    assert acc.last_step.grad_norm is not None and acc.last_step.grad_norm > MAX_NORM
