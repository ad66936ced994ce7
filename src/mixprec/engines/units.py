"""Units of parameter sharding (ZeRO-3 / FSDP): which parameters are gathered together,
and the hooks that gather and free them around each unit's forward and backward.

A unit is a module (chosen by class name, or by size) plus the root for the rest; each
unit's parameters get their own sharding core (csrc/engines/sharded/core.h), so a unit is
one set of buckets of the existing layout.

[Note: units are called]
A unit is gathered by its forward pre-hook, so a unit must be a module whose forward runs.
``ModuleList``/``ModuleDict`` are only iterated by their parent, never called: were one a
unit (its children together passing the size threshold), its parameters would never be
gathered and the first op reading them would fail with torch's "data is not allocated
yet". The size policy therefore makes the container's children units instead (FSDP1's size
policy excludes containers for the same reason), a class list naming a container is
refused, and a parameter used while its unit is not gathered (a module called outside its
parent's forward, say) is reported by :func:`explain_unsharded_use`, naming the module and
the unit.
"""

from __future__ import annotations

import linecache
import re
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves, tree_map

from ..diagnostics.locate import failing_module
from ..errors import UnitOrderError, UnshardedParameterError

UnitSpec = Union[None, str, Sequence[Union[str, type]]]


# Modules that hold other modules (or parameters) but are never called: a unit's gather runs
# in its forward pre-hook, so such a module can never be a unit ([Note: units are called]).
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_LEAF_FLAG = "_mixprec_leaf_module"


@dataclass(frozen=True)
class LeafSpec:
    """ZeRO-3 leaf modules (DeepSpeed's ``set_z3_leaf_modules``): each one is gathered whole,
    as one unit, and no module inside it becomes a unit of its own. For blocks whose
    submodules are called differently on each rank (a mixture-of-experts router)."""

    classes: tuple[str, ...] = ()  # class names (or qualified names ending in the class name)
    names: tuple[str, ...] = ()  # dotted module paths, exact
    name_suffixes: tuple[str, ...] = ()  # dotted module paths ending in one of these

    def matches(self, name: str, module: nn.Module) -> bool:
        if getattr(module, _LEAF_FLAG, False):
            return True
        cls = type(module)
        cls = getattr(cls, "_mixprec_original", cls)  # a prepared module's own class
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        if any(c == cls.__name__ or c == qualified for c in self.classes):
            return True
        if name in self.names:
            return True
        return any(name == s or name.endswith("." + s) for s in self.name_suffixes)

    def check(self, model: nn.Module) -> None:
        """Raise naming what matched nothing (a typo would silently keep experts as units)."""
        named = list(model.named_modules())
        missing = [c for c in self.classes if not any(self.__class__(classes=(c,)).matches(n, m) for n, m in named)]
        missing += [n for n in self.names if n not in dict(named)]
        missing += [s for s in self.name_suffixes
                    if not any(self.__class__(name_suffixes=(s,)).matches(n, m) for n, m in named)]
        if missing:
            classes = sorted({type(m).__name__ for _, m in named})
            raise ValueError(
                f"leaf modules {missing!r} match no module of {type(model).__name__}; its module "
                f"classes are {classes} (give class names, dotted module paths, or path suffixes)"
            )


def set_leaf_modules(model: nn.Module, classes: Sequence[Union[str, type]] = ()) -> list[str]:
    """Mark every module of ``model`` whose class is in ``classes`` as a ZeRO-3/FSDP leaf
    module (see :class:`LeafSpec`), before ``prepare()``. Returns the marked paths.

    Example::

        mixprec.set_leaf_modules(model, [MoEBlock])   # like deepspeed.utils.set_z3_leaf_modules
    """
    wanted = {c if isinstance(c, str) else c.__name__ for c in classes}
    marked = []
    for name, module in model.named_modules():
        if type(module).__name__ in wanted:
            object.__setattr__(module, _LEAF_FLAG, True)
            marked.append(name)
    if not marked:
        raise ValueError(f"set_leaf_modules: no module of class {sorted(wanted)} in {type(model).__name__}")
    return marked


def select_unit_modules(model: nn.Module, spec: UnitSpec,
                        leaves: Optional[LeafSpec] = None) -> list[tuple[str, nn.Module]]:
    """The non-root unit modules of ``model`` in module order.

    ``spec``: a list of module classes (or class names), or ``"size:<min_params>"``
    (bottom-up: a module becomes a unit when the parameters not already in a unit below it
    number at least ``min_params``), or None (no unit but the root). Containers that are
    never called (``ModuleList``, ``ModuleDict``) are never units: where one would be, its
    children are. Leaf modules are units, with no unit inside them."""
    leaves = leaves or LeafSpec()
    if spec is None:
        chosen: list[tuple[str, nn.Module]] = []
    elif isinstance(spec, str):
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
        return _by_size(model, min_params, leaves)
    else:
        chosen = _by_class(model, spec)
    return _with_leaves(model, chosen, leaves)


def _by_class(model: nn.Module, spec: Sequence[Union[str, type]]) -> list[tuple[str, nn.Module]]:
    wanted = {c if isinstance(c, str) else c.__name__ for c in spec}
    containers = sorted(wanted & {c.__name__ for c in CONTAINERS})
    if containers:
        raise ValueError(
            f"units={list(spec)!r}: {containers} is a container whose forward is never called, so "
            "its parameters would never be gathered; list the classes of the modules it holds "
            "(e.g. your block class) instead"
        )
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


def _with_leaves(model: nn.Module, chosen: list[tuple[str, nn.Module]],
                 leaves: LeafSpec) -> list[tuple[str, nn.Module]]:
    """Units of ``chosen`` plus every leaf module, minus anything strictly inside a leaf."""
    leaf_paths = [n for n, m in model.named_modules() if m is not model and leaves.matches(n, m)]
    leaf_paths = [n for n in leaf_paths if not any(n.startswith(o + ".") for o in leaf_paths)]
    inside = lambda n: any(n.startswith(leaf + ".") for leaf in leaf_paths)  # noqa: E731
    keep = {n for n, _ in chosen if not inside(n)} | set(leaf_paths)
    return [(n, m) for n, m in model.named_modules() if n in keep and m is not model]


def _by_size(model: nn.Module, min_params: int, leaves: LeafSpec) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()

    def free_params(module: nn.Module) -> list[torch.Tensor]:
        return [p for p in module.parameters() if id(p) not in claimed and p.requires_grad]

    def claim(name: str, module: nn.Module) -> None:
        free = free_params(module)
        if free:
            chosen.append((name, module))
            claimed.update(id(p) for p in free)

    def split_container(name: str, module: nn.Module) -> None:
        # [Note: units are called]: the container's children become units instead.
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            if isinstance(child, CONTAINERS):
                split_container(path, child)
            else:
                claim(path, child)

    def visit(name: str, module: nn.Module) -> None:
        if module is not model and leaves.matches(name, module):
            claim(name, module)  # a leaf is one unit whatever its size; nothing inside it is
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is model:
            return
        if sum(p.numel() for p in free_params(module)) >= min_params:
            if isinstance(module, CONTAINERS):
                split_container(name, module)
            else:
                claim(name, module)

    visit("", model)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(chosen, key=lambda nm: order[id(nm[1])])


def assign_params(model: nn.Module, units: list[tuple[str, nn.Module]], names: list[str],
                  params: list[torch.Tensor]) -> list[list[int]]:
    """Indices into ``params`` per unit (``units`` then the root last). A parameter goes to
    the innermost unit holding every module that owns it: a weight tied between two units
    (an embedding and an output head) goes to their common enclosing unit, else the root,
    so it is gathered whenever either module runs. Empty units are kept empty."""
    root = len(units)
    subtree = [{id(m) for m in module.modules()} for _, module in units]
    owners: dict[int, list[int]] = {}  # id(param) -> ids of the modules holding it directly
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(id(module))
    out: list[list[int]] = [[] for _ in range(len(units) + 1)]
    for i, p in enumerate(params):
        holders = owners.get(id(p), [])
        unit = root
        for u in range(len(units)):  # module order: inner units come later and win
            if holders and all(h in subtree[u] for h in holders):
                unit = u
        out[unit].append(i)
    return out


@dataclass(eq=False)  # compared by identity: a unit is one object, found by its index
class Unit:
    name: str
    module: "weakref.ref[nn.Module]"  # weak: see [Note: no reference cycles]
    core: object  # _C.ShardedCore
    reshard_after_forward: bool
    is_root: bool = False
    index: int = -1  # position in UnitRunner.units (set by the runner; the root is last)
    # [Note: agreed launch points]: when this unit's last forward began and ended (the
    # runner's clock), and whether its reductions were launched in the current backward.
    forward_began: int = -1
    forward_ended: int = -1
    launched: bool = False
    seen: int = -1  # the runner's forward count when this unit last joined `order`
    entered: int = -1  # the runner's backward count when its backward last began


def _in_backward() -> bool:
    """True inside autograd's backward (a checkpointed unit's recompute runs there)."""
    return torch._C._current_graph_task_id() != -1


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
    Every rank runs the same units in the same order, so every rank issues the gathers
    (and the gradient reductions, [Note: agreed launch points]) in the same order. At most
    two units are gathered at once besides the root.

    [Note: units are indexed]
    Every hook runs in O(1) of the number of units: a unit carries its index in ``units``,
    the forward order is kept as arrays indexed by it (the next and previous unit, the
    position in the order), and membership ("already in this forward's order", "backward
    already entered") is a stamp of the forward or backward count on the unit, not a list
    scan. Only once per forward (the order) and once per backward (launch what is left,
    free) does the runner walk all units.

    [Note: agreed launch points]
    The units' gradient reductions are launched here, not by the cores' hooks, at points
    that do not depend on which gradients a rank got ([Note: agreed reductions] in
    csrc/engines/sharded/core.h): a unit one rank does not use (its forward returns the
    input unchanged there) must still reduce, with zeros, at the same position in every
    rank's sequence of collectives, between the same backward gathers. Entering unit k's
    backward, every unit whose backward started earlier and whose forward began after k's
    forward ended is launched (``launch_all``), before k is gathered: all of such a unit's
    autograd nodes were recorded after k's, so autograd has run them, and accumulated their
    parameters' gradients, before k's first node. A unit nested in k (or the root) waits.
    The end-of-backward callback calls ``end_backward`` on every unit in unit order (launch
    what is left, then complete), then frees what is still gathered. Both depend only on
    the forward and backward order of the units, which every rank shares.
    """

    units: list[Unit]
    prefetch: bool = True
    check_order: Optional[UnitOrderCheck] = None  # [Note: unit order check]; None: off
    unit_of_param: dict = field(default_factory=dict)  # id(param) -> unit name (error reports)
    # id(core) -> open gathering scopes holding it: never freed here ([Note: the gathering
    # context] in engines/gathered.py). The comm's dict, shared with the scopes.
    pins: dict = field(default_factory=dict)
    order: list[Unit] = field(default_factory=list)  # forward order of the last forward
    _current: list[Unit] = field(default_factory=list)
    _callback_queued: bool = False
    _clock: int = 0  # forward hooks seen ([Note: agreed launch points])
    _forwards: int = 0  # root forwards begun (Unit.seen stamps)
    _backwards: int = 0  # backwards begun (Unit.entered stamps)
    _pending: list[Unit] = field(default_factory=list)  # entered, not launched, not the root
    _handles: list = field(default_factory=list)  # module hook handles, removed by uninstall()
    # [Note: units are indexed]: the last forward's order as arrays over unit indices.
    _next_of: list = field(default_factory=list)
    _prev_of: list = field(default_factory=list)
    _pos_of: list = field(default_factory=list)  # position in `order`, -1: not in it
    _window: bool = False  # between the root's forward pre-hook and its forward hook
    _cursor: int = 0  # highest position of `order` whose gather this forward issued

    def __post_init__(self) -> None:
        for i, unit in enumerate(self.units):
            unit.index = i
        self._set_order(self.order)

    def _set_order(self, order: list[Unit]) -> None:
        n = len(self.units)
        self.order = order
        self._next_of, self._prev_of, self._pos_of = [None] * n, [None] * n, [-1] * n
        for pos, unit in enumerate(order):
            self._pos_of[unit.index] = pos
            self._prev_of[unit.index] = order[pos - 1] if pos > 0 else None
            self._next_of[unit.index] = order[pos + 1] if pos + 1 < len(order) else None

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
            if hasattr(unit.core, "set_launch_from_hooks"):
                unit.core.set_launch_from_hooks(False)  # [Note: agreed launch points]
            self._handles.append(module.register_forward_pre_hook(_UnitHook(runner, unit, False)))
            self._handles.append(module.register_forward_hook(_UnitHook(runner, unit, True)))

    def uninstall(self) -> None:
        """Remove the module hooks and drop the cores (end of training): the hooks' closures
        hold the units, so without this the user's model would keep every core, and with it
        the process group, alive."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            unit.core = None
        self._set_order([])
        self._current, self._pending = [], []

    def _neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        """The unit after (``step=+1``) or before (-1) ``unit`` in the last forward's order."""
        return (self._next_of if step > 0 else self._prev_of)[unit.index]

    def pre_forward(self, unit: Unit) -> None:
        in_backward = _in_backward()  # a checkpointed unit's recompute: not a forward
        check = self.check_order
        if unit.is_root and not in_backward:
            self._forwards += 1
            self._current = []
            self._window, self._cursor = True, 0
            if check is not None:
                check.begin_forward()
        if unit.seen != self._forwards:
            unit.seen = self._forwards
            self._current.append(unit)
        unit.forward_began = self._tick()
        windowed = self._window and not in_backward
        if windowed and check is not None:
            check.record(unit.index)
            if not check.per_unit:
                self._catch_up(unit)
        self._gather(unit, False, check=not in_backward)
        if windowed:
            self._cursor = max(self._cursor, self._pos_of[unit.index])
        if self.prefetch:
            nxt = self._next_of[unit.index]
            if nxt is not None and nxt is not unit:
                self._gather(nxt, True, check=not in_backward)
                if windowed:
                    self._cursor = max(self._cursor, self._pos_of[nxt.index])

    def _catch_up(self, unit: Unit) -> None:
        """[Note: batched unit order check] (point 3): a rank that skips units of the last
        forward's order issues their gathers now, in that order, where a rank running them
        would have: its collectives stay paired with the other ranks' until the forward's
        check names the difference."""
        pos = self._pos_of[unit.index]
        for q in range(self._cursor + 1, pos):
            skipped = self.order[q]
            if skipped.core is None:
                continue
            self._gather(skipped, False, check=False)
            if skipped.reshard_after_forward and not skipped.is_root and id(skipped.core) not in self.pins:
                skipped.core.reshard()  # as its forward hook would have
            self._cursor = q

    def _gather(self, unit: Unit, async_op: bool, check: bool = True) -> None:
        # Forward gathers only: backward gathers (and a checkpointed unit's recompute, which
        # runs inside backward) follow the reverse of the forward order, which the forward
        # checks already found equal on every rank.
        if check and self.check_order is not None and not unit.core.unsharded:
            self.check_order.before_gather(unit.index)
        unit.core.unshard(async_op)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def post_forward(self, unit: Unit, output, inputs=()):
        unit.forward_ended = self._tick()
        if unit.is_root and self._window and not _in_backward():
            self._window = False
            if self.check_order is not None:
                self.check_order.end_forward()  # [Note: batched unit order check]
        if unit.is_root:
            self._set_order(self._current)
        # A unit that returns one of its inputs as it is (a layer skipped on some ranks):
        # its backward hook would sit on the same tensor as the hook of the unit that
        # produced it, and hooks of one tensor fire in registration order, so this rank
        # would enter the two units' backward (and gather them) in the other order than a
        # rank that ran the layer. A view gives the output a node of its own.
        passed = {id(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        replaced = None
        if passed and any(isinstance(t, torch.Tensor) and id(t) in passed and t.requires_grad
                          for t in tree_leaves(output)):
            output = replaced = tree_map(
                lambda t: t.view_as(t) if isinstance(t, torch.Tensor) and id(t) in passed
                and t.requires_grad else t, output)
        grads = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if unit.is_root and not grads:
            self.reshard_all()  # no backward follows (eval / no_grad): hold only shards
            return replaced
        if unit.reshard_after_forward and not unit.is_root and id(unit.core) not in self.pins:
            unit.core.reshard()
        if grads:
            runner = weakref.ref(self)
            register_multi_grad_hook(grads, lambda _g, u=unit: runner().pre_backward(u), mode="any")
        return replaced

    def pre_backward(self, unit: Unit) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
            self._backwards += 1
            self._pending = []
        # [Note: agreed launch points]: units finished before this one's backward begins.
        if self._pending:
            waiting = []
            for done in self._pending:
                if done.forward_began > unit.forward_ended:
                    done.launched = True
                    if hasattr(done.core, "launch_all"):
                        done.core.launch_all()
                else:
                    waiting.append(done)
            self._pending = waiting
        if unit.entered != self._backwards:
            unit.entered = self._backwards
            if not unit.is_root and not unit.launched:
                self._pending.append(unit)
        self._gather(unit, False, check=False)
        if self.prefetch:
            prev = self._prev_of[unit.index]
            # [Note: no prefetch of a unit already in backward]
            # The unit before this one in forward order may be one whose backward began
            # earlier in this backward: the unit enclosing it (a GPT-2 block around its
            # attn.c_attn unit, whose forward begins first). It is gathered and receiving
            # gradients; unshard() on it restarted the core's count of gradients received
            # (core.cpp, unshard_locked), so it never reached the unit's parameter count, and
            # the unit stayed gathered until the end of backward (every GPT-2 block's 2.3 MiB,
            # 27 MiB at GPT-2 small's embedding backward, its peak:
            # benchmarks/probe_trainer_memory.py). Once freed after its last gradient, a
            # prefetch would gather it again for nothing. Either way it is skipped; `entered`
            # stamps follow the units' backward order, the same on every rank, so every rank
            # skips the same gathers.
            if prev is not None and not prev.is_root and prev.entered != self._backwards:
                self._gather(prev, True, check=False)

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._pending = []
        for unit in self.units:  # [Note: agreed launch points]: unit order, every rank
            unit.launched = False
            if unit.core is not None and hasattr(unit.core, "end_backward"):
                unit.core.end_backward()
        self.reshard_all()

    def reshard_all(self) -> None:
        for unit in self.units:
            if unit.core is not None and id(unit.core) not in self.pins:
                unit.core.reshard()


def _inert_hook(*args) -> None:
    """What a unit hook becomes in a pickle or a deep copy (see :class:`_UnitHook`)."""
    return None


class _UnitHook:
    """A unit's forward pre-hook (``post=False``) or forward hook. A deep copy or a pickle
    of the model (an EMA copy, ``torch.save(model)``) gets :func:`_inert_hook` instead: the
    copy holds full parameters of its own and must not gather the original's units."""

    __slots__ = ("runner", "unit", "post")

    def __init__(self, runner, unit: "Unit", post: bool) -> None:
        self.runner, self.unit, self.post = runner, unit, post

    def __call__(self, module, args, out=None):
        runner = self.runner()
        if runner is None:
            return None
        if self.post:
            return runner.post_forward(self.unit, out, args)
        return runner.pre_forward(self.unit)

    def __reduce__(self):
        return _the_inert_hook, ()

    def __deepcopy__(self, memo):
        return _inert_hook


def _the_inert_hook():
    return _inert_hook


# torch's messages for reading a tensor whose storage was released (an op, or a view of it).
_UNALLOCATED = ("data is not allocated yet", "out of bounds for storage of size 0")


def explain_unsharded_use(error: BaseException, model: Optional[nn.Module],
                          runner: Optional["UnitRunner"]) -> Optional[UnshardedParameterError]:
    """An :class:`UnshardedParameterError` for torch's "data is not allocated yet" raised in
    ``model``'s forward, naming the module that read the parameter and its unit; None for
    any other error ([Note: units are called])."""
    if model is None or runner is None or not any(m in str(error) for m in _UNALLOCATED):
        return None
    failing = failing_module(error, model)
    module = failing.module if failing is not None else model
    where = failing.display if failing is not None else f"<root> ({type(model).__name__})"
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}

    def freed(tensors) -> list:
        return list({id(p): p for p in tensors if id(p) in names and p.numel() > 0
                     and p.untyped_storage().nbytes() == 0}.values())

    # Most specific first: what the failing line names, the frame's tensors, the module's own
    # parameters, then anything below it.
    named_in_line = _params_named_in_failing_line(error, module)
    inputs = list(failing.inputs.values()) if failing is not None else []
    freed = (freed(named_in_line) or freed(inputs) or freed(module.parameters(recurse=False))
             or freed(module.parameters()))
    unit_names = [runner.unit_of_param.get(id(p), "?") for p in freed]
    units = list(dict.fromkeys(unit_names))
    shown = [names[id(p)] for p in freed][:4]
    ran = {u.name for u in runner._current}
    why = []
    for name in units:
        unit = next((u for u in runner.units if u.name == name), None)
        module_of = unit.module() if unit is not None else None
        kind = type(module_of).__name__ if module_of is not None else "?"
        if module_of is not None and isinstance(module_of, CONTAINERS):
            why.append(f"unit {name!r} is a {kind}, which is never called, so it is never gathered")
        elif name not in ran:
            why.append(f"unit {name!r} ({kind}) has not run its forward yet in this pass: its "
                       "parameters are read from outside its forward")
        else:
            why.append(f"unit {name!r} ({kind}) was already freed after its forward: its "
                       "parameters are read again outside its forward")
    message = (
        f"module {where} read parameter(s) {shown} of sharding unit(s) {units} while they were "
        f"not gathered ({'; '.join(why) or 'no unit holds them'}). A unit's parameters are "
        "gathered only while the unit's own forward runs. Fix: choose units whose forward "
        "reads all their parameters (units=[<your block class>]), make the module that reads "
        "them a leaf module (leaf_module_classes / leaf_module_names) so it is gathered whole, "
        "or use units=[] (one unit, the whole model)."
    )
    return UnshardedParameterError(message, module_path=failing.path if failing else "",
                                   params=tuple(names[id(p)] for p in freed), units=tuple(units))


def _params_named_in_failing_line(error: BaseException, module: nn.Module) -> list[torch.Tensor]:
    """Parameters the source line of ``module``'s failing frame reads as ``self.<path>``."""
    tb, line = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is module:
            line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    found = []
    for path in re.findall(r"self((?:\.\w+)+)", line or ""):
        obj: object = module
        for attr in path.strip(".").split("."):
            obj = getattr(obj, attr, None)
            if isinstance(obj, torch.Tensor):
                found.append(obj)
                break
            if obj is None:
                break
    return found


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor deprecated); 2.11 has
# only all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class UnitOrderCheck:
    """[Note: unit order check]
    Every rank must gather the same units in the same order: the all-gathers are matched by
    their position in the sequence of collectives, so a unit one rank calls and another
    skips (experts picked per rank by a router) pairs one rank's gather with another's
    different collective: a native abort when the sizes differ, silently wrong weights when
    they do not (experts of one shape). The check raises :class:`UnitOrderError` on every
    rank, naming the unit each rank ran, instead. It has two exchanges:

    - per gather (``__call__``): before a unit's gather the ranks exchange its index (one
      small all-gather, finished before any parameter data moves) and raise at the first
      difference, before the mismatched gather;
    - per forward (``end_forward``): at the root's forward hook, after the forward's last
      unit and before any backward, the ranks exchange a fingerprint (count and hash) of
      the forward's sequence of units; a difference raises, naming the first unit that
      differs (the sequences themselves are exchanged only then).

    Which runs when is [Note: batched unit order check]. Leaf modules are the fix: the block
    is gathered whole on every rank. Only forward gathers are checked: backward re-gathers
    the same units in reverse order, so a divergence shows in forward first.
    benchmarks/bench_unit_check.py measures the cost.

    [Note: batched unit order check]
    One exchange per unit per forward cost zero3 22% of its step at 256 units (a Gloo
    all-gather is tens of microseconds), so an established order is checked once per
    forward; the per-gather exchange is kept where a forward could otherwise go wrong
    before its end. Why the end of the forward is in time, and when it is not:

    1. Collectives pair by position. In a forward, a unit's pre-hook issues its own gather
       (unless it is gathered) and the prefetch of the unit that followed it in the previous
       forward (``UnitRunner.order``); the gathered states follow from the same history.
       So when every earlier forward ran the same sequence on every rank (their checks
       passed) and this forward agrees up to unit k, every rank has issued the same gathers
       up to unit k.
    2. What the forward's gathered weights feed is activations only: gradient reductions run
       in backward, the update after it. The check runs before both, so a difference found
       there has changed no gradient, weight or optimizer state: it raises instead of a
       wrong step.
    3. A rank that skips units of the previous order (an expert that got no token) would
       leave the prefetch chain: its next gather would be a later unit, paired with another
       rank's gather of a skipped one. The runner issues the skipped units' gathers in their
       order first (``UnitRunner._catch_up``), as a rank running them does, so the ranks'
       gathers stay paired and the forward reaches the check.
    4. A rank calling a unit the previous order does not have ahead (a unit it never ran, or
       one again) issues a gather no other rank issues, before the end of the forward: no
       once-per-forward exchange can know that in advance. So the per-gather exchange runs
       in every forward whose order is not established: the first forward, a forward after
       one that ended without its check (it raised), and every forward after one whose
       sequence differed from the forward before it (the order is changing: routing,
       another code path). The fingerprints decide that, and they are exchanged, so every
       rank decides the same. A model whose units run in a fixed order pays the per-gather
       exchange in its first two forwards and one exchange per forward after; a model whose
       order keeps changing (a router calling units per rank: what the check exists for)
       keeps the per-gather exchange and is stopped before its first mismatched gather, as
       with the check per gather alone.

    What the batched check gives up is the case left over from points 3 and 4: a model whose
    order was the same on every rank for two forwards in a row and then, on some ranks only,
    runs a unit outside that order. Its gather pairs with another rank's different
    collective: a native abort when the sizes differ (Gloo aborts the process); when they
    are equal, wrong weights for that forward, and the ranks' collectives stay shifted by
    one, so the forward's check meets a parameter gather (an abort) rather than naming the
    unit. Nothing is updated either way. ``check_unit_order: "every_gather"`` (engine
    option) keeps the per-gather exchange in every forward for such a model.

    [Note: deferred unit order check]
    Under Gloo the values are CPU tensors and the comparison is immediate (no device to
    wait for). Under NCCL they live on the device and reading them would stall the host, so
    the check is deferred (``deferred`` defaults to "the group is NCCL"): each exchange
    compares on the device and keeps, in a device buffer, a sticky mismatch flag with what
    is needed to name it; the buffer is copied, non-blocking, into pinned host memory behind
    an event, and the copy taken one period earlier is read (the event waited for; it was
    recorded a period ago, so it has almost always completed, and an event wait is not a
    stream sync). The per-forward check's period is one forward: a difference raises at the
    end of the next forward, on every rank (the exchange counts and the gathered data are the
    same everywhere), the error saying so; with deferred reads the per-gather exchange would
    tell no sooner, so a deferred check runs the per-forward one only. The per-gather
    exchange, called directly (``__call__``), reads every ``lag`` calls (default: the number
    of units) and raises between ``lag`` and ``2*lag`` calls after the first difference.
    What is lost is only promptness: the parameter gathers in between have run mismatched.
    """

    MODES = ("auto", "every_gather")
    _HASH_MOD = (1 << 61) - 1
    _HASH_MUL = 1_000_003

    def __init__(self, group, names: list[str], device: torch.device = torch.device("cpu"), *,
                 deferred: Optional[bool] = None, lag: Optional[int] = None, mode: str = "auto") -> None:
        self.group = group
        self.names = names
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # NCCL moves device tensors only; Gloo takes CPU ones (the immediate read below then
        # costs no device sync). check_unit_order: false removes the check altogether.
        nccl = dist.get_backend(group) == "nccl"
        if not nccl:
            device = torch.device("cpu")
        self.device = torch.device(device)
        self.deferred = nccl if deferred is None else bool(deferred)
        if lag is not None and (not isinstance(lag, int) or lag < 1):
            raise ValueError(f"lag={lag!r} must be an int >= 1 (calls between two reads of the deferred check)")
        if mode not in self.MODES:
            raise ValueError(f"check_unit_order={mode!r} is not a mode; use True (batched where the order is "
                             f"established), 'every_gather' (an exchange before every forward gather) or False")
        self.mode = mode
        self.lag = lag if lag is not None else max(1, len(names))
        self._mine = torch.zeros(1, dtype=torch.int64, device=device)
        self._all = torch.zeros(self.world, dtype=torch.int64, device=device)
        self._calls = 0
        # Deferred: [mismatch flag, index this rank wanted, index each rank sent] of the first
        # mismatch; flag 0 until one happens.
        self._first = torch.zeros(self.world + 2, dtype=torch.int64, device=device)
        self._host = None  # the snapshot of _first being copied to the host
        self._event = None  # completes when _host holds it (None on the CPU)
        self._snapshot_call = 0
        # Per forward ([Note: batched unit order check]).
        self.exchanges = 0  # collectives this check issued (both kinds)
        self.forwards = 0  # forwards begun
        self._in_forward = False
        self._sequence: list[int] = []  # unit indices of this forward, in the order they ran
        self._hash = 0
        self._last: Optional[tuple] = None  # the last checked forward's (count, hash), agreed
        self.per_unit = not self.deferred  # this forward exchanges before every gather
        self._fp_mine = torch.zeros(2, dtype=torch.int64, device=device)
        self._fp_all = torch.zeros(2 * self.world, dtype=torch.int64, device=device)
        # Deferred: [flag, forward number of the first mismatch]; its snapshot and event.
        self._fp_first = torch.zeros(2, dtype=torch.int64, device=device)
        self._fp_row = torch.zeros(2, dtype=torch.int64, device=device)
        self._fp_host = None
        self._fp_event = None
        self._sequences: dict[int, list[int]] = {}  # deferred: forward number -> its sequence

    # ------------------------------------------------------------ per gather
    def __call__(self, index: int) -> None:
        self._calls += 1
        self.exchanges += 1
        if self.deferred and self._calls % self.lag == 0:
            self._read_snapshot()
            self._take_snapshot()
        self._mine.fill_(index)
        _all_gather(self._all, self._mine, group=self.group)
        if self.deferred:
            mismatch = (self._all != self._mine).any()
            first = mismatch & (self._first[0] == 0)
            row = torch.cat([torch.ones_like(self._mine), self._mine, self._all])
            self._first.copy_(torch.where(first, row, self._first))
            return
        seen = self._all.tolist()
        if any(i != index for i in seen):
            self._raise(index, seen, "")

    def before_gather(self, index: int) -> None:
        """A forward gather of unit ``index`` is about to be issued: the per-gather exchange
        when this forward has it, or outside a root forward (a unit called on its own)."""
        if self.per_unit or not self._in_forward:
            self(index)

    def _take_snapshot(self) -> None:
        self._snapshot_call = self._calls
        self._host, self._event = self._snapshot(self._first, self._host)

    def _snapshot(self, buffer: torch.Tensor, host: Optional[torch.Tensor]):
        """(host copy of ``buffer``, the event it completes behind, None on the CPU)."""
        if self.device.type != "cuda":
            return buffer.clone(), None
        with torch.cuda.device(self.device):
            if host is None:
                host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
            host.copy_(buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return host, event

    def _read_snapshot(self) -> None:
        if self._host is None:
            return
        if self._event is not None:
            self._event.synchronize()
        values = self._host.numpy().tolist()
        if values[0]:
            self._raise(values[1], values[2:],
                        f" (deferred check, [Note: deferred unit order check] in "
                        f"src/mixprec/engines/units.py: found by call {self._calls} of this "
                        f"process's check, at most {2 * self.lag} calls after the difference)")

    def _raise(self, index: int, seen: list, note: str) -> None:
        theirs = {r: self._name(i) for r, i in enumerate(seen)}
        listing = ", ".join(f"rank {r}: {n!r}" for r, n in theirs.items())
        mine = self._name(index)
        raise UnitOrderError(
            f"ranks gather different sharding units at the same point ({listing}); this rank "
            f"({self.rank}) wanted {mine!r}{note}. {_FIX}", mine=mine, theirs=theirs)

    def _name(self, index: Optional[int]) -> str:
        if index is None:
            return "<end of the forward>"
        return self.names[index] if 0 <= index < len(self.names) else f"#{index}"

    # ------------------------------------------------------------ per forward
    def begin_forward(self) -> None:
        """The root's forward begins."""
        if self._in_forward and not self.deferred:
            self.per_unit = True  # the last forward ended without its check (it raised)
        self._in_forward = True
        self.forwards += 1
        self._sequence = []
        self._hash = 0
        if self.mode == "every_gather" and not self.deferred:
            self.per_unit = True

    def record(self, index: int) -> None:
        """Unit ``index``'s forward begins (in the root's forward)."""
        self._sequence.append(index)
        self._hash = (self._hash * self._HASH_MUL + index + 1) % self._HASH_MOD

    def end_forward(self) -> None:
        """The root's forward ended: one exchange of the forward's fingerprint."""
        if not self._in_forward:
            return
        self._in_forward = False
        fingerprint = (len(self._sequence), self._hash)
        self.exchanges += 1
        if self.deferred:
            self._end_forward_deferred(fingerprint)
            return
        mine = torch.tensor(fingerprint, dtype=torch.int64, device=self.device)
        rows = torch.empty(2 * self.world, dtype=torch.int64, device=self.device)
        _all_gather(rows, mine, group=self.group)
        values = rows.tolist()
        if any(tuple(values[2 * r:2 * r + 2]) != fingerprint for r in range(self.world)):
            self._raise_sequences(self._sequence, "")
        # [Note: batched unit order check], 4: an order that just changed is not established.
        self.per_unit = fingerprint != self._last or self.mode == "every_gather"
        self._last = fingerprint

    def _end_forward_deferred(self, fingerprint: tuple) -> None:
        if self._fp_host is not None:
            if self._fp_event is not None:
                self._fp_event.synchronize()
            flag, forward = self._fp_host.numpy().tolist()
            if flag:
                self._raise_sequences(
                    self._sequences.get(forward, []),
                    f" (deferred check, [Note: deferred unit order check] in src/mixprec/engines/units.py: "
                    f"forward {forward} differed, found at the end of forward {self.forwards})")
        self._fp_mine[0].fill_(fingerprint[0])
        self._fp_mine[1].fill_(fingerprint[1])
        _all_gather(self._fp_all, self._fp_mine, group=self.group)
        mismatch = (self._fp_all.view(self.world, 2) != self._fp_mine).any()
        first = mismatch & (self._fp_first[0] == 0)
        self._fp_row[0].fill_(1)
        self._fp_row[1].fill_(self.forwards)
        self._fp_first.copy_(torch.where(first, self._fp_row, self._fp_first))
        self._sequences[self.forwards] = self._sequence
        self._sequences.pop(self.forwards - 2, None)
        self._fp_host, self._fp_event = self._snapshot(self._fp_first, self._fp_host)

    def _raise_sequences(self, sequence: list[int], note: str) -> None:
        """The fingerprints differ: exchange the sequences (rare path) and name the first
        unit that differs."""
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, list(sequence), group=self.group)
        longest = max(len(s) for s in everyone)
        at = next((i for i in range(longest) if len({s[i] if i < len(s) else None for s in everyone}) > 1),
                  None)
        if at is None:  # the same sequence: the fingerprints cannot differ (kept for safety)
            raise UnitOrderError(f"the sharding unit order check found different fingerprints for the same "
                                 f"sequence of units on every rank{note}. {_FIX}")
        theirs = {r: self._name(s[at] if at < len(s) else None) for r, s in enumerate(everyone)}
        listing = ", ".join(f"rank {r}: {n!r}" for r, n in theirs.items())
        mine = theirs[self.rank]
        raise UnitOrderError(
            f"ranks ran different sharding units in one forward (unit {at + 1} of the forward: {listing}); this "
            f"rank ({self.rank}) ran {mine!r}, found at the end of the forward, before its backward ([Note: "
            f"batched unit order check] in src/mixprec/engines/units.py){note}. {_FIX}", mine=mine, theirs=theirs)


_FIX = ("A unit that only some ranks call (e.g. mixture-of-experts experts chosen per rank) cannot be gathered "
        "per unit. Fix: make the block that routes between them a leaf module (zero3/fsdp option "
        "leaf_module_classes: [<block class>], or mixprec.set_leaf_modules(model, [<block class>])), so every "
        "rank gathers it whole.")
