"""The user-facing facade: Accelerate's names and semantics, mixprec's engines underneath."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Optional, Union

import torch
from torch import nn

from .engines import resolve_backend
from .gradient_state import GradientState
from .policy import PrecisionPolicy, ScalerConfig
from .step import StepResult
from .wrappers.dataloader import PreparedDataLoader
from .wrappers.model import AutocastGate, is_prepared, restore_class
from .wrappers.optimizer import PreparedOptimizer
from .wrappers.scheduler import PreparedScheduler

logger = logging.getLogger("mixprec")

_SUPPORTED = "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, LR scheduler"


class Accelerator:
    """Keep your training loop; get correct mixed precision on any backend.

    Example::

        accelerator = Accelerator(mixed_precision="bf16")
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    Args:
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` or ``"bf16-pure"`` (explicit
            opt-in to bf16 weights updated without fp32 masters).
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1).
        cpu: force the CPU even when CUDA is available.
        backend: ``"auto"`` or ``"single"``.
        device: an explicit device (overrides ``cpu`` and the automatic choice).
        policy: a full :class:`PrecisionPolicy`; conflicts with a different ``mixed_precision``.
        param_dtype: store trainable parameters in this dtype (bf16/fp16) with fp32 masters.
        keep_fp32_modules: module class names / dotted paths that run in fp32.
        scaler: :class:`ScalerConfig` for fp16 loss scaling.
        fused_optimizer: step Adam/AdamW/SGD with the C++ fused kernels when eligible.
        step_scheduler_with_optimizer: prepared schedulers follow optimizer steps.
        log_policy: print the resolved policy once at the first ``prepare()``.
        engine_options: backend-specific settings, e.g. for ``"ddp"``: ``bucket_cap_mb``,
            ``first_bucket_cap_mb``, ``find_unused_parameters``, ``broadcast_buffers``.
    """

    def __init__(
        self,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        backend: str = "auto",
        *,
        device: Union[str, torch.device, None] = None,
        policy: Optional[PrecisionPolicy] = None,
        param_dtype: Optional[torch.dtype] = None,
        keep_fp32_modules: tuple[str, ...] = (),
        scaler: Optional[ScalerConfig] = None,
        fused_optimizer: bool = True,
        step_scheduler_with_optimizer: bool = True,
        log_policy: bool = True,
        engine_options: Optional[dict] = None,
    ) -> None:
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be an int >= 1"
            )
        self.policy = _resolve_policy(
            mixed_precision, policy, param_dtype=param_dtype,
            keep_fp32_modules=tuple(keep_fp32_modules), scaler=scaler,
        )
        engine_cls = resolve_backend(backend)
        self.device = _pick_device(device, cpu)
        check_device_supports(self.device, self.policy)
        self.engine = engine_cls(
            self.policy, self.device, fused_optimizer=fused_optimizer, **(engine_options or {})
        )
        self.gradient_state = GradientState(gradient_accumulation_steps)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self._log_policy = log_policy
        self._policy_logged = False
        self._autocast_gate = AutocastGate()
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []

    # ------------------------------------------------------------------ info
    @property
    def mixed_precision(self) -> str:
        return self.policy.name

    @property
    def backend(self) -> str:
        return self.engine.name

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-batch ends an accumulation window."""
        return self.gradient_state.sync_gradients

    @property
    def num_processes(self) -> int:
        return 1

    @property
    def process_index(self) -> int:
        return 0

    @property
    def local_process_index(self) -> int:
        return 0

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    # --------------------------------------------------------------- prepare
    def prepare(self, *objs: Any):
        """Wrap models, optimizers, dataloaders and schedulers; returned in the order given.

        Models are prepared first, then optimizers (so they can be pointed at fp32
        masters), then schedulers and dataloaders.
        """
        for obj in objs:
            if not isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)) and not _is_scheduler(obj):
                raise TypeError(
                    f"prepare() got an object of type {type(obj).__module__}.{type(obj).__qualname__}, "
                    f"which it cannot wrap; it accepts: {_SUPPORTED}. Pass the others to your loop as they are."
                )
        out: list[Any] = list(objs)
        for i, obj in enumerate(objs):
            if isinstance(obj, nn.Module):
                out[i] = self.prepare_model(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self.prepare_optimizer(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.utils.data.DataLoader):
                out[i] = self.prepare_data_loader(obj)
            elif _is_scheduler(obj):
                out[i] = self.prepare_scheduler(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, PreparedOptimizer):
            raise TypeError("prepare_model() got an optimizer")
        if self._log_policy and not self._policy_logged:
            self.print(self.policy.describe())
            self._policy_logged = True
        if is_prepared(model) and model in self._models:
            return model
        self.engine.prepare_model(model, self._autocast_gate)
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        state = self.engine.prepare_optimizer(optimizer)
        prepared = PreparedOptimizer(optimizer, self.engine, state, self.gradient_state)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self._optimizers if o.optimizer is inner or o is inner] or list(self._optimizers)
        prepared = PreparedScheduler(
            scheduler, optimizers, self.gradient_state, self.step_scheduler_with_optimizer
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, dataloader: torch.utils.data.DataLoader) -> PreparedDataLoader:
        prepared = PreparedDataLoader(dataloader, self.device, self.gradient_state)
        self._dataloaders.append(prepared)
        return prepared

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module. With ``keep_fp32_wrapper=False`` the policy's forward
        behaviour (autocast, input/output casts) is removed from it."""
        if not keep_fp32_wrapper:
            restore_class(model)
        return model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Full-precision state dict: parameters from the fp32 masters where there are."""
        return self.engine.full_state_dict(model)

    # ------------------------------------------------------------ precision
    def autocast(self, enabled: bool = True):
        """The policy's autocast as a context manager; ``enabled=False`` steps out of it
        locally (a prepared model called inside does not turn it back on)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast_gate.override(enabled))
        if enabled and self.policy.autocast_enabled:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.policy.compute_dtype))
        elif not enabled:
            stack.enter_context(torch.autocast(self.device.type, enabled=False))
        return stack

    def _divide_for_accumulation(self, loss: torch.Tensor) -> torch.Tensor:
        steps = self.gradient_state.accumulation_steps
        return loss / steps if steps > 1 else loss

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with accumulation division (once) and loss scaling."""
        self.engine.backward(self._divide_for_accumulation(loss), **kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on yourself (accumulation-divided and scaled)."""
        return self.engine.scale_loss(self._divide_for_accumulation(loss))

    def unscale_gradients(self, optimizer: Optional[PreparedOptimizer] = None) -> None:
        """Unscale the gradients now (idempotent within a step)."""
        targets = [optimizer] if optimizer is not None else self._optimizers
        for opt in targets:
            self.engine.unscale_(opt._state)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients (unscaled first) to ``max_norm``; returns the total pre-clip norm."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        return self.engine.clip_grad_norm_(list(parameters), max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp each gradient element (unscaled first) to ``[-clip_value, clip_value]``."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        self.engine.clip_grad_value_(list(parameters), clip_value)

    # --------------------------------------------------------- accumulation
    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module):
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-batches; the
        optimizer and scheduler step only at the boundary (or the end of the dataloader)."""
        self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if not self.gradient_state.sync_gradients:
                for m in models:
                    stack.enter_context(self.engine.no_sync(m))
            yield

    def no_sync(self, model: nn.Module):
        """Skip gradient communication for the backward calls inside."""
        return self.engine.no_sync(model)

    # ----------------------------------------------------------- reporting
    @property
    def last_step(self) -> Optional[StepResult]:
        """Outcome of the most recent real optimizer step."""
        results = [o.last_step for o in self._optimizers if o.last_step is not None]
        return results[-1] if results else None

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self._optimizers)

    @property
    def skipped_steps(self) -> int:
        return sum(o.skipped_steps for o in self._optimizers)

    @property
    def loss_scale(self) -> Optional[float]:
        scaler = self.engine.scaler
        return None if scaler is None else scaler.scale_value()

    def wait_for_everyone(self) -> None:
        """A barrier across processes (nothing to wait for in one process)."""


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
        and not isinstance(obj, torch.optim.Optimizer)
    )


def _resolve_policy(
    mixed_precision: Optional[str],
    policy: Optional[PrecisionPolicy],
    **overrides: Any,
) -> PrecisionPolicy:
    overrides = {
        k: v for k, v in overrides.items() if v is not None and v != () 
    }
    if policy is not None:
        if not isinstance(policy, PrecisionPolicy):
            raise TypeError(f"policy={policy!r} must be a mixprec.PrecisionPolicy")
        if mixed_precision is not None and mixed_precision != policy.name:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} conflicts with policy.name={policy.name!r}; "
                "give one of them"
            )
        return dataclasses.replace(policy, **overrides) if overrides else policy
    return PrecisionPolicy.from_mixed_precision(mixed_precision or "no", **overrides)


def _pick_device(device: Union[str, torch.device, None], cpu: bool) -> torch.device:
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a valid torch device: {e}") from None
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device_supports(device: torch.device, policy: PrecisionPolicy) -> None:
    """Raise a ValueError naming the device and the fix when ``policy`` cannot run there."""
    dtype = policy.compute_dtype
    if dtype == torch.float32 and policy.param_dtype in (None, torch.float32):
        return
    wanted = policy.compute_dtype if policy.compute_dtype != torch.float32 else policy.param_dtype
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[wanted]
    fix = "use mixed_precision='no', or another device"
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(
            f"mixed_precision={policy.name!r} needs {name} autocast, which device {str(device)!r} "
            f"does not support; {fix}"
        )
    if device.type == "cuda" and wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{str(device)!r} has no bf16 support; use mixed_precision='fp16' or 'no'")
    try:
        a = torch.ones(4, 4, device=device)
        with torch.autocast(device.type, dtype=wanted):
            out = torch.nn.functional.linear(a, a)
        ok = out.dtype == wanted
    except RuntimeError as e:
        raise ValueError(
            f"mixed_precision={policy.name!r}: {name} matmul under autocast failed on "
            f"{str(device)!r} ({e}); {fix}"
        ) from None
    if not ok:
        raise ValueError(
            f"mixed_precision={policy.name!r}: autocast on {str(device)!r} does not compute in "
            f"{name} (got {out.dtype}); {fix}"
        )
