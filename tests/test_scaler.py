"""The C++ GradScaler state machine against torch's own scale update."""

import math
import random

import pytest
import torch

from mixprec import _C


def _torch_sequence(found, init, interval):
    scale = torch.full((1,), init)
    tracker = torch.zeros((1,), dtype=torch.int32)
    out = []
    for f in found:
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(f)), 2.0, 0.5, interval)
        out.append(scale.item())
    return out


@pytest.mark.parametrize("tensor_ops", [False, True])
def test_matches_torch_update_bitwise(tensor_ops):
    rng = random.Random(0)
    found = [rng.random() < 0.2 for _ in range(300)]
    expected = _torch_sequence(found, 2.0**16, 7)
    s = _C.GradScaler(_C.ScalerOptions(growth_interval=7), torch.device("cpu"))
    got = []
    for f in found:
        if f:
            s.found_inf.fill_(1.0)
        s.update(tensor_ops)
        got.append(s.scale_value())
        assert s.found_inf.item() == 0.0  # cleared after each update
    assert got == expected


@pytest.mark.parametrize("tensor_ops", [False, True])
def test_hysteresis_min_and_max(tensor_ops):
    opts = _C.ScalerOptions(init_scale=4.0, hysteresis=2, min_scale=1.0, max_scale=8.0, growth_interval=2)
    s = _C.GradScaler(opts, torch.device("cpu"))

    def step(found):
        if found:
            s.found_inf.fill_(1.0)
        s.update(tensor_ops)
        return s.scale_value()

    assert step(True) == 4.0  # first overflow tolerated (hysteresis 2)
    assert step(True) == 2.0  # second backs off
    assert step(True) == 2.0  # counter was reset: tolerated again
    assert step(True) == 1.0
    assert step(True) == 1.0 and step(True) == 1.0  # floor
    assert step(False) == 1.0 and step(False) == 2.0  # grows after 2 clean steps
    for _ in range(10):
        step(False)
    assert s.scale_value() == 8.0  # ceiling


def test_inv_scale_is_bit_identical_to_torch():
    s = _C.GradScaler(_C.ScalerOptions(init_scale=3.0), torch.device("cpu"))
    expected = torch.full((), 3.0).double().reciprocal().float()
    assert s.inv_scale().item() == expected.item()


def test_state_round_trip():
    s = _C.GradScaler(_C.ScalerOptions(hysteresis=3), torch.device("cpu"))
    s.load(1024.0, 5, 2)
    assert (s.scale_value(), s.growth_tracker(), s.hysteresis_left()) == (1024.0, 5, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": -1.0}, "init_scale must be a positive finite number, got -1"),
        ({"init_scale": math.inf}, "init_scale must be a positive finite number"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor must be in \(0, 1\), got 1.5"),
        ({"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
        ({"hysteresis": 0}, "hysteresis must be >= 1, got 0"),
    ],
)
def test_bad_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _C.GradScaler(_C.ScalerOptions(**kwargs), torch.device("cpu"))


def test_scale_loss_keeps_dtype_and_refuses_integers():
    s = _C.GradScaler(_C.ScalerOptions(), torch.device("cpu"))
    loss = torch.tensor(1.5)
    assert s.scale_loss(loss).item() == 1.5 * 65536
    assert s.scale_loss(loss).shape == torch.Size([])
    with pytest.raises(ValueError, match="floating-point loss"):
        s.scale_loss(torch.tensor(3))
