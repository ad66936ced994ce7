"""Issue 29, point 1: a backward before ``prepare()`` cannot leak into the first step.

``accelerator.backward`` before ``prepare()`` raises naming the call and the fix; gradients a
plain ``loss.backward()`` left before ``prepare()`` are cleared with a warning ([Note:
gradients before prepare()] in src/mixprec/facade/preparation.py), so the run is bitwise the
clean run.
"""

import pytest
import torch

from mixprec import Accelerator, NotPreparedError, StaleGradientsWarning


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def _train(mixed_precision: str, stray: bool) -> dict:
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, log_policy=False)
    model = _model()
    x, y = _batch()
    if stray:  # the newcomer's stray backward, before prepare()
        torch.nn.functional.mse_loss(model(3 * x), y).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.warns(StaleGradientsWarning, match=r"4 parameter\(s\) of Sequential already had gradients "
                      r"\(0.weight, 0.bias, 2.weight, 2.bias\).*they were cleared") if stray else _no_warning():
        model, opt = acc.prepare(model, opt)
    for _ in range(2):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    acc.end_training()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", StaleGradientsWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_backward_before_prepare_raises_naming_the_call_and_the_fix():
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    model = _model()
    x, y = _batch()
    loss = torch.nn.functional.mse_loss(model(x), y)
    with pytest.raises(NotPreparedError, match=r"accelerator.backward\(loss\) was called before "
                       r"accelerator.prepare\(\).*Fix: call `model, optimizer = accelerator.prepare"):
        acc.backward(loss)
    with pytest.raises(NotPreparedError, match=r"accelerator.scale\(loss\)"):
        acc.scale(loss)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    acc.end_training()


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_gradients_before_prepare_are_cleared_with_a_warning(mixed_precision):
    clean = _train(mixed_precision, stray=False)
    after_stray = _train(mixed_precision, stray=True)
    for name in clean:
        assert torch.equal(clean[name], after_stray[name]), name
