"""``Accelerator.join_uneven_inputs``: ranks whose data ran out shadow the others' collectives.

[Note: shadowing by announcement]
With ``even_batches=False`` ranks may get different numbers of batches. A rank that runs
out leaves the ``with`` block while the others still run forwards, backwards and optimizer
steps whose collectives (zero3/fsdp parameter gathers, gradient reductions, sharded steps,
clipping norms) need every rank. Inside the block, each such operation of a joined model
or optimizer is first *announced* by the ranks that still have data: one small all-reduce
of ``(1, op, index, flags)`` per forward (a forward pre-hook), per backward (an identity
autograd function on the model's outputs, whose backward runs before any gradient reaches
the model, hence before the engine's own backward collectives) and per real optimizer step
(the first pre-step hook). A rank that left the block all-reduces zeros in a loop: the sum
tells it how many ranks are active and which operation they are about to run, and it runs
the same one on the same engine, so the same collectives are issued in the same order:

* forward: the model on the last input this rank gave it inside the block (same shapes,
  same gathers), under the grad mode the active ranks used;
* backward: ``0 * sum(outputs)`` of that forward, through ``accelerator.backward`` when the
  active ranks used it (else ``.backward()``), inside ``no_sync`` when they were: this rank
  contributes zero gradients, as torch's ``Join`` with DDP does, and receives the reduced
  ones;
* optimizer step: the prepared optimizer's step on those reduced gradients (the same update
  the active ranks apply, so the models stay identical), then ``zero_grad``;
* ``accelerator.clip_grad_norm_`` called by the loop (a collective on the sharded
  engines): the same clip over the joined models' parameters, ``max_norm`` and
  ``norm_type`` sent with the announcement (a MAX all-reduce, exact).

When the sum says no rank is active, every rank has left and all return. Other collectives
the loop issues inside the block (``gather``, ``reduce``, ``wait_for_everyone``...) are not
shadowed, as with torch's ``Join``: the desync detection names them
(docs/troubleshooting.md). Accumulation windows that close at different micro-batches on
different ranks (each rank's last batch closes its window) make the announcements disagree:
every rank raises a RuntimeError saying so, instead of waiting. A rank with no input yet for a model it
must shadow raises a RuntimeError naming the fix.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .utils import tree_map_tensors
from .wrappers.optimizer import PreparedOptimizer

if TYPE_CHECKING:
    from .accelerator import Accelerator

FORWARD, BACKWARD, STEP, CLIP = 1, 2, 3, 4
_GRAD, _NO_SYNC, _VIA_ACCELERATOR = 1, 2, 4


class _Announce(torch.autograd.Function):
    """Identity; its backward announces the model's backward once per forward."""

    @staticmethod
    def forward(ctx, join: "Join", index: int, token: list, t: torch.Tensor):
        ctx.join, ctx.index, ctx.token = join, index, token
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.token[0]:
            ctx.token[0] = True
            ctx.join.announce_backward(ctx.index)
        return None, None, None, grad


class Join:
    """One ``join_uneven_inputs`` block ([Note: shadowing by announcement])."""

    def __init__(self, accelerator: "Accelerator", joinables: Iterable[Any]) -> None:
        self.acc = accelerator
        self.models: list[nn.Module] = []
        self.optimizers: list[PreparedOptimizer] = []
        for obj in joinables:
            if isinstance(obj, PreparedOptimizer):
                self.optimizers.append(obj)
            elif isinstance(obj, nn.Module):
                self.models.append(obj)
            else:
                raise TypeError(
                    f"join_uneven_inputs() got a {type(obj).__module__}.{type(obj).__qualname__}; it joins "
                    f"models and optimizers returned by accelerator.prepare(), e.g. join_uneven_inputs([model, optimizer])"
                )
        self.group = accelerator.state.group
        self.comm_device = accelerator.device if accelerator.state.backend == "nccl" else torch.device("cpu")
        self.inputs: dict[int, tuple] = {}  # model index -> (args, kwargs) of its last forward here
        self.outputs: dict[int, Any] = {}  # model index -> the last shadow forward's output
        self.shadowing = False
        self.via_accelerator = False  # inside accelerator.backward (set by the Accelerator)
        self.in_step = False  # inside an announced step (its own clipping is part of it)
        self.handles: list = []

    # ------------------------------------------------------------ active ranks
    def install(self) -> None:
        for i, model in enumerate(self.models):
            # First before the forward (ahead of the engine's own hooks, which may gather
            # parameters), last after it (the announcing wrapper is outermost in backward).
            self.handles.append(model.register_forward_pre_hook(self._pre_forward(i), with_kwargs=True, prepend=True))
            self.handles.append(model.register_forward_hook(self._post_forward(i)))
        for i, opt in enumerate(self.optimizers):
            hook = self._pre_step(i)
            opt.pre_step_hooks.insert(0, hook)  # before clipping, which may communicate
            self.handles.append(_ListHandle(opt.pre_step_hooks, hook))
            after = self._post_step
            opt.post_step_hooks.append(after)
            self.handles.append(_ListHandle(opt.post_step_hooks, after))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _flags(self, model: Optional[nn.Module], grad: bool) -> int:
        flags = _GRAD if grad else 0
        if model is not None and self.acc._no_sync_depth.get(id(model), 0) > 0:
            flags |= _NO_SYNC
        if self.via_accelerator:
            flags |= _VIA_ACCELERATOR
        return flags

    def _pre_forward(self, index: int):
        def hook(module, args, kwargs):
            if self.shadowing:
                return None
            self.inputs[index] = (args, kwargs)
            self._send(FORWARD, index, self._flags(module, torch.is_grad_enabled()))
            return None
        return hook

    def _post_forward(self, index: int):
        def hook(module, args, output):
            if self.shadowing or not torch.is_grad_enabled():
                return None
            token = [False]

            def wrap(t: torch.Tensor) -> torch.Tensor:
                if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                    return _Announce.apply(self, index, token, t)
                return t

            return tree_map_tensors(wrap, output)
        return hook

    def announce_backward(self, index: int) -> None:
        self._send(BACKWARD, index, self._flags(self.models[index], True))

    def _pre_step(self, index: int):
        def hook(optimizer):
            if not self.shadowing:
                self._send(STEP, index, 0)
                self.in_step = True
        return hook

    def _post_step(self, optimizer, result) -> None:
        self.in_step = False

    def announce_clip(self, max_norm: float, norm_type: float) -> None:
        """Called by ``accelerator.clip_grad_norm_`` inside the block."""
        if self.shadowing or self.in_step:
            return
        self._send(CLIP, 0, 0)
        dist.all_reduce(torch.tensor([float(max_norm), float(norm_type)], dtype=torch.float64,
                                     device=self.comm_device), op=dist.ReduceOp.MAX, group=self.group)

    def _send(self, op: int, index: int, flags: int) -> None:
        t = torch.tensor([1, op, index, flags], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, group=self.group)
        self._check(t, (op, index, flags))

    def _check(self, t: torch.Tensor, mine: Optional[tuple]) -> Optional[tuple]:
        count, op, index, flags = (int(x) for x in t.tolist())
        if count == 0:
            return None
        got = (op // count, index // count, flags // count)
        if any(v % count for v in (op, index, flags)) or (mine is not None and got != mine):
            raise RuntimeError(
                f"join_uneven_inputs(): the {count} ranks that still have data are not running the same "
                f"operation (sums op={op}, joinable={index}, flags={flags}); every rank must run the same "
                f"forward/backward/step sequence on the joined models and optimizers"
            )
        return got

    # ------------------------------------------------------------ joined rank
    def shadow_until_all_joined(self) -> None:
        while True:
            t = torch.zeros(4, dtype=torch.int64, device=self.comm_device)
            dist.all_reduce(t, group=self.group)
            got = self._check(t, None)
            if got is None:
                return
            op, index, flags = got
            self.shadowing = True
            try:
                if op == FORWARD:
                    self._shadow_forward(index, flags)
                elif op == BACKWARD:
                    self._shadow_backward(index, flags)
                elif op == STEP:
                    self._shadow_step(index)
                elif op == CLIP:
                    self._shadow_clip()
            finally:
                self.shadowing = False

    def _shadow_forward(self, index: int, flags: int) -> None:
        if index not in self.inputs:
            raise RuntimeError(
                f"join_uneven_inputs(): rank {self.acc.process_index} ran out of data before its first forward "
                f"of joined model {index}, so it has no input to shadow the other ranks' forwards with; give "
                f"every rank at least one batch (a dataset of at least {self.acc.num_processes} batches)"
            )
        args, kwargs = self.inputs[index]
        model = self.models[index]
        self.outputs.pop(index, None)
        with torch.set_grad_enabled(bool(flags & _GRAD)):
            self.outputs[index] = model(*args, **kwargs)

    def _shadow_backward(self, index: int, flags: int) -> None:
        out = self.outputs.pop(index, None)
        leaves: list[torch.Tensor] = []
        tree_map_tensors(lambda t: leaves.append(t) or t, out)
        leaves = [t for t in leaves if t.requires_grad and t.is_floating_point()]
        if not leaves:
            raise RuntimeError(
                f"join_uneven_inputs(): the other ranks ran a backward through joined model {index}, but this "
                f"rank's shadow forward gave no output that requires grad"
            )
        loss = sum(t.float().sum() for t in leaves) * 0.0
        model = self.models[index]
        ctx = self.acc.no_sync(model) if flags & _NO_SYNC else contextlib.nullcontext()
        with ctx:
            if flags & _VIA_ACCELERATOR:
                self.acc.backward(loss)
            else:
                loss.backward()

    def _shadow_clip(self) -> None:
        values = torch.full((2,), float("-inf"), dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        max_norm, norm_type = values.tolist()
        self.acc.clip_grad_norm_([p for m in self.models for p in m.parameters()], max_norm, norm_type)

    def _shadow_step(self, index: int) -> None:
        opt = self.optimizers[index]
        gs = opt._gradient_state
        saved = gs.sync_gradients
        gs.sync_gradients = True  # the active ranks stepped for real
        try:
            opt.step()
            opt.zero_grad()
        finally:
            gs.sync_gradients = saved


class _ListHandle:
    def __init__(self, items: list, item: Any) -> None:
        self.items, self.item = items, item

    def remove(self) -> None:
        if self.item in self.items:
            self.items.remove(self.item)


@contextlib.contextmanager
def join_uneven_inputs(accelerator: "Accelerator", joinables: Any, even_batches: Optional[bool] = None):
    """See :meth:`mixprec.Accelerator.join_uneven_inputs`."""
    if isinstance(joinables, (nn.Module, PreparedOptimizer)):
        joinables = [joinables]
    joinables = list(joinables)
    bad = [obj for obj in joinables if not isinstance(obj, (nn.Module, PreparedOptimizer))]
    if bad:
        raise TypeError(
            f"join_uneven_inputs() got a {type(bad[0]).__module__}.{type(bad[0]).__qualname__}; it joins models "
            f"and optimizers returned by accelerator.prepare(), e.g. join_uneven_inputs([model, optimizer])"
        )
    overridden: list[tuple[Any, bool]] = []
    if even_batches is not None:
        iterable_seen = False
        for loader in accelerator._dataloaders:
            sampler = getattr(loader.dataloader, "batch_sampler", None)
            if sampler is not None and hasattr(sampler, "even_batches"):
                overridden.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
            elif isinstance(loader.dataloader.dataset, torch.utils.data.IterableDataset) or \
                    type(loader.dataloader).__name__ == "DispatchedLoader":  # rank 0 reads: nothing to override
                iterable_seen = True
        if iterable_seen:
            warnings.warn(
                "join_uneven_inputs(even_batches=...): overriding even_batches is only supported for map-style "
                "datasets, yet some prepared dataloaders are iterable; those keep their setting",
                UserWarning, stacklevel=3,
            )
    else:
        even_batches = accelerator.even_batches
    try:
        if even_batches or accelerator.num_processes == 1:
            yield joinables  # every rank gets the same number of batches: nothing to shadow
            return
        if accelerator.mesh is not None:
            raise NotImplementedError(
                "join_uneven_inputs() with even_batches=False is not supported under tensor or sequence "
                "parallelism: the ranks of a TP/SP group read the same batches and run collectives among "
                "themselves that a joined group cannot shadow; keep even_batches=True"
            )
        join = Join(accelerator, joinables)
        join.install()
        accelerator._join = join
        ok = False
        try:
            yield joinables
            ok = True
        finally:
            join.remove()
            accelerator._join = None
        if ok:
            join.shadow_until_all_joined()
    finally:
        for sampler, value in overridden:
            sampler.even_batches = value
