"""Preparation: ``prepare()`` and what it does to models, optimizers and schedulers
(dataloaders: facade/loaders.py).

A model goes through tensor parallelism, the engine, sequence parallelism and activation
checkpointing in one ordered function (parallel/compose.py); an optimizer is handed to the
engine (pointed at the fp32 masters or the shards), with the automatic clipping and the
fp16 overflow watch as its hooks; a scheduler follows the optimizer steps.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..compat import state as compat_state
from ..diagnostics.overflow import OverflowWatch, check_overflow_budget
from ..engines.gathered import is_guarded
from ..parallel import materialize, pretrained
from ..parallel import tensor as tensor_parallel
from ..parallel.compose import compose
from ..startup import startup_line
from ..wrappers.model import is_prepared, restore_class
from ..wrappers.optimizer import PreparedOptimizer
from ..wrappers.scheduler import PreparedScheduler

_SUPPORTED = "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, LR scheduler"


@dataclasses.dataclass(frozen=True)
class PreparedObjects:
    """What an Accelerator prepared, in prepare() order (live lists: read, do not mutate).
    ``save_state``/``load_state`` (src/mixprec/checkpoint/state.py) go through this view
    and the engine's checkpoint contract, not through the Accelerator's internals."""

    models: list
    optimizers: list
    schedulers: list
    dataloaders: list

    def raw_optimizers(self) -> list:
        """The users' torch optimizers behind the prepared ones."""
        return [o.optimizer for o in self.optimizers]


class StaleGradientsWarning(UserWarning):
    """``prepare()`` cleared gradients a backward before it left on the model's parameters."""


class Preparation:
    """Mixin of :class:`mixprec.Accelerator`: ``prepare`` and the models, optimizers and
    schedulers it wraps (into ``_models``, ``_optimizers``, ``_schedulers``)."""

    def _start_preparation(self, cfg: Any, scheduler_step_rule: str) -> None:
        """The settings prepared objects follow, from the resolved config."""
        self.scheduler_step_rule = scheduler_step_rule
        self.step_scheduler_with_optimizer = cfg.step_scheduler_with_optimizer
        # Clip to this norm before every real step the user did not clip (None: off).
        self.gradient_clipping: Optional[float] = cfg.gradient_clipping
        # fp16: consecutive overflow-skipped steps tolerated before raising (None: never).
        self.max_consecutive_overflows: Optional[int] = cfg.max_consecutive_overflows
        check_overflow_budget(self.max_consecutive_overflows)
        self._log_policy = cfg.log_policy  # the start-up line at the first prepared model

    def _check_not_reset(self) -> None:
        """After ``AcceleratorState._reset_state()`` an Accelerator made before it cannot
        prepare, as in Accelerate ([Note: state objects backed by the live Accelerator] in
        compat/state.py)."""
        if self.__dict__.get("_state_reset"):
            raise AttributeError(compat_state.RESET_MESSAGE.format(name="distributed_type"))

    def prepare(self, *objs: Any, device_placement: Optional[list] = None):
        """Wrap models, optimizers, dataloaders and schedulers; returned in the order given.

        Models are prepared first, then optimizers (so they can be pointed at fp32
        masters), then schedulers and dataloaders. ``device_placement``, as in Accelerate: one
        bool (or None) per object, handed to ``prepare_model``/``prepare_optimizer``/
        ``prepare_data_loader`` (schedulers ignore theirs).
        """
        self._check_not_reset()
        if device_placement is None:
            device_placement = [None] * len(objs)
        elif len(device_placement) != len(objs):
            raise ValueError(
                f"prepare(device_placement={device_placement!r}) has {len(device_placement)} entries for "
                f"{len(objs)} objects; give one bool (or None) per object passed"
            )
        for obj in objs:
            if not isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)) and not _is_scheduler(obj):
                raise TypeError(
                    f"prepare() got an object of type {type(obj).__module__}.{type(obj).__qualname__}, "
                    f"which it cannot wrap; it accepts: {_SUPPORTED}. Pass the others to your loop as they are."
                )
        out: list[Any] = list(objs)
        for i, obj in enumerate(objs):
            if isinstance(obj, nn.Module):
                out[i] = self.prepare_model(obj, device_placement=device_placement[i])
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self.prepare_optimizer(obj, device_placement=device_placement[i])
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.utils.data.DataLoader):
                out[i] = self.prepare_data_loader(obj, device_placement=device_placement[i])
            elif _is_scheduler(obj):
                out[i] = self.prepare_scheduler(obj)
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def init_empty_weights(include_buffers: bool = False):
        """Accelerate's ``init_empty_weights``: parameters created inside are on the meta device
        (no memory); ``prepare()`` materialises them, under tensor parallelism, ZeRO-3 and FSDP
        only this rank's shards ([Note: materialising a meta model shard by shard] in
        parallel/materialize.py). ``from_pretrained`` inside reads nothing: at ``prepare()``
        each rank reads its own slices of the safetensors files ([Note: loading a shard, not
        the model] in parallel/pretrained.py)::

            with accelerator.init_empty_weights():
                model = AutoModelForCausalLM.from_pretrained(path)   # or from_config(config)
            model, optimizer = accelerator.prepare(model, optimizer)
        """
        return materialize.init_empty_weights(include_buffers)

    @staticmethod
    def load_weights(model: nn.Module, path, strict: bool = True) -> nn.Module:
        """Give a model built under :meth:`init_empty_weights` the weights of the safetensors
        checkpoint at ``path``: a ``.safetensors`` file (``mixprec consolidate`` writes one from a
        mixprec checkpoint), an HF sharded checkpoint's index json, or a directory holding
        either. Keys are the model's ``state_dict`` names; ``strict`` as in ``load_state_dict``
        (``strict=False`` initialises missing parameters by the model's own rule). Shapes and
        keys are checked now, buffers loaded now; the parameters are read at ``prepare()``,
        each rank only what it keeps ([Note: loading a shard, not the model] in
        parallel/pretrained.py). Returns ``model``::

            with accelerator.init_empty_weights():
                model = MyModel(config)
            model = accelerator.prepare(accelerator.load_weights(model, "model.safetensors"))
        """
        pretrained.load_weights(model, path, strict=strict)
        return model

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Prepare one model (``prepare()`` calls this for each model it gets).

        ``device_placement``: None or True, the engine places the model on
        ``accelerator.device`` (it keeps the parameters, their fp32 masters or shards there);
        False is honoured for a model already there and otherwise raises
        ``NotImplementedError`` (the engines cannot run a model left elsewhere).

        ``evaluation_mode=True`` (Accelerate: prepare for inference, without the DDP/FSDP
        wrapping that training needs): the model is prepared as any other, with the
        policy's forward (autocast, casts) and registered for ``save_state``. Nothing of
        what Accelerate skips has a cost here for a model that never runs backward: the
        ddp engine synchronises gradients in backward only, and on zero3/fsdp/TP the forward
        gathers the shards it computes with. Its outputs are the training preparation's.
        """
        self._check_not_reset()
        if isinstance(model, PreparedOptimizer):
            raise TypeError("prepare_model() got an optimizer")
        if evaluation_mode not in (True, False):
            raise TypeError(f"prepare_model(evaluation_mode={evaluation_mode!r}) needs a bool")
        if device_placement is False:
            _refuse_unplaced("prepare_model", self.device,
                             list(model.parameters()) + list(model.buffers()))
        if is_prepared(model) and model in self._models:
            return model
        _clear_stale_grads(model)
        compose(self, model)  # TP, the engine, SP, checkpointing: [Note: the order of the parallelisms]
        from ..parallel.generation import mark_collective_forward
        mark_collective_forward(self, model)  # HF generate() syncs ranks: [Note: generate() on sharded weights]
        _gather_for_save_pretrained(self, model)
        self._models.append(model)
        if self._log_policy and not self._policy_logged:
            self.print(startup_line(self, model), flush=True)  # mixprec/startup.py
            self._policy_logged = True
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Optional[bool] = None) -> PreparedOptimizer:
        """Hand one optimizer to the engine (``prepare()`` calls this for each optimizer).
        ``device_placement``: None or True, its state goes where the engine keeps the
        parameters; False is honoured for state already on ``accelerator.device`` (or none
        yet) and otherwise raises ``NotImplementedError``."""
        self._check_not_reset()
        if device_placement is False and not isinstance(optimizer, PreparedOptimizer):
            _refuse_unplaced("prepare_optimizer", self.device,
                             [v for st in optimizer.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0])
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        tensor_parallel.swap_optimizer_params(optimizer, self._models)
        state = self.engine.prepare_optimizer(optimizer)
        prepared = PreparedOptimizer(optimizer, self.engine, state, self.gradient_state)
        if self.gradient_clipping is not None:
            prepared.pre_step_hooks.append(self._auto_clip)
        if self.engine.scaler is not None and self.max_consecutive_overflows is not None:
            # The watch holds the scaler, not this Accelerator: no reference cycle keeps the
            # engine (and its process group) alive (see [Note: no reference cycles]).
            watch = OverflowWatch(self.max_consecutive_overflows, self._models, self.state,
                                  self.engine.scaler.scale_value)
            prepared.post_step_hooks.append(watch.after_step)
        self._optimizers.append(prepared)
        return prepared

    def _auto_clip(self, optimizer: PreparedOptimizer) -> None:
        """Pre-step hook (``gradient_clipping``): clip all prepared models' gradients unless
        they were clipped for this step. The engine records a step's clip in every
        optimizer's state (``grad_norm``, cleared by that optimizer's step), so a manual
        ``clip_grad_norm_`` call, or this hook run for an earlier optimizer of the same
        step, is seen and the gradients are not clipped twice."""
        if optimizer._state.grad_norm is not None:
            return
        params = [p for model in self._models for p in model.parameters()]
        self.clip_grad_norm_(params, self.gradient_clipping)

    def prepare_scheduler(self, scheduler) -> PreparedScheduler:
        self._check_not_reset()
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self._optimizers if o.optimizer is inner or o is inner] or list(self._optimizers)
        # Accelerate's rule advances by the processes that each read their own batch: the
        # data-parallel size. TP/SP peers share one batch ([Note: the rank mesh] in
        # parallel/mesh.py), so a mesh counts dp = world // (tp * sp), not num_processes.
        batches_per_step = self.num_processes if self.mesh is None else self.mesh.dp_size
        steps = 1 if self.scheduler_step_rule == "optimizer" or self.split_batches else batches_per_step
        prepared = PreparedScheduler(
            scheduler, optimizers, self.gradient_state, self.step_scheduler_with_optimizer,
            steps_per_optimizer_step=steps,
        )
        self._schedulers.append(prepared)
        return prepared

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's module. With ``keep_fp32_wrapper=False`` the policy's forward
        behaviour (autocast, input/output casts) is removed from it. A ``torch.compile``'d
        model: ``keep_torch_compile=True`` (Accelerate's default) returns the compiled
        module, ``False`` the module it compiled (its ``_orig_mod``)."""
        inner = getattr(model, "_orig_mod", None) if _is_compiled(model) else None
        if not keep_fp32_wrapper:
            restore_class(model if inner is None else inner)
        if inner is not None and not keep_torch_compile:
            return inner
        return model

    def verify_device_map(self, model: nn.Module) -> bool:
        """Whether ``model`` (or a submodule) was loaded with a big-model-inference device map
        over more than one device (transformers' ``from_pretrained(device_map="auto")`` sets
        ``hf_device_map``), as Accelerate's method answers."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    @property
    def tp_plan(self) -> dict:
        """Under tensor parallelism, every split parameter of the prepared models -> its
        partition (style, split dimension, global shape, which plan chose it); parameters
        not listed are replicated. Empty without tensor parallelism."""
        out = {}
        for i, model in enumerate(self._models):
            layout = tensor_parallel.layout_of(model)
            if layout is not None:
                prefix = "" if i == 0 else f"model{i}/"
                out.update({prefix + k: v for k, v in layout.describe().items()})
        return out


def _clear_stale_grads(model: nn.Module) -> None:
    """[Note: gradients before prepare()]
    A backward run before ``prepare()`` (a sanity-check step, a stray ``loss.backward()``)
    leaves ``.grad`` on the raw parameters. The engines read ``.grad`` as this step's
    gradient, so it would be added into the first real step (in fp16 without the loss
    scale's division). ``prepare()`` clears them (``.grad = None``) and warns, naming how
    many and which: the run then starts from the same state as a clean one, and a script
    that ran a deliberate check before ``prepare()`` keeps working. They are cleared rather
    than refused because no engine could use them (they were never scaled, reduced or
    accumulated under the policy), and mixprec's own ``backward`` before ``prepare()``
    raises :class:`NotPreparedError` already."""
    stale = [name for name, p in model.named_parameters() if p.grad is not None]
    if not stale:
        return
    for p in model.parameters():
        p.grad = None
    shown = ", ".join(stale[:4]) + (f", ... ({len(stale) - 4} more)" if len(stale) > 4 else "")
    warnings.warn(
        f"prepare(): {len(stale)} parameter(s) of {type(model).__name__} already had gradients ({shown}), "
        f"from a backward run before prepare(); they were cleared (.grad = None) so that they cannot "
        f"flow into the first optimizer step. Call backward only after prepare() to silence this "
        f"([Note: gradients before prepare()] in mixprec/facade/preparation.py)",
        StaleGradientsWarning, stacklevel=4,
    )


def _is_compiled(model: Any) -> bool:
    """A ``torch.compile``'d module (``torch._dynamo``'s OptimizedModule)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)


def _refuse_unplaced(method: str, device: torch.device, tensors: list) -> None:
    """``device_placement=False``: the engines keep what they manage on the Accelerator's
    device, so a tensor elsewhere cannot be left where it is."""
    def there(d: torch.device) -> bool:
        return d.type == "meta" or (d.type == device.type and (device.index is None or d.index in (None, device.index)))

    elsewhere = sorted({str(t.device) for t in tensors if not there(t.device)})
    if elsewhere:
        raise NotImplementedError(
            f"{method}(device_placement=False): mixprec's engine keeps the parameters and optimizer state it "
            f"manages on accelerator.device ({device}), and these are on {', '.join(elsewhere)}; it cannot leave "
            f"them there. Move them to {device} yourself or pass device_placement=None"
        )


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
        and not isinstance(obj, torch.optim.Optimizer)
    )


def _gather_for_save_pretrained(acc: Any, model: nn.Module) -> None:
    """zero3/fsdp/TP: give the prepared model's context the streamed save and the gather its
    ``save_pretrained`` uses ([Note: save_pretrained of a sharded model] in
    src/mixprec/wrappers/model.py). Weak references: the model does not keep the Accelerator
    alive."""
    ctx = getattr(model, "_mixprec_ctx", None)
    if ctx is None or not (tensor_parallel.layout_of(model) is not None
                           or any(is_guarded(p) for p in model.parameters())):
        return
    acc_ref, model_ref = weakref.ref(acc), weakref.ref(model)

    def owner() -> Any:
        acc = acc_ref()
        if acc is None or model_ref() is None:
            raise RuntimeError("save_pretrained() of a zero3/fsdp/TP model whose Accelerator is gone: its full "
                               "weights cannot be gathered; pass state_dict= taken with accelerator.get_state_dict(model)")
        return acc

    def gather() -> dict:
        return owner().get_state_dict(model_ref())

    def save(m: nn.Module, save_directory, options: dict) -> bool:
        from .exports import save_pretrained_streamed

        return save_pretrained_streamed(owner(), m, save_directory, options)

    ctx.full_state_dict = gather
    ctx.save_pretrained = save
