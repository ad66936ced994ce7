"""Reading and changing parameters outside forward: the guard on zero3/fsdp parameters and
the gathering context (``Accelerator.gathered_parameters``, ``mixprec.GatheredParameters``,
``mixprec.summon_full_params``).

[Note: guarded sharded parameters]
On zero3/fsdp a parameter is a view of its unit's flat buffer, whose storage is released
outside the unit's forward and backward ([Note: parameter sharding] in
csrc/engines/sharded/core.h): the parameter keeps its shape and dtype but has no data, and
some torch kernels read such a tensor without checking (``p.norm()`` crashed the process).
So at prepare each sharded ``nn.Parameter`` gets the class :class:`ShardedParameter` (the
same object: ``param.__class__`` is swapped, as ``prepare()`` swaps the module's class,
src/mixprec/wrappers/model.py). Its ``__torch_function__`` lets metadata through
(``shape``, ``dtype``, ``requires_grad``, ``grad``, ``numel()``, ...) and checks every other
op: while the unit is gathered (inside forward/backward, or inside the gathering context)
the op runs as on a plain parameter; otherwise it raises :class:`UnshardedParameterError`
naming the parameter, its unit and the fix. A view taken while gathered (``p.data``,
``p.detach()``, ``p[0]``, the values of ``model.state_dict()``) aliases the same storage:
it gets the class :class:`GuardedView`, with the same check, so using it after the scope
raises too instead of reading freed memory. The prepared forward runs with subclass torch
functions disabled (``ForwardContext.run`` in src/mixprec/wrappers/model.py), so the check
costs nothing in training; backward and the optimizer never see the parameters through
Python (the C++ hooks and the fp32 master shards).

[Note: the gathering context]
``gathered_parameters(params_or_module, modifier_rank=None, writeback=False,
rank0_only=False)`` is a collective: every rank of the group enters it.
* zero3/fsdp: the units holding the given parameters are gathered (storage dtype) on entry
  and freed on exit by the outermost scope holding them; while a scope holds a unit the
  unit runner does not free it (a forward or ``generate()`` inside works). ``rank0_only``:
  the other ranks free their copy at once (their parameters stay guarded).
* single/ddp/zero1/zero2: the parameters are full already; nothing is gathered.
* ``modifier_rank=r``: on exit rank r's values are broadcast to every rank (ddp/zero1/zero2
  too, so the replicas stay identical), then written back. ``writeback=True`` without a
  modifier: each rank writes back the part of the masters it owns from its own values
  (FSDP1's rule), and the full copies are refreshed from the masters (zero1/2: the usual
  all-gather), so every rank ends with the same values.
* Write back: an element whose value changed inside the scope is copied into its fp32
  master (zero: the owned slice of the master shard, src/mixprec/engines/zero_state.py
  explains the owned ranges; single/ddp with low-precision storage: the MasterWeights
  master). Unchanged elements keep their fp32 master bits (no rounding through the
  storage dtype). Optimizer state is untouched.
* Nesting: an inner scope over already-held units gathers nothing; each scope asking for a
  write back does it on its own exit; the outermost scope frees.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import functools
import weakref
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import registry
from ..errors import UnshardedParameterError

_DisableTF = torch._C.DisableTorchFunctionSubclass

_FIX = ("Read or change it inside `with accelerator.gathered_parameters(model):` (also "
        "mixprec.GatheredParameters(params) / mixprec.summon_full_params(model); a collective: "
        "every rank enters it), or take the full fp32 values with "
        "accelerator.get_state_dict(model) (also a collective)")


def _metadata_funcs() -> set:
    """Tensor attributes and methods that read no data (allowed while not gathered)."""
    t = torch.Tensor
    props = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim",
             "layout", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
             "is_mkldnn", "is_nested", "output_nr", "_version", "_base", "itemsize", "nbytes",
             "_backward_hooks", "_post_accumulate_grad_hooks", "name", "is_mps", "is_xpu")
    methods = ("size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
               "is_floating_point", "is_complex", "is_signed", "element_size", "get_device",
               "__len__", "requires_grad_", "untyped_storage", "data_ptr", "_is_view",
               "register_hook", "register_post_accumulate_grad_hook", "__dir__", "is_shared",
               "_typed_storage", "storage")
    out = set()
    for name in props:
        attr = getattr(t, name, None)
        if attr is not None and hasattr(attr, "__get__"):
            out.add(attr.__get__)
            if name in ("requires_grad", "grad"):
                out.add(attr.__set__)
    for name in methods:
        attr = getattr(t, name, None)
        if attr is not None:
            out.add(attr)
    return out


_METADATA = _metadata_funcs()
_DATA_SET = torch.Tensor.data.__set__
_ALIAS_OK = {torch.Tensor.detach, torch.Tensor.data.__get__}  # aliases, allowed ungathered


class _Guard:
    """What a guarded tensor knows about its parameter: its name, its unit (held weakly:
    [Note: no reference cycles] in src/mixprec/engines/units.py) and the backend."""

    __slots__ = ("name", "unit_name", "unit_ref", "backend", "world")

    def __init__(self, name: str, unit, backend: str, world: int) -> None:
        self.name = name
        self.unit_name = unit.name or "<root>"
        self.unit_ref = weakref.ref(unit)
        self.backend = backend
        self.world = world

    def gathered(self) -> bool:
        unit = self.unit_ref()
        core = unit.core if unit is not None else None
        return core is not None and core.unsharded

    def error(self, what: str) -> UnshardedParameterError:
        unit = self.unit_ref()
        if unit is None or unit.core is None:
            message = (f"{self.backend}: parameter {self.name!r} (unit {self.unit_name!r}) cannot be "
                       f"read by {what}: the engine was released (accelerator.end_training() or "
                       "free_memory()), and each rank kept only its shard, which is gone. Take the "
                       "values with accelerator.get_state_dict(model) before end_training()")
        else:
            message = (f"{self.backend}: parameter {self.name!r} of sharding unit {self.unit_name!r} is "
                       f"not gathered, so {what} cannot read it: outside forward its unit's storage is "
                       f"freed and each of the {self.world} rank(s) holds only its shard (in the fp32 "
                       "master shards). " + _FIX)
        return UnshardedParameterError(message, params=(self.name,), units=(self.unit_name,))


def _op_name(func) -> str:
    """`Tensor.norm`, `torch.add`, `.data` (a property read)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", "?")
        return f"`.{prop}`" if name == "__get__" else f"`.{prop} = ...`"
    return f"`{getattr(func, '__qualname__', name)}`"


def _guards_in(args, kwargs):
    """The guarded tensors among an op's arguments (one level into lists/tuples)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, _GUARDED):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(b for b in a if isinstance(b, _GUARDED))
    return found


def _run_guarded(func, args, kwargs):
    kwargs = kwargs or {}
    if func in _METADATA:
        with _DisableTF():
            return func(*args, **kwargs)
    guarded = _guards_in(args, kwargs)
    if func == _DATA_SET and any(isinstance(g, ShardedParameter) for g in guarded):
        g = guarded[0]._mixprec_guard
        raise UnshardedParameterError(
            f"{g.backend}: `{g.name}.data = ...` would detach parameter {g.name!r} (unit "
            f"{g.unit_name!r}) from its shard, and the change would be lost. Write in place "
            "instead, inside the gathering context: `with accelerator.gathered_parameters(model, "
            "modifier_rank=0): p.copy_(value)`", params=(g.name,), units=(g.unit_name,))
    for g in guarded:
        guard = g._mixprec_guard
        if not guard.gathered():
            if func in _ALIAS_OK and len(guarded) == 1:
                # `p.detach()` / `p.data` read nothing: ``model.state_dict()`` (its keys and
                # shapes) works; the guarded view raises when its values are used.
                with _DisableTF():
                    out = func(*args, **kwargs)
                out.__class__ = GuardedView
                out._mixprec_guard = guard
                return out
            raise guard.error(_op_name(func))
    with _DisableTF():
        out = func(*args, **kwargs)
        if guarded:
            _guard_aliases(out, guarded)
    return out


def _guard_aliases(out, guarded) -> None:
    """Give a result that aliases a guarded tensor's storage (a view) the same guard."""
    if isinstance(out, (list, tuple)):
        for o in out:
            _guard_aliases(o, guarded)
        return
    if type(out) is not torch.Tensor:
        return
    ptr = out.untyped_storage().data_ptr()
    if ptr == 0:
        return
    for g in guarded:
        if g.untyped_storage().data_ptr() == ptr:
            out.__class__ = GuardedView
            out._mixprec_guard = g._mixprec_guard
            return


class ShardedParameter(nn.Parameter):
    """A zero3/fsdp parameter ([Note: guarded sharded parameters]): an ``nn.Parameter``
    whose data exists only while its unit is gathered. ``isinstance(p, nn.Parameter)``
    holds; pickling and ``copy.deepcopy`` give a plain ``nn.Parameter`` with the full
    values (inside the gathering context) or raise naming the fix."""

    _mixprec_guard: _Guard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _run_guarded(func, args, kwargs)

    def _plain_clone(self, what: str) -> torch.Tensor:
        guard = self._mixprec_guard
        if not guard.gathered():
            raise guard.error(what)
        with _DisableTF():
            return self.detach().clone()

    def __repr__(self, *args, **kwargs) -> str:
        guard = self._mixprec_guard
        if guard.gathered():
            with _DisableTF():
                return nn.Parameter.__repr__(self)
        return (f"ShardedParameter({guard.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"requires_grad={self.requires_grad}, unit={guard.unit_name!r}, not gathered: read "
                "it inside accelerator.gathered_parameters(...))")

    def __reduce_ex__(self, protocol):
        data = self._plain_clone("pickling (torch.save)")
        return torch._utils._rebuild_parameter, (data, self.requires_grad, collections.OrderedDict())

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        result = nn.Parameter(self._plain_clone("copy.deepcopy"), self.requires_grad)
        memo[id(self)] = result
        return result


class GuardedView(torch.Tensor):
    """A view of a zero3/fsdp parameter taken while its unit was gathered: usable while
    the unit is gathered, an :class:`UnshardedParameterError` afterwards."""

    _mixprec_guard: _Guard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _run_guarded(func, args, kwargs)

    def _plain(self, what: str) -> torch.Tensor:
        guard = self._mixprec_guard
        if not guard.gathered():
            raise guard.error(what)
        with _DisableTF():
            return self.as_subclass(torch.Tensor)

    def __repr__(self, *args, **kwargs) -> str:
        guard = self._mixprec_guard
        if guard.gathered():
            with _DisableTF():
                return torch.Tensor.__repr__(self)
        return (f"GuardedView(of {guard.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"unit={guard.unit_name!r}, not gathered)")

    def __reduce_ex__(self, protocol):
        return self._plain("pickling (torch.save)").__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with _DisableTF():
            result = self._plain("copy.deepcopy").clone()
        memo[id(self)] = result
        return result


_GUARDED = (ShardedParameter, GuardedView)


def guard_params(model: nn.Module, units, backend: str, world: int) -> int:
    """Swap the class of every sharded ``nn.Parameter`` of ``model`` to
    :class:`ShardedParameter` (units: the UnitRunner's units). Parameters of another class
    (a user's own Parameter subclass) are left as they are. Returns how many were guarded."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    count = 0
    for unit in units:
        core = unit.core
        if core is None or not hasattr(core, "params"):
            continue
        for p in core.params:
            if type(p) is nn.Parameter:
                p.__class__ = ShardedParameter
                p._mixprec_guard = _Guard(names.get(id(p), "?"), unit, backend, world)
                count += 1
    if count:
        _install_save_guard()
    return count


def is_guarded(t: torch.Tensor) -> bool:
    return isinstance(t, _GUARDED)


# [Note: torch.save refuses before writing]
# Pickling an ungathered zero3/fsdp parameter (or a view of one) raises, but torch.save has
# opened (and truncated) its file by then and closes it on the way out: a truncated file
# would be left, maybe in place of a good one. So once a parameter is guarded, torch.save
# is wrapped: the object is searched for ungathered guarded tensors first (containers,
# modules' parameters and buffers, a few levels deep) and the error is raised before the
# file is touched. Anything else goes to torch's own torch.save unchanged; the pickling
# error stays the last line of defence for tensors hidden deeper in other objects.
_SAVE_SCAN_DEPTH = 6


def _ungathered_in(obj, depth: int = 0):
    """The first guarded tensor in ``obj`` whose unit is not gathered, or None."""
    if isinstance(obj, _GUARDED):
        return None if obj._mixprec_guard.gathered() else obj
    if depth >= _SAVE_SCAN_DEPTH or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return None
    if isinstance(obj, nn.Module):
        items = [t for _, t in obj.named_parameters(remove_duplicate=False)]
        items += [t for _, t in obj.named_buffers()]
    elif isinstance(obj, collections.abc.Mapping):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        return None
    for item in items:
        found = _ungathered_in(item, depth + 1)
        if found is not None:
            return found
    return None


def refuse_ungathered_save(obj, what: str = "torch.save") -> None:
    """Raise :class:`UnshardedParameterError` when ``obj`` holds an ungathered zero3/fsdp
    parameter (or a view of one), before anything is written."""
    found = _ungathered_in(obj)
    if found is not None:
        error = found._mixprec_guard.error(what)
        raise UnshardedParameterError(f"{error} (refused before writing: no file was created or changed)",
                                      params=error.params, units=error.units)


def _install_save_guard() -> None:
    """Wrap ``torch.save`` once ([Note: torch.save refuses before writing])."""
    current = torch.save
    if getattr(current, "_mixprec_save_guard", False):
        return

    @functools.wraps(current)
    def save(obj, f, *args, **kwargs):
        refuse_ungathered_save(obj)
        return current(obj, f, *args, **kwargs)

    save._mixprec_save_guard = True
    torch.save = save


# ---------------------------------------------------------------- the gathering context
def _params_of(target) -> list[torch.Tensor]:
    if isinstance(target, nn.Module):
        params = list(target.parameters())
    elif isinstance(target, torch.Tensor):
        params = [target]
    elif isinstance(target, Iterable):
        params = list(target)
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"gathered_parameters: got {bad[0]} among the parameters; give a "
                            "module, a parameter, or an iterable of parameters")
    else:
        raise TypeError(f"gathered_parameters: got {type(target).__name__}; give a module, a "
                        "parameter, or an iterable of parameters")
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GatheredScope:
    """One ``with`` of the gathering context ([Note: the gathering context])."""

    def __init__(self, comm, target, modifier_rank: Optional[int] = None, writeback: bool = False,
                 rank0_only: bool = False, enabled: bool = True, *, master_of: Optional[dict] = None) -> None:
        self.comm = comm
        self.master_of = master_of or {}  # id(low-precision param) -> fp32 master (single/ddp)
        self.params = _params_of(target)
        self.enabled = bool(enabled)
        group = getattr(self.comm, "group", None)
        distributed = dist.is_available() and dist.is_initialized() and getattr(self.comm, "distributed", False)
        self.group = group
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                                          or not 0 <= modifier_rank < self.world):
            raise ValueError(f"modifier_rank={modifier_rank!r} must be None or a rank in [0, {self.world}) "
                             "of the group (the rank whose values are kept and broadcast)")
        if not isinstance(writeback, bool) or not isinstance(rank0_only, bool):
            raise ValueError(f"writeback={writeback!r} and rank0_only={rank0_only!r} must be True or False")
        if rank0_only and (writeback or modifier_rank is not None):
            raise ValueError(
                f"rank0_only=True with writeback={writeback} / modifier_rank={modifier_rank}: only "
                "rank 0 holds the values, so the other ranks' masters cannot be written from them "
                "(FSDP1 refuses it too). Use rank0_only=False with modifier_rank=0 to edit")
        self.modifier_rank = modifier_rank
        self.writeback = writeback or modifier_rank is not None
        self.rank0_only = rank0_only
        self._gathered: list = []  # cores this scope gathered (and frees on exit)
        self._cores: list = []  # cores of the given parameters, in engine order
        self._snapshot: dict[int, torch.Tensor] = {}

    # -------------------------------------------------------------- pieces
    def _sharded(self) -> bool:
        return hasattr(self.comm, "all_cores")

    def _shards_params(self) -> bool:
        return self._sharded() and bool(self.comm.options.shard_params)

    def __enter__(self):
        if not self.enabled:
            return self.params
        comm = self.comm
        if self._sharded():
            wanted = {id(p) for p in self.params}
            self._cores = [c for c in comm.all_cores() if any(id(p) in wanted for p in c.params)]
        if self._shards_params():
            pins = comm.gather_pins
            launched = []
            for core in self._cores:
                if pins.get(id(core), 0) == 0 and not core.unsharded:
                    core.unshard(True)
                    launched.append(core)
                pins[id(core)] = pins.get(id(core), 0) + 1
            for core in launched:
                core.wait_unshard()
            self._gathered = launched
            if self.rank0_only and self.rank != 0:
                for core in launched:
                    core.reshard()
        if self.writeback:
            with _DisableTF(), torch.no_grad():
                self._snapshot = {id(p): p.detach().clone() for p in self.params}
        return self.params

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        try:
            if self.writeback and exc_type is None:
                with _DisableTF(), torch.no_grad():
                    self._write_back()
        finally:
            self._snapshot = {}
            if self._shards_params():
                pins = self.comm.gather_pins
                for core in self._cores:
                    pins[id(core)] -= 1
                    if pins[id(core)] == 0:
                        del pins[id(core)]
                for core in self._gathered:
                    if id(core) not in pins:
                        core.reshard()

    def _write_back(self) -> None:
        params = self.params
        if self.modifier_rank is not None and self.world > 1:
            src = dist.get_global_rank(self.group, self.modifier_rank) if self.group is not None \
                else self.modifier_rank
            for p in params:
                dist.broadcast(p.detach(), src=src, group=self.group)
        changed = {}
        for p in params:
            old = self._snapshot[id(p)]
            new = p.detach()
            if not torch.equal(old, new):
                changed[id(p)] = (new, old)
                torch.autograd.graph.increment_version(p)  # stale weight casts (weight_casts.py)
        if self._sharded():
            for core in self._cores:
                master = core.master_shard
                cparams = core.params
                for index, _bucket, shard_off, param_off, numel in core.owned_ranges():
                    entry = changed.get(id(cparams[index]))
                    if entry is None or numel == 0:
                        continue
                    new, old = entry
                    new_part = new.reshape(-1).narrow(0, param_off, numel)
                    old_part = old.reshape(-1).narrow(0, param_off, numel)
                    slot = master.narrow(0, shard_off, numel)
                    slot.copy_(torch.where(new_part != old_part, new_part.to(slot.dtype), slot))
            self._refresh_full_copies()
        else:
            master_of = self.master_of
            for p in params:
                entry = changed.get(id(p))
                master = master_of.get(id(p))
                if entry is not None and master is not None:
                    new, old = entry
                    master.copy_(torch.where(new != old, new.to(master.dtype), master))

    def _refresh_full_copies(self) -> None:
        """After a write back: every rank's full copy equals the masters' rounding (a
        collective; the same on every rank since every rank runs the same scope)."""
        if not self._shards_params():
            for core in self._cores:  # zero1/2: the all-gather a step ends with
                core.gather_params()
            return
        if self.modifier_rank is not None:
            return  # the broadcast already made every rank's copy the same
        pins, mine = self.comm.gather_pins, {id(c) for c in self._gathered}
        for core in self._cores:
            # A core this scope frees on exit needs no refresh; one held on (an outer scope,
            # a forward in progress) is gathered again from the masters.
            stays = pins.get(id(core), 0) > 1 or id(core) not in mine
            if core.unsharded and stays:
                core.reshard()
                core.unshard(False)


def scope_for(engine, target, **options) -> GatheredScope:
    """The gathering context over ``engine`` (Accelerator.gathered_parameters)."""
    return GatheredScope(engine.comm, target, master_of=engine.precision.master_of, **options)


def root_unit_scope(model: nn.Module):
    """The gathering scope over ``model``'s root-unit parameters (embeddings, head, final
    norms) for ``generate()`` ([Note: the root unit during generate()] in
    parallel/generation.py), on the engine of the live Accelerator that prepared it; a null
    context when none is guarded (a copy of the model)."""
    root = [p for p in model.parameters() if is_guarded(p) and p._mixprec_guard.unit_name == "<root>"]
    return GatheredParameters(root) if root else contextlib.nullcontext()


def find_engine(params: list[torch.Tensor], api: str):
    """The engine of the live Accelerator that prepared the model holding ``params``."""
    wanted = {id(p) for p in params}
    for acc in registry.running():
        for model in acc.prepared.models:
            if any(id(p) in wanted for p in model.parameters()):
                return acc.engine
    raise ValueError(
        f"{api}: none of the {len(params)} given parameter(s) belongs to a model prepared by a live "
        "Accelerator; call accelerator.prepare(model) first (or use "
        "accelerator.gathered_parameters(...) on the accelerator that prepared it)")


def GatheredParameters(params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
                       modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True,
                       *, writeback: bool = False, rank0_only: bool = False) -> GatheredScope:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters`` argument names over
    :meth:`mixprec.Accelerator.gathered_parameters` (same implementation)::

        with mixprec.GatheredParameters(model.head.weight, modifier_rank=0):
            if accelerator.is_main_process:
                torch.nn.init.zeros_(model.head.weight)

    ``fwd_module`` is accepted for DeepSpeed compatibility and not used (mixprec needs no
    external-parameter registration)."""
    plist = _params_of(params)
    return scope_for(find_engine(plist, "GatheredParameters"), plist, modifier_rank=modifier_rank,
                         writeback=writeback, rank0_only=rank0_only, enabled=enabled)


def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False) -> GatheredScope:
    """FSDP1's ``summon_full_params`` argument names over
    :meth:`mixprec.Accelerator.gathered_parameters` (same implementation). ``writeback``
    defaults to True as in FSDP1. ``recurse=False`` (only the module's own parameters),
    ``offload_to_cpu=True`` and ``with_grads=True`` are not supported and raise."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"summon_full_params: got {type(module).__name__}; give the prepared module")
    if not recurse or offload_to_cpu or with_grads:
        raise NotImplementedError(
            f"summon_full_params(recurse={recurse}, offload_to_cpu={offload_to_cpu}, "
            f"with_grads={with_grads}): mixprec gathers whole units in place; use the defaults "
            "(recurse=True, offload_to_cpu=False, with_grads=False)")
    plist = _params_of(module)
    return scope_for(find_engine(plist, "summon_full_params"), plist, writeback=writeback,
                         rank0_only=rank0_only)
