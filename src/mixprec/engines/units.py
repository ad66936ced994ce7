"""Units of parameter sharding (ZeRO-3 / FSDP): which parameters are gathered together,
and the hooks that gather and free them around each unit's forward and backward.

A unit is a module (chosen by class name, or by size) plus the root for the rest; each
unit's parameters get their own sharding core (csrc/engines/sharded/core.h), so a unit is
one set of buckets of the existing layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

UnitSpec = Union[None, str, Sequence[Union[str, type]]]


def select_unit_modules(model: nn.Module, spec: UnitSpec) -> list[tuple[str, nn.Module]]:
    """The non-root unit modules of ``model`` in module order.

    ``spec``: a list of module classes (or class names), or ``"size:<min_params>"``
    (bottom-up: a module becomes a unit when the parameters not already in a unit below it
    number at least ``min_params``), or None (no unit but the root)."""
    if spec is None:
        return []
    if isinstance(spec, str):
        if not spec.startswith("size:"):
            raise ValueError(
                f"units={spec!r} is not understood; give a list of module class names such as "
                "['TransformerEncoderLayer'], or 'size:<min_params>' such as 'size:1000000'"
            )
        try:
            min_params = int(spec[len("size:"):].replace("_", ""))
        except ValueError:
            raise ValueError(f"units={spec!r}: '<min_params>' must be an integer, e.g. 'size:1000000'") from None
        if min_params < 1:
            raise ValueError(f"units={spec!r}: min_params must be >= 1")
        return _by_size(model, min_params)
    wanted = {c if isinstance(c, str) else c.__name__ for c in spec}
    chosen = [(n, m) for n, m in model.named_modules() if m is not model and type(m).__name__ in wanted]
    found = {type(m).__name__ for _, m in chosen}
    missing = sorted(wanted - found)
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"units={list(spec)!r}: no module of class {missing} in {type(model).__name__}; "
            f"its module classes are {classes}"
        )
    return chosen


def _by_size(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is model:
            return
        free = [p for p in module.parameters() if id(p) not in claimed and p.requires_grad]
        if sum(p.numel() for p in free) >= min_params:
            chosen.append((name, module))
            claimed.update(id(p) for p in free)

    visit("", model)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(chosen, key=lambda nm: order[id(nm[1])])


def assign_params(model: nn.Module, units: list[tuple[str, nn.Module]], names: list[str],
                  params: list[torch.Tensor]) -> list[list[int]]:
    """Indices into ``params`` per unit (``units`` then the root last): each parameter goes
    to the innermost unit holding it; the root keeps the rest. Empty units are kept empty."""
    owner: dict[int, int] = {}
    for u, (_, module) in enumerate(units):  # module order: inner units come later and win
        for p in module.parameters():
            owner[id(p)] = u
    out: list[list[int]] = [[] for _ in range(len(units) + 1)]
    for i, p in enumerate(params):
        out[owner.get(id(p), len(units))].append(i)
    return out


@dataclass
class Unit:
    name: str
    module: "weakref.ref[nn.Module]"  # weak: see [Note: no reference cycles]
    core: object  # _C.ShardedCore
    reshard_after_forward: bool
    is_root: bool = False


@dataclass
class UnitRunner:
    """Gathers, frees and prefetches the units of one model.

    [Note: gather/free order]
    Forward: a unit's forward pre-hook gathers it (waiting for a prefetch in flight) and
    launches the async gather of the unit that ran next in the previous forward; its
    forward hook frees it when reshard_after_forward (the root is never freed there: its
    backward comes first) and hooks its outputs' gradients. Backward: when the first
    gradient of a unit's outputs is computed (register_multi_grad_hook, mode "any"), before
    any of its backward nodes run, the unit is gathered again. The C++ core frees it when
    its last parameter gradient has been accumulated (every node that reads a parameter
    runs before that parameter's AccumulateGrad). An end-of-backward callback frees
    whatever is still gathered (units with unused parameters), so after backward, and after
    the optimizer step, only the shards are held; the next forward gathers.

    [Note: prefetch]
    Backward order is the reverse of forward order. Entering unit i's backward, the async
    all-gather of the unit before it in forward order is launched BEFORE unit i computes,
    so that gather overlaps unit i's backward; forward does the same with the next unit.
    Every rank runs the same graph, so every rank issues the gathers (and the gradient
    reductions the core launches from its hooks) in the same order. At most two units are
    gathered at once besides the root.
    """

    units: list[Unit]
    prefetch: bool = True
    order: list[Unit] = field(default_factory=list)  # forward order of the last forward
    _current: list[Unit] = field(default_factory=list)
    _callback_queued: bool = False
    _handles: list = field(default_factory=list)  # module hook handles, removed by uninstall()

    def install(self) -> None:
        # [Note: no reference cycles]
        # The hooks hold the runner weakly and the units hold their modules weakly, so the
        # model and the engine hold each other in one direction only and the sharding cores
        # (which keep the process group alive) are freed by reference counting when the
        # user drops them, not by a cycle collection during interpreter shutdown, where
        # destroying a Gloo process group aborted the process.
        runner = weakref.ref(self)
        for unit in self.units:
            module = unit.module()
            if unit.core is None or module is None:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, a, u=unit: runner().pre_forward(u)))
            self._handles.append(module.register_forward_hook(lambda m, a, out, u=unit: runner().post_forward(u, out)))

    def uninstall(self) -> None:
        """Remove the module hooks and drop the cores (end of training): the hooks' closures
        hold the units, so without this the user's model would keep every core, and with it
        the process group, alive."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            unit.core = None
        self.order, self._current = [], []

    def _neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        order = self.order
        for i, u in enumerate(order):
            if u is unit:
                j = i + step
                return order[j] if 0 <= j < len(order) else None
        return None

    def pre_forward(self, unit: Unit) -> None:
        if unit.is_root:
            self._current = []
        if unit not in self._current:
            self._current.append(unit)
        unit.core.unshard(False)
        if self.prefetch:
            nxt = self._neighbour(unit, +1)
            if nxt is not None and nxt is not unit:
                nxt.core.unshard(True)

    def post_forward(self, unit: Unit, output) -> None:
        if unit.is_root:
            self.order = self._current
        grads = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if unit.is_root and not grads:
            self.reshard_all()  # no backward follows (eval / no_grad): hold only shards
            return
        if unit.reshard_after_forward and not unit.is_root:
            unit.core.reshard()
        if grads:
            runner = weakref.ref(self)
            register_multi_grad_hook(grads, lambda _g, u=unit: runner().pre_backward(u), mode="any")

    def pre_backward(self, unit: Unit) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        unit.core.unshard(False)
        if self.prefetch:
            prev = self._neighbour(unit, -1)
            if prev is not None and not prev.is_root:
                prev.core.unshard(True)

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.reshard_all()

    def reshard_all(self) -> None:
        for unit in self.units:
            if unit.core is not None:
                unit.core.reshard()
