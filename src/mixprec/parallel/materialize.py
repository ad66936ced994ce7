"""Models built without memory (``init_empty_weights``), given real weights at ``prepare()``.

[Note: materialising a meta model shard by shard]
``accelerator.init_empty_weights()`` (Accelerate's ``init_empty_weights``) builds a model whose
parameters live on the meta device: shapes and dtypes, no storage. ``prepare()`` gives them
values, one module at a time, on the device it trains on:

- every parameter of the module is allocated whole, filled with NaN, and initialised by the
  model's own rule: a Hugging Face model's ``_init_weights(module)`` (the rule
  ``from_config`` applies), else the module's ``reset_parameters()`` (torch's layers). A
  parameter that stays NaN was initialised by nobody: an error names it (never garbage);
- under tensor parallelism the module is materialised right before it is split, and only
  this rank's slice is kept, so a rank holds its shards plus one whole module at a time,
  never the whole model (benchmarks/bench_tp_init.py measures the peak with the OS);
- the values depend on nothing but one seed and the parameter's name: each module draws
  from ``manual_seed(seed + crc32(name))`` on a forked RNG (the caller's RNG stream is left
  as it was), and the seed is drawn from the caller's RNG and broadcast from rank 0. So every
  rank materialises the same whole tensor, and a TP=2 run slices exactly the weights a TP=1
  or one-process run materialises from the same seed (tests/distributed/test_materialize.py);
- a parameter shared by several modules (tied embeddings) is materialised once, and every
  owner points at the one new tensor.

Buffers are created for real inside ``init_empty_weights`` (``include_buffers=False``, as in
Accelerate): rotary tables and masks are computed by the modules' constructors.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.devices import group_device
from . import pretrained

MATERIALIZED_ATTR = "_mixprec_materialized"  # id(meta parameter) -> (weakref to it, its name)


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Parameters (and, with ``include_buffers``, buffers) created inside are on the meta
    device: a model of any size is built without memory; ``prepare()`` materialises it
    ([Note: materialising a meta model shard by shard])."""
    old_param = nn.Module.register_parameter
    old_buffer = nn.Module.register_buffer

    loading = pretrained.TransformersLoading()  # [Note: loading a shard, not the model]

    def register_parameter(module, name, param):
        loading.patch()
        old_param(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = _on_meta(module._parameters[name])

    def register_buffer(module, name, buffer, persistent=True):
        old_buffer(module, name, buffer, persistent=persistent)
        if buffer is not None:
            module._buffers[name] = module._buffers[name].to("meta")

    nn.Module.register_parameter = register_parameter
    if include_buffers:
        nn.Module.register_buffer = register_buffer
    loading.patch()
    try:
        yield
    finally:
        loading.restore()
        nn.Module.register_parameter = old_param
        nn.Module.register_buffer = old_buffer


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    """``param`` on the meta device, same class and attributes. Attributes such as
    transformers' ``_is_hf_initialized`` are set after construction, not constructor
    arguments, so they are copied onto the new parameter rather than passed to it."""
    cls = type(param)
    try:
        out = cls(param.to("meta"), requires_grad=param.requires_grad)
    except TypeError:  # a subclass whose constructor takes other arguments
        out = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    out.__dict__.update(param.__dict__)
    return out


def to_device(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` for a model with meta parameters: the real parameters and
    buffers move, the meta ones stay for the materializer."""
    with torch.no_grad():
        for m in model.modules():
            for k, p in m._parameters.items():
                if p is not None and not p.is_meta and p.device != device:
                    p.data = p.data.to(device)
            for k, b in m._buffers.items():
                if b is not None and not b.is_meta:
                    m._buffers[k] = b.to(device)


def has_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


class Materializer:
    """Gives a meta model's parameters their values, module by module (see the Note)."""

    def __init__(self, model: nn.Module, device: torch.device, group: Any = None) -> None:
        metas = [n for n, b in model.named_buffers() if b.is_meta]
        if metas:
            raise ValueError(
                f"buffer {metas[0]!r} ({len(metas)} buffer(s)) is on the meta device: prepare() materialises "
                "parameters only (buffers hold computed values such as rotary tables). Build the model with "
                "accelerator.init_empty_weights() (include_buffers=False, the default)")
        self.model = model
        self.device = device
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            on = seed.to(group_device(group))  # [Note: collectives on the group's device]
            dist.broadcast(on, src=dist.get_global_rank(group, 0), group=group)
            seed = on.cpu()
        self.seed = int(seed.item())
        self.init = getattr(model, "_init_weights", None) if hasattr(model, "config") else None
        self.source = pretrained.source_of(model)  # [Note: loading a shard, not the model]
        self.names: dict[int, list[str]] = {}  # every name of a meta parameter (tied: several)
        self.owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for mname, module in model.named_modules(remove_duplicate=False):
            for pname, p in module._parameters.items():
                if p is not None and p.is_meta:
                    self.names.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
                    self.owners.setdefault(id(p), []).append((module, pname))
        # An optimizer built before prepare() holds the meta parameters: prepare_optimizer
        # gives it their replacements (swap_optimizer_params in parallel/tensor).
        self.replaced = model.__dict__.setdefault(MATERIALIZED_ATTR, {})

    def module(self, name: str, module: nn.Module) -> dict:
        """Materialise ``module``'s own parameters (whole) where they are still meta; returns
        ``{id(meta parameter): its new parameter}``."""
        metas = [(pname, p) for pname, p in module._parameters.items() if p is not None and p.is_meta]
        if not metas:
            return {}
        stored = {pname: self._stored(p) for pname, p in metas}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed((self.seed + zlib.crc32(name.encode())) % 2**63)
            new = {}
            if any(v is None for v in stored.values()):  # the model's init rule for what the file lacks
                for pname, p in metas:
                    t = torch.full(p.shape, float("nan"), dtype=p.dtype, device=self.device) \
                        if p.dtype.is_floating_point else torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                    new[pname] = nn.Parameter(t, requires_grad=p.requires_grad)
                    module._parameters[pname] = new[pname]
                self._initialise(name, module)
            for pname, p in metas:  # the checkpoint's values replace any initialised ones
                if stored[pname] is not None:
                    new[pname] = nn.Parameter(stored[pname], requires_grad=p.requires_grad)
                    module._parameters[pname] = new[pname]
            for pname, p in metas:
                t = new[pname]
                if stored[pname] is None and t.dtype.is_floating_point and bool(torch.isnan(t).any()):
                    raise ValueError(
                        f"{name}.{pname} ({type(module).__name__}): built on the meta device, and neither the "
                        f"model's _init_weights nor the module's reset_parameters() gave it values. Initialise it "
                        "in your model's _init_weights / the module's reset_parameters(), or build the model "
                        "without init_empty_weights()")
                for owner, attr in self.owners.get(id(p), [(module, pname)]):  # tied: one tensor everywhere
                    owner._parameters[attr] = t
                self.replaced[id(p)] = (weakref.ref(p), self.names[id(p)][0])
        return {id(p): new[pname] for pname, p in metas}

    def _stored(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """``p``'s value in the model's checkpoint, a view of the mapped file on the CPU
        (read only where it is copied), or None without one."""
        if self.source is None:
            return None
        value = self.source.value(self.names.get(id(p), []), p.dtype)
        return None if value is None else value.to(self.device)

    def rest(self) -> None:
        """Every parameter still on the meta device (modules no split touched); then the
        whole tensors freed along the way go back to the OS (glibc keeps freed heap chunks
        resident otherwise, and they would count in the rank's memory until reused)."""
        for name, module in self.model.named_modules():
            self.module(name, module)
        trim_heap()

    def _initialise(self, name: str, module: nn.Module) -> None:
        if callable(self.init):
            self.init(module)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and self._still_nan(module):
            reset()

    @staticmethod
    def _still_nan(module: nn.Module) -> bool:
        return any(p.dtype.is_floating_point and bool(torch.isnan(p).any())
                   for p in module.parameters(recurse=False))


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)`` where it exists (Linux); nothing elsewhere."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def materialize(model: nn.Module, device: torch.device, group: Optional[Any] = None) -> None:
    """Every meta parameter of ``model`` materialised whole (no tensor parallelism)."""
    if has_meta(model):
        Materializer(model, device, group).rest()
