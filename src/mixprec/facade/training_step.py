"""The training step: autocast, ``backward`` (divided for accumulation once, scaled under
fp16), unscaling and clipping, accumulation windows and ``no_sync``, and what the last
optimizer step did. The numbers are the engine's (engines/base.py); this concern turns the
loop's calls into the engine's, once per call, and tells a running ``join_uneven_inputs``
block (mixprec/join.py) and ``progress()`` (mixprec/progress.py) about them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
from torch import nn

from ..distributed import watchdog as desync
from ..errors import NotPreparedError
from ..progress import Progress
from ..step import StepResult
from ..wrappers.optimizer import PreparedOptimizer


class TrainingStep:
    """Mixin of :class:`mixprec.Accelerator` (reads the engine, ``policy``,
    ``gradient_state``, ``_optimizers``, ``_no_sync_depth``, ``_join``, ``_progress``)."""

    @property
    def mixed_precision(self) -> str:
        return self.policy.name

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-batch ends an accumulation window."""
        return self.gradient_state.sync_gradients

    def autocast(self, autocast_handler=None, *, enabled: bool = True):
        """The policy's autocast as a context manager; ``enabled=False`` steps out of it
        locally (a prepared model called inside does not turn it back on).

        ``autocast_handler``: Accelerate's ``AutocastKwargs`` (any object with ``enabled``);
        its ``enabled`` acts as ``enabled=`` does (both given: autocast runs only if both
        are True). Its ``cache_enabled`` leaves torch's weight cache on either way, as in
        Accelerate (which passes it only when True, torch's default).
        """
        if isinstance(autocast_handler, bool):
            raise TypeError(
                f"autocast({autocast_handler!r}): the first argument is Accelerate's autocast_handler "
                f"(an AutocastKwargs); write autocast(enabled={autocast_handler!r})"
            )
        if autocast_handler is not None:
            if not isinstance(getattr(autocast_handler, "enabled", None), bool):
                raise TypeError(
                    f"autocast(autocast_handler={autocast_handler!r}) needs Accelerate's AutocastKwargs (an "
                    f"object with a bool `enabled`); or use autocast(enabled=...)"
                )
            enabled = bool(enabled and autocast_handler.enabled)
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast_gate.override(enabled))
        if enabled and self.policy.autocast_enabled:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.policy.compute_dtype))
        elif not enabled:
            stack.enter_context(torch.autocast(self.device.type, enabled=False))
        return stack

    @contextlib.contextmanager
    def profile(self, profile_handler=None):
        """``torch.profiler.profile`` around the block, yielding the profiler (Accelerate's
        ``profile``). ``profile_handler``: Accelerate's ``ProfileKwargs`` (any object with
        ``build()`` returning a profiler); without one, torch's defaults (CPU activity, and
        CUDA's where torch has it). When the handler has an ``output_trace_dir``, each
        process writes ``profile_<process_index>.json`` (a Chrome trace) there and the
        processes then wait for each other, as Accelerate does::

            with accelerator.profile() as prof:
                train_step()
            accelerator.print(prof.key_averages().table(row_limit=10))
        """
        import torch.profiler

        if profile_handler is not None and not callable(getattr(profile_handler, "build", None)):
            raise TypeError(
                f"profile(profile_handler={profile_handler!r}) needs Accelerate's ProfileKwargs (an object "
                f"with build()); or call profile() for torch's defaults"
            )
        profiler = torch.profiler.profile() if profile_handler is None else profile_handler.build()
        with profiler:
            yield profiler
        out_dir = getattr(profile_handler, "output_trace_dir", None)
        if out_dir is None:
            return
        os.makedirs(out_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(out_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Accelerate's context-parallel block. mixprec has no ring context parallelism, so
        this is Accelerate's block with context parallelism off: nothing happens inside.
        Buffers to shard along the sequence (``buffers``, ``buffer_seq_dims``,
        ``no_restore_buffers``) raise ``NotImplementedError``: mixprec splits long sequences
        with sequence parallelism (Ulysses; the ``sequence_parallel`` config section, whose
        ``prepare_batches`` shards the batches' sequence dimension; docs/sequence_parallel.md).
        """
        for name, value in (("buffers", buffers), ("buffer_seq_dims", buffer_seq_dims),
                            ("no_restore_buffers", no_restore_buffers)):
            if value:
                shown = f"<{len(value)} item(s)>" if not isinstance(value, (int, str)) else repr(value)
                raise NotImplementedError(
                    f"maybe_context_parallel({name}={shown}): mixprec has no ring context parallelism to shard "
                    f"buffers along the sequence. Use sequence parallelism instead: the config's "
                    f"sequence_parallel section (size=, prepare_batches=True shards the batches' sequence "
                    f"dimension; docs/sequence_parallel.md), and call maybe_context_parallel() without buffers "
                    f"or not at all"
                )
        yield

    def _divide_for_accumulation(self, loss: torch.Tensor) -> torch.Tensor:
        steps = self.gradient_state.accumulation_steps
        return loss / steps if steps > 1 else loss

    def _require_prepared(self, call: str) -> None:
        if not self._models:
            raise NotPreparedError(
                f"accelerator.{call} was called before accelerator.prepare() got a model: its gradients "
                f"would sit in plain .grad tensors outside the engine and flow into the first real "
                f"optimizer step. Fix: call `model, optimizer = accelerator.prepare(model, optimizer)` "
                f"first, then compute the loss with the prepared model and call accelerator.{call}"
            )

    @desync.tracked("backward")
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with accumulation division (once) and loss scaling. Before
        ``prepare()`` got a model it raises :class:`NotPreparedError`."""
        self._require_prepared("backward(loss)")
        if self._progress is not None:  # a snapshot, not a read ([Note: progress without host syncs])
            self._progress.loss_snapshot(loss)
        join = self._join  # inside join_uneven_inputs: the backward's announcement says how it ran
        if join is not None:
            join.via_accelerator = True
        try:
            self.engine.backward(self._divide_for_accumulation(loss), **kwargs)
        finally:
            if join is not None:
                join.via_accelerator = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on yourself (accumulation-divided and scaled)."""
        self._require_prepared("scale(loss)")
        return self.engine.scale_loss(self._divide_for_accumulation(loss))

    def unscale_gradients(self, optimizer: Optional[PreparedOptimizer] = None) -> None:
        """Unscale the gradients now (idempotent within a step)."""
        targets = [optimizer] if optimizer is not None else self._optimizers
        for opt in targets:
            self.engine.unscale_(opt._state)

    @desync.tracked("clip_grad_norm_")
    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients (unscaled first) to ``max_norm``; returns the total pre-clip norm.
        A nan or negative ``max_norm`` raises ValueError before any gradient changes
        (``math.inf``: the norm only, nothing clipped)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if self._join is not None:  # inside join_uneven_inputs: ranks that ran out clip too
            self._join.announce_clip(max_norm, norm_type)
        # Not list(): a prepared model's parameters() is recognised and not walked
        # ([Note: the clip shares the step plan] in engines/clip_sources.py).
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type)

    @desync.tracked("clip_grad_value_")
    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp each gradient element (unscaled first) to ``[-clip_value, clip_value]``.
        A nan or negative ``clip_value`` raises ValueError before any gradient changes."""
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
            if not self.gradient_state.sync_gradients and not self.gradient_state.sync_each_batch:
                for m in models:
                    stack.enter_context(self.no_sync(m))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Skip gradient communication for the backward calls inside."""
        with self.engine.no_sync(model):
            self._no_sync_depth[id(model)] = self._no_sync_depth.get(id(model), 0) + 1
            try:
                yield
            finally:
                self._no_sync_depth[id(model)] -= 1

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

    def progress(self, iterable, total: Optional[int] = None, unit: str = "samples", *, desc: str = "train",
                 bar: Optional[bool] = None, every_s: float = 10.0, file=None) -> Progress:
        """Iterate ``iterable`` while the main process shows batches done, ``unit`` per
        second across all ranks (``"samples"``, ``"tokens"`` or ``"batches"``), ETA (from
        ``total`` batches, default ``len(iterable)``), the last loss given to
        :meth:`backward` and the skipped steps. A tqdm bar when tqdm is installed (``bar=None``)
        or asked for (``bar=True``); otherwise (``bar=False``) a plain line every ``every_s``
        seconds, to ``file`` (default stderr). It reads no device value: no host sync per
        step ([Note: progress without host syncs] in mixprec/progress.py).

        Example::

            for x, y in accelerator.progress(loader, unit="samples"):
                ...
        """
        return Progress(self, iterable, total=total, unit=unit, desc=desc, bar=bar, every_s=every_s, file=file)
