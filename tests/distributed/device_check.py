"""Every collective's tensors on its group's device, checked on a CPU run.

[Note: host-born tensors]
NCCL refuses a CPU tensor ("No backend type associated with device type cpu"); Gloo takes
it. On a CPU machine the accelerator *is* the host, so a run cannot tell by a tensor's device
whether the code put it on the device or left it where the default device put it: both say
``cpu``. The checker therefore follows where each tensor *comes from*, as if the accelerator
were another device. A tensor is **host-born** when it was made on the default device:

- a factory called without ``device=`` (``torch.tensor``, ``zeros``, ``empty``, ``full``,
  ``arange``, ...; a module's parameters before ``model.to(device)``: an ``nn.Parameter``
  is host-born when its data is);
- ``torch.get_rng_state()``, ``torch.from_numpy``, ``torch.frombuffer``, ``Tensor.cpu()``,
  ``Tensor.pin_memory()``;
- an op whose tensor inputs are all host-born (a device op with one host-born 0-dim operand
  runs on the device, as CUDA does).

A factory or ``Tensor.to`` given an explicit device, ``.to(other)``, ``.cuda()`` make a
device tensor; in-place ops (``copy_``, ``fill_``, ``__setitem__``) keep the target's place;
tensors made out of Python's sight (gradients, the C++ core's buffers) are device tensors.
A ``TorchFunctionMode`` marks them as ops run ([Note: a torch function mode sees every op]).
Then every collective mixprec issues (``torch.distributed``'s, the functional ones SP uses,
``mixprec._C.broadcast_coalesced``, and any alias of them a module bound at import) is wrapped:
each tensor it is handed must be a device tensor and sit on ``group_device(group)``
(src/mixprec/distributed/devices.py). Object collectives (``all_gather_object``, ...) carry no
tensor of the caller: torch places their bytes on the group's device itself.

What it cannot see: an explicit ``device="cpu"`` / ``.to("cpu")`` (the same value as the test's
accelerator, so it counts as placed); that is read in review, the rest is run here.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_HOST_METHODS = {torch.Tensor.cpu, torch.Tensor.pin_memory}
_DEVICE_METHODS = {torch.Tensor.cuda}
_DEVICE_ARGS = (torch.device, str, int)

# torch.distributed's collectives (the names this torch has), their functional forms, and
# mixprec's C++ one that takes Python tensors.
_DIST_NAMES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "reduce", "send", "recv", "isend", "irecv", "all_reduce_coalesced", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
)
_FUNCOL_NAMES = ("all_reduce", "all_gather_tensor", "all_gather_single", "all_gather_tensor_autograd",
                 "reduce_scatter_tensor", "all_to_all_single", "all_to_all_single_autograd", "broadcast")
_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list"}


class HostOrigin(TorchFunctionMode):
    """Marks host-born tensors ([Note: host-born tensors])."""

    def __init__(self) -> None:
        super().__init__()
        self.host = WeakIdKeyDictionary()

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def mark(self, tensors, host: bool) -> None:
        for t in tensors:
            if host:
                self.host[t] = True
            else:
                self.host.pop(t, None)

    def _to_target(self, args, kwargs):
        """What ``Tensor.to`` was asked: (True, None) a device, (True, tensor) another
        tensor's place, (False, None) a dtype only."""
        if kwargs.get("device") is not None:
            return True, None
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                return True, a
            if isinstance(a, _DEVICE_ARGS) and not isinstance(a, bool):
                return True, None
        return False, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _HOST_METHODS:
            self.mark(outs, True)
        elif func in _DEVICE_METHODS:
            self.mark(outs, False)
        elif func is torch.Tensor.to:
            placed, like = self._to_target(args, kwargs)
            if placed:
                self.mark(outs, like is not None and self.is_host(like))
            elif not (len(outs) == 1 and outs[0] is args[0]):
                self.mark(outs, self.is_host(args[0]))
        elif kwargs.get("device") is not None:
            self.mark(outs, False)  # an explicit device
        elif func is torch.tensor or not ins:
            self.mark(outs, True)  # made on the default device
        else:
            fresh = [t for t in outs if not any(t is i for i in ins)]  # in-place results keep their place
            self.mark(fresh, all(self.is_host(i) for i in ins))
        return out


@dataclass
class Call:
    name: str
    group: str
    site: str  # the innermost frame in src/mixprec that issued it
    problems: list = field(default_factory=list)


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/mixprec/" in frame.filename.replace("\\", "/") and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/mixprec/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "<test code>"


class DeviceCheck:
    """Installs :class:`HostOrigin` and the collective wrappers; ``calls`` records every
    collective, ``violations`` the ones handed a host-born tensor or one off the group's device."""

    def __init__(self) -> None:
        self.origin = HostOrigin()
        self.calls: list[Call] = []
        self._undo: list[Callable[[], None]] = []
        self._depth = 0

    @property
    def violations(self) -> list[Call]:
        return [c for c in self.calls if c.problems]

    # ---------------------------------------------------------------- checks
    def _check(self, name: str, group: Any, tensors: list) -> None:
        from mixprec.distributed.devices import group_device
        from mixprec.distributed.state import find_group

        if isinstance(group, str):
            group = find_group(group)
        label = getattr(group, "group_name", None) if group is not None else "default"
        call = Call(name, str(label), _site())
        if name not in _OBJECT_COLLECTIVES:
            want = group_device(group)
            for i, t in enumerate(tensors):
                if self.origin.is_host(t):
                    call.problems.append(f"tensor {i} {tuple(t.shape)} {t.dtype} is host-born")
                elif t.device != want:
                    call.problems.append(f"tensor {i} on {t.device}, group device {want}")
        self.calls.append(call)

    def _wrap(self, name: str, fn: Callable, group_arg: str = "group") -> Callable:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        check = self

        def wrapper(*args, **kwargs):
            if check._depth == 0:  # a collective torch runs inside another is not the caller's
                bound = None
                if signature is not None:
                    try:
                        bound = signature.bind(*args, **kwargs).arguments
                    except TypeError:
                        bound = None
                values = bound if bound is not None else {**{str(i): a for i, a in enumerate(args)}, **kwargs}
                group = values.get(group_arg)
                tensors = [t for k, v in values.items() if k != group_arg
                           for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
                check._check(name, group, tensors)
            check._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                check._depth -= 1

        wrapper.__wrapped__ = fn
        return wrapper

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        old = getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, old))

    def _host_source(self, fn: Callable) -> Callable:
        origin = self.origin

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            origin.mark([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)], True)
            return out

        return wrapper

    # ------------------------------------------------------------- install
    def install(self) -> None:
        import torch.distributed._functional_collectives as funcol

        from mixprec import _C

        replaced: dict[int, Callable] = {}
        for name in _DIST_NAMES:
            if hasattr(dist, name):
                new = self._wrap(name, getattr(dist, name))
                replaced[id(getattr(dist, name))] = new
                self._patch(dist, name, new)
        for name in _FUNCOL_NAMES:
            if hasattr(funcol, name):
                new = self._wrap(f"funcol.{name}", getattr(funcol, name))
                replaced[id(getattr(funcol, name))] = new
                self._patch(funcol, name, new)
        new = self._wrap("_C.broadcast_coalesced", _C.broadcast_coalesced, group_arg="1")
        replaced[id(_C.broadcast_coalesced)] = new
        self._patch(_C, "broadcast_coalesced", new)
        # Aliases bound at import (``_all_gather = dist.all_gather_into_tensor``).
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("mixprec.") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in replaced and not attr.startswith("__"):
                    self._patch(module, attr, replaced[id(value)])
        for owner in (torch, torch.random):
            self._patch(owner, "get_rng_state", self._host_source(torch.random.get_rng_state))
        self._patch(torch, "from_numpy", self._host_source(torch.from_numpy))
        self._patch(torch, "frombuffer", self._host_source(torch.frombuffer))
        # A parameter is a new tensor object over its data, made outside the mode's sight.
        origin, make = self.origin, torch.nn.Parameter.__new__

        def parameter(cls, data=None, requires_grad=True):
            p = make(cls, data, requires_grad)
            origin.mark([p], data is None or origin.is_host(data))
            return p

        self._patch(torch.nn.Parameter, "__new__", parameter)
        self.origin.__enter__()
        self._undo.append(lambda: self.origin.__exit__(None, None, None))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def report(self) -> str:
        return "\n".join(f"{c.name} on group {c.group} at {c.site}: {'; '.join(c.problems)}"
                         for c in self.violations)


@contextlib.contextmanager
def checking():
    """``with checking() as check:`` every collective inside is checked; read
    ``check.violations`` / ``check.calls`` after."""
    check = DeviceCheck()
    check.install()
    try:
        yield check
    finally:
        check.uninstall()
