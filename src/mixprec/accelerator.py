"""The user-facing facade: Accelerate's names and semantics, mixprec's engines underneath.

:class:`Accelerator` is built from one class per concern, each in src/mixprec/facade/
(docs/design.md, "Where things live"): the resolved run (``run.py``: config, policy, process
group, mesh and engine, built once by :func:`~mixprec.facade.run.build_run`), preparation,
data loaders, sequence-parallel inputs, the training step, exports, the checkpoint session,
process helpers, the Accelerator's lifetime (engine rebuilds, pickling, ``end_training``),
and Accelerate's remaining methods (compat/api.py). This module wires them: the constructor
adopts the run and starts each concern's state; the exit hook below ends what is left.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
from typing import Any, Optional, Union

import torch

from . import registry, tracking
from .checkpoint.rotation import ProjectConfiguration
from .compat.api import AccelerateApi
from .compat.state import AcceleratorState
from .config.resolve import ConfigLike, ResolvedConfig
from .device import check_device_supports  # noqa: F401 - mixprec.accelerator.check_device_supports, as before
from .device import pick_device as _pick_device  # noqa: F401
from .distributed.state import DistributedState, destroy_distributed, let_collective_workers_finish
from .facade.checkpoint_session import CheckpointSession
from .facade.exports import Exports
from .facade.lifetime import Lifetime
from .facade.loaders import Loaders
from .facade.preparation import Preparation, PreparedObjects, StaleGradientsWarning  # noqa: F401
from .facade.processes import Processes
from .facade.run import NOT_GIVEN, build_run
from .facade.run import NotGiven as _NotGiven
from .facade.sp_inputs import SequenceInputs
from .facade.training_step import TrainingStep
from .policy import PrecisionPolicy, ScalerConfig

logger = logging.getLogger("mixprec")


class Accelerator(Preparation, Loaders, SequenceInputs, TrainingStep, Exports, CheckpointSession, Processes,
                  Lifetime, AccelerateApi):
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

    Every setting below except ``device``, ``policy``, ``timeout``, ``project_dir`` and
    ``project_config`` is also a config key (docs/configuration.md): it can come from
    ``config`` (a YAML/JSON file, a dict or a :class:`mixprec.config.MixprecConfig`), from
    the file ``mixprec launch --config-file`` names (``$MIXPREC_CONFIG_FILE``), or from a
    ``MIXPREC_<KEY>`` environment variable. An argument left at None is not given; two
    sources giving different values raise :class:`mixprec.config.ConfigError` naming both.

    Args:
        mixed_precision: ``"no"``, ``"bf16"``, ``"fp16"`` or ``"bf16-pure"`` (explicit
            opt-in to bf16 weights updated without fp32 masters). Default ``"no"``.
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1, default 1).
        cpu: force the CPU even when CUDA is available.
        backend: ``"auto"`` (default), ``"single"``, ``"ddp"``, ``"zero1"``, ``"zero2"``,
            ``"zero3"`` or ``"fsdp"``.
        config: a config file path, dict or :class:`mixprec.config.MixprecConfig`.
        device: an explicit device (overrides ``cpu`` and the automatic choice).
        policy: a full :class:`PrecisionPolicy`; conflicts with a different ``mixed_precision``.
        param_dtype: store trainable parameters in this dtype (bf16/fp16) with fp32 masters.
        keep_fp32_modules: module class names / dotted paths that run in fp32.
        scaler: :class:`ScalerConfig` for fp16 loss scaling (gives the ``scaler.*`` keys
            whose values differ from the defaults).
        fused_optimizer: step Adam/AdamW/SGD with the C++ fused kernels when eligible.
        step_scheduler_with_optimizer: prepared schedulers follow optimizer steps.
        log_policy: print the start-up line once, on the main process, at the first
            ``prepare()`` of a model: backend (and how ``auto`` resolved), world size, nodes,
            process group, precision policy, gradient buckets or sharding units
            (mixprec/startup.py).
        engine_options: options of the selected backend (its config block), e.g. for
            ``"ddp"``: ``bucket_cap_mb``, ``first_bucket_cap_mb``, ``find_unused_parameters``,
            ``broadcast_buffers``.
        split_batches: prepared dataloaders split each batch across processes (the batch
            size must divide) instead of giving each process its own batches.
        even_batches: every process gets the same number of batches (the last ones are
            completed from the start of the dataset; ``gather_for_metrics`` drops them).
        data_seed: seed of the shuffling shared by all processes (None: drawn on rank 0).
        gradient_clipping: clip the gradient norm to this before every real optimizer step
            unless :meth:`clip_grad_norm_` was called for that step (None: off).
        timeout: collective timeout of the process group this Accelerator initialises.
        project_dir: folder of the run (shortcut for ``project_config.project_dir``).
        project_config: :class:`mixprec.checkpoint.ProjectConfiguration`: checkpoint
            naming, rotation (``total_limit``) and the collective-call timeout.
        max_consecutive_overflows: fp16 only: after this many optimizer steps in a row
            skipped for overflow, ``optimizer.step()`` raises
            :class:`mixprec.OverflowStormError` naming the module whose output or gradient
            overflowed (int >= 1, default 20; None never stops).
        activation_checkpointing: modules whose activations are recomputed in backward
            (docs/backends.md): a list of module classes / class names / dotted paths, or a
            dict of the ``activation_checkpointing`` block (``{"units": True}``: every
            zero3/fsdp unit).
        nonfinite_grads: bf16/fp32: ``"skip"`` (default) skips a step whose gradients hold
            inf/nan on any rank (reason ``'nonfinite'``); ``"raise"`` raises
            :class:`mixprec.NonFiniteGradientsError` naming the step.
        clip_in_step: ``clip_grad_norm_`` computes the norm in one read and the fused
            update applies the clip (default True; the gradients keep their unclipped
            values until ``step()``). False clips in place at once, as torch does.
        cache_weight_casts: single/ddp, bf16/fp16 autocast: the fused update writes the
            forward's bf16/fp16 copy of each large ``nn.Linear``/``nn.ConvNd`` weight, so the forward
            does not cast it again (default True; same numbers as autocast). False: cast
            in every forward (for loops that write weights through ``p.data``).

    Accelerate's options (keyword-only here; docs/migrating.md):

    Args:
        device_placement: move prepared models and batches to the device (default True;
            False leaves batches where the dataloader puts them).
        dataloader_config: a ``DataLoaderConfiguration`` (``split_batches``, ``even_batches``,
            ``use_seedable_sampler``, ``data_seed``, ``non_blocking``); mixprec's or Accelerate's.
        gradient_accumulation_plugin: a ``GradientAccumulationPlugin`` (``num_steps``,
            ``sync_each_batch``); mixprec's or Accelerate's.
        kwargs_handlers: ``DistributedDataParallelKwargs`` (ddp engine options),
            ``InitProcessGroupKwargs`` (``timeout``), ``GradScalerKwargs`` (fp16 scaler).
        log_with: trackers for :meth:`init_trackers`/:meth:`log` (mixprec/tracking.py):
            ``"jsonl"`` (default), ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``,
            tracker objects, or a list of them.
        scheduler_step_rule: ``"accelerate"`` (default): a prepared scheduler steps once per
            data-parallel rank per optimizer step (``num_processes`` times without tensor or
            sequence parallelism, ``num_processes // (tp * sp)`` with them, whose peers share a
            batch) unless ``split_batches`` (each data-parallel rank saw its own batch, so a
            schedule written in single-process batches advances as far as one process would
            have); ``"optimizer"``: once per optimizer step
            (mixprec 0.1's rule). Both skip while accumulating and after skipped steps.
    """

    def __init__(
        self,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: Optional[int] = None,
        cpu: Optional[bool] = None,
        backend: Optional[str] = None,
        *,
        config: ConfigLike = None,
        device: Union[str, torch.device, None] = None,
        policy: Optional[PrecisionPolicy] = None,
        param_dtype: Optional[torch.dtype] = None,
        keep_fp32_modules: Optional[tuple[str, ...]] = None,
        scaler: Optional[ScalerConfig] = None,
        fused_optimizer: Optional[bool] = None,
        step_scheduler_with_optimizer: Optional[bool] = None,
        log_policy: Optional[bool] = None,
        engine_options: Optional[dict] = None,
        split_batches: Optional[bool] = None,
        even_batches: Optional[bool] = None,
        data_seed: Optional[int] = None,
        gradient_clipping: Optional[float] = None,
        nonfinite_grads: Optional[str] = None,
        clip_in_step: Optional[bool] = None,
        cache_weight_casts: Optional[bool] = None,
        max_consecutive_overflows: Union[int, None, _NotGiven] = NOT_GIVEN,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        activation_checkpointing: Any = None,
        device_placement: bool = True,
        dataloader_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        kwargs_handlers: Optional[list] = None,
        log_with: Any = None,
        scheduler_step_rule: str = "accelerate",
    ) -> None:
        arguments = dict(locals())  # every argument, by name: the run is built from them
        del arguments["self"]
        self._log_with = tracking.resolve_log_with(log_with)
        self._log_with_given = log_with
        run = build_run(arguments)
        self.config: ResolvedConfig = run.config
        self.policy = run.policy
        self.state: AcceleratorState = run.state
        self.device = run.state.device
        self.mesh = run.mesh  # the (dp, sp, tp) rank mesh under tensor/sequence parallelism, else None
        self._ulysses = run.ulysses
        self._engine_spec = run.engine_spec  # free_memory() and an unpickled Accelerator build from it
        self.engine = run.engine
        self._ended = False
        registry.LIVE.add(self)
        cfg = self.config.config
        self._trigger = False  # set_trigger / check_trigger
        self._start_preparation(cfg, scheduler_step_rule)
        self._start_checkpoints(project_dir, project_config)
        self._start_process_objects(cfg.gradient_accumulation_steps, run.compat.sync_each_batch,
                                    self.project_configuration.collective_timeout_s)
        registry.register(self)  # AcceleratorState() / PartialState() return this state
        self._start_loaders(cfg, run.compat, device_placement)
        self._start_watchdog(cfg.collective_timeout)


# [Note: shutdown without end_training]
# Most scripts never call end_training(). At interpreter exit the engines' C++ objects
# (reducers, sharding cores) would then keep the process group alive into finalization,
# where a Gloo worker still releasing a tensor aborts the process ([Note: exit after a
# collective] in distributed/state.py). So an atexit hook does what end_training() does
# for every Accelerator still alive: release the engine, then destroy the default group if
# an Accelerator created it (a group made by the caller is left to the caller, after a
# moment for its workers: [Note: exit after a collective]).
_LIVE = registry.LIVE  # the Accelerators the exit hook releases (src/mixprec/registry.py)
_CREATED_GROUPS = registry.CREATED_GROUPS  # names of the groups Accelerators initialised


def _shutdown_at_exit() -> None:
    live = [acc for acc in list(_LIVE) if not acc._ended]
    for acc in live:
        acc._ended = True
        try:
            acc.engine.release()
        except Exception as e:  # noqa: BLE001 - exit must go on; say what went wrong
            logger.warning("mixprec: releasing the %s engine at exit failed: %s", acc.backend, e)
    gc.collect()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD.group_name in _CREATED_GROUPS:
        destroy_distributed(DistributedState(group=dist.group.WORLD))
    elif live or (dist.is_available() and dist.is_initialized()):
        # A group the caller made (transformers' TrainingArguments make one through
        # Accelerate's PartialState) stays, but its workers get their moment too: the
        # script's Accelerators may be gone already (run_clm.py's Trainer is collected when
        # main() returns), their last collectives' tensors with them.
        let_collective_workers_finish()


atexit.register(_shutdown_at_exit)
