"""fp16 with two optimizers: the loss scale moves once per iteration ([Note: one scaler
update per iteration] in src/mixprec/engines/base.py), as torch.amp.GradScaler does when
the loop calls update() once per iteration; an overflow seen by the first optimizer's
gradients skips both."""

import torch
from torch import nn

from mixprec import Accelerator, ScalerConfig


def _models():
    torch.manual_seed(0)
    return nn.Linear(8, 8), nn.Linear(8, 1)


def _loop(acc, gen, head, og, oh, iterations, poison_at=None, alternate=False):
    scales, results = [], []
    g = torch.Generator().manual_seed(1)
    for i in range(iterations):
        x = torch.randn(4, 8, generator=g)
        loss = head(gen(x)).float().square().mean()
        if i == poison_at:
            loss = loss * float("inf")
        acc.backward(loss)
        if alternate and i % 2:
            results.append((og.step(),))
        else:
            results.append((og.step(), oh.step()))
        og.zero_grad()
        oh.zero_grad()
        scales.append(acc.engine.scaler.scale_value())
    return scales, results


def _torch_scales(iterations, init, interval, poison_at=None):
    gen, head = _models()
    og, oh = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    g = torch.Generator().manual_seed(1)
    scales = []
    for i in range(iterations):
        x = torch.randn(4, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = head(gen(x)).float().square().mean()
        if i == poison_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(og)
        scaler.step(oh)
        scaler.update()
        og.zero_grad()
        oh.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _prepared(interval):
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False,
                      scaler=ScalerConfig(init_scale=256.0, growth_interval=interval))
    gen, head = _models()
    gen, head, og, oh = acc.prepare(gen, head, torch.optim.SGD(gen.parameters(), lr=0.1),
                                    torch.optim.SGD(head.parameters(), lr=0.1))
    return acc, gen, head, og, oh


def test_two_optimizers_one_update_per_iteration():
    acc, gen, head, og, oh = _prepared(interval=2)
    scales, results = _loop(acc, gen, head, og, oh, 6, poison_at=3)
    assert scales == _torch_scales(6, 256.0, 2, poison_at=3)
    # Growth after every 2 clean iterations (not every 2 optimizer steps), backoff once.
    assert scales == [256.0, 512.0, 512.0, 256.0, 256.0, 512.0]
    assert [tuple(r.reason for r in rs) for rs in results][3] == ("overflow", "overflow")


def test_optimizer_that_skips_iterations_still_updates_the_scale_once_each():
    acc, gen, head, og, oh = _prepared(interval=1)
    scales, results = _loop(acc, gen, head, og, oh, 4, alternate=True)
    # Iterations 1 and 3 step only `og`: their update happens at the next scaled backward.
    assert scales == [512.0, 512.0, 2048.0, 2048.0]
    assert acc.engine.scaler.scale_value() == 2048.0
    acc.backward(head(gen(torch.randn(4, 8))).float().square().mean())
    assert acc.engine.scaler.scale_value() == 4096.0
    assert all(r.stepped for rs in results for r in rs)
