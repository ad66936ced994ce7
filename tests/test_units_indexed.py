"""zero3/fsdp unit hooks cost O(1) in the number of units ([Note: units are indexed] in
src/mixprec/engines/units.py): each unit knows its position, the forward order is kept as
arrays, membership is a stamp; no list scan (and no dataclass comparison) per hook."""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from mixprec import Accelerator
from mixprec.engines.units import Unit, UnitRunner


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


def _python_calls_per_step(units: int) -> int:
    """Python calls made by units.py code (and the functions it calls that Python defines in
    generated code, e.g. a dataclass ``__eq__``) during one training step."""
    torch.manual_seed(0)
    acc = Accelerator(backend="zero3", cpu=True, log_policy=False,
                      engine_options={"units": ["Block"], "check_unit_order": False})
    model = nn.Sequential(*[Block(4) for _ in range(units)], nn.Linear(4, 1))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4)

    def step():
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()

    step()  # the first forward records the order
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.endswith("engines/units.py") or name == "<string>":
                count[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    acc.end_training()
    return count[0]


def test_hook_work_per_unit_does_not_grow_with_the_number_of_units():
    small, large = _python_calls_per_step(8), _python_calls_per_step(64)
    # The same calls per unit at 8 and 64 units (a list scan per hook made it grow with the count).
    assert large / 64 <= small / 8 * 1.05, (small, large)
    assert large > small  # the count is real: more units, more hook calls


def test_units_are_found_by_index_not_by_equality():
    modules = [nn.Linear(2, 2) for _ in range(3)]
    units = [Unit(f"u{i}", weakref.ref(m), None, True) for i, m in enumerate(modules)]
    twin = Unit("u0", weakref.ref(modules[0]), None, True)  # equal fields, another unit
    runner = UnitRunner(units)
    assert [u.index for u in units] == [0, 1, 2]
    assert twin != units[0] and units[0] == units[0]
    runner._set_order([units[2], units[0], units[1]])
    assert runner._neighbour(units[0], +1) is units[1] and runner._neighbour(units[0], -1) is units[2]
    assert runner._neighbour(units[2], -1) is None and runner._neighbour(units[1], +1) is None
    assert runner._pos_of == [1, 2, 0]
