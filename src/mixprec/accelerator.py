"""The user-facing facade: Accelerate's names and semantics, mixprec's engines underneath."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import warnings
import weakref
from typing import Any, Optional, Union

import torch
from torch import nn

from .data.sharding import shard_dataloader
from .diagnostics.overflow import OverflowWatch, check_overflow_budget
from .distributed import collectives
from .distributed import watchdog as desync
from .distributed.state import (
    DetachedGroup,
    DistributedState,
    destroy_distributed,
    init_distributed,
    init_single_process_group,
    let_collective_workers_finish,
)
from . import activation_checkpointing as act_ckpt
from .checkpoint.rotation import ProjectConfiguration, resolve_project_configuration
from .config.fields import DTYPES
from .config.resolve import ConfigLike, ResolvedConfig, flatten_object
from .config.resolve import resolve as resolve_config
from .checkpoint.sync import CallCheck
from .device import check_device_supports
from .device import pick_device as _pick_device
from .engines import Engine, gathered, resolve_backend
from .errors import NotPreparedError
from .parallel import materialize
from .parallel.compose import compose
from .parallel import sequence as sequence_parallel
from .parallel import tensor as tensor_parallel
from .gradient_state import GradientState
from .policy import PrecisionPolicy, ScalerConfig
from .progress import Progress
from .startup import startup_line
from .step import StepResult
from .checkpoint.dataloader import ResumableDataLoader, StatefulPreparedDataLoader
from .wrappers.dataloader import PreparedDataLoader
from .wrappers.model import AutocastGate, is_prepared, restore_class
from .wrappers.optimizer import PreparedOptimizer
from .wrappers.scheduler import PreparedScheduler
from .compat.api import AccelerateApi
from .compat.setup import translate as translate_accelerate_options
from .compat import state as compat_state
from .compat.state import AcceleratorState
from . import registry, tracking

logger = logging.getLogger("mixprec")

class _NotGiven:
    """Default of arguments for which None is a meaningful value (e.g. "disabled")."""

    def __repr__(self) -> str:
        return "<from config>"


NOT_GIVEN = _NotGiven()

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


class Accelerator(AccelerateApi):
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
        given = {
            "mixed_precision": mixed_precision, "gradient_accumulation_steps": gradient_accumulation_steps,
            "cpu": cpu, "backend": backend, "param_dtype": param_dtype,
            "keep_fp32_modules": keep_fp32_modules, "fused_optimizer": fused_optimizer,
            "step_scheduler_with_optimizer": step_scheduler_with_optimizer, "log_policy": log_policy,
            "split_batches": split_batches, "even_batches": even_batches, "data_seed": data_seed,
            "gradient_clipping": gradient_clipping, "nonfinite_grads": nonfinite_grads,
            "clip_in_step": clip_in_step, "cache_weight_casts": cache_weight_casts,
        }
        compat = translate_accelerate_options(
            given, dataloader_config=dataloader_config, gradient_accumulation_plugin=gradient_accumulation_plugin,
            kwargs_handlers=kwargs_handlers, scaler=scaler, scheduler_step_rule=scheduler_step_rule,
        )
        given, scaler = compat.given, scaler if compat.scaler is None else compat.scaler
        if compat.timeout is not None:
            timeout = compat.timeout
        self._log_with = tracking.resolve_log_with(log_with)
        self._log_with_given = log_with
        self.trackers: list = []
        args = {key: (value, key) for key, value in given.items() if value is not None}
        if max_consecutive_overflows is not NOT_GIVEN:
            args["max_consecutive_overflows"] = (max_consecutive_overflows, "max_consecutive_overflows")
        if scaler is not None:
            if not isinstance(scaler, ScalerConfig):
                raise TypeError(f"scaler={scaler!r} must be a mixprec.ScalerConfig")
            args.update({f"scaler.{k}": (v, f"scaler.{k}") for k, v in flatten_object(scaler).items()})
        if activation_checkpointing is not None:
            args.update(act_ckpt.config_args(activation_checkpointing))
        options = dict(engine_options or {})
        group = options.pop("group", None)  # a process group: not a config value
        # The world size is known before the group exists (launchers export WORLD_SIZE).
        self.config: ResolvedConfig = resolve_config(
            config, args=args, engine_options=options, world_size=_env_world_size()
        )
        cfg = self.config.config
        self.policy = _resolve_policy(
            cfg.mixed_precision if self.config.settings["mixed_precision"].kind != "default" else None,
            policy,
            param_dtype=DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
            keep_fp32_modules=tuple(cfg.keep_fp32_modules),
            scaler=cfg.scaler if any(
                s.kind != "default" for k, s in self.config.settings.items() if k.startswith("scaler.")
            ) else None,
        )
        # A group that existed before any Accelerator belongs to whoever made it.
        creates_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.state: DistributedState = init_distributed(_pick_device(device, cfg.cpu), timeout=timeout)
        self.device = self.state.device
        comm_cls = resolve_backend(cfg.backend, self.state.world_size)
        if comm_cls.distributed and self.state.group is None:
            self.state = init_single_process_group(self.state, timeout=timeout)
        tp_size = getattr(getattr(cfg, "tensor_parallel", None), "size", 1)
        sp_size = getattr(getattr(cfg, "sequence_parallel", None), "size", 1)
        # The (dp, sp, tp) rank layout under tensor and/or sequence parallelism
        # (parallel/mesh.py); under SP, the group's Ulysses attention (parallel/sequence/).
        self.mesh = None
        self._ulysses: Optional[sequence_parallel.Ulysses] = None
        if sp_size > 1:  # the (dp, sp, tp) mesh, TP x SP included
            self.mesh, self._ulysses = sequence_parallel.setup(comm_cls, self.state, sp_size, tp_size)
        if tp_size > 1:
            self.mesh = tensor_parallel.setup(comm_cls, self.state, tp_size, self.mesh)
        if creates_group and self.state.group is not None:
            _CREATED_GROUPS.add(self.state.group.group_name)
        self._ended = False
        _LIVE.add(self)
        if comm_cls.name == "ddp" and compat.ddp_options:
            # DistributedDataParallelKwargs apply to the ddp engine only (as in Accelerate).
            options = {**compat.ddp_options, **options}
        if comm_cls.name != self.config.backend or (comm_cls.name == "ddp" and compat.ddp_options):
            self.config = resolve_config(config, args=args, engine_options=options,
                                         world_size=self.state.world_size)
        check_device_supports(self.device, self.policy)
        options = self.config.engine_options()
        if comm_cls.distributed:
            # TP: the DP group; SP: the whole world ([Note: the sequence-parallel loss]).
            dp_group = self.mesh.dp_group if self._tp else self.state.group
            options["group"] = group if group is not None else dp_group
        try:
            self.engine = Engine(self.policy, self.device, comm_cls, fused_optimizer=cfg.fused_optimizer, **options)
        except BaseException:
            if creates_group:  # nothing else will tear down the group made for this engine
                destroy_distributed(self.state)
            raise
        self._engine_args = (comm_cls, cfg.fused_optimizer, options)  # free_memory() builds anew
        self.engine.set_nonfinite_policy(cfg.nonfinite_grads)
        self.engine.clip_in_step = cfg.clip_in_step
        self.engine.cache_weight_casts = cfg.cache_weight_casts
        # Accelerate's attribute names over the same DistributedState (compat/state.py).
        self.state = AcceleratorState.from_state(self.state, mixed_precision=self.policy.name,
                                                 backend_name=comm_cls.name)
        compat_state.register(self)  # AcceleratorState() / PartialState() return this state
        self.split_batches = cfg.split_batches
        self.even_batches = cfg.even_batches
        self.data_seed = cfg.data_seed
        self.gradient_state = GradientState(cfg.gradient_accumulation_steps)
        self.gradient_state.sync_each_batch = compat.sync_each_batch
        self.use_seedable_sampler = compat.use_seedable_sampler
        self.dispatch_batches = compat.dispatch_batches
        self.use_stateful_dataloader = compat.use_stateful_dataloader
        if self.use_stateful_dataloader:
            _stateful_loader_class()  # without torchdata: the ImportError naming the fix, now
        self._dispatch_group = None  # made at the first dispatched prepare_data_loader
        self.non_blocking = compat.non_blocking
        self.device_placement = bool(device_placement)
        self.scheduler_step_rule = scheduler_step_rule
        self.step_scheduler_with_optimizer = cfg.step_scheduler_with_optimizer
        # Clip to this norm before every real step the user did not clip (None: off).
        self.gradient_clipping: Optional[float] = cfg.gradient_clipping
        # fp16: consecutive overflow-skipped steps tolerated before raising (None: never).
        self.max_consecutive_overflows: Optional[int] = cfg.max_consecutive_overflows
        check_overflow_budget(self.max_consecutive_overflows)
        self._log_policy = cfg.log_policy
        self._policy_logged = False
        self._autocast_gate = AutocastGate()
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        # The public view of the same (live) lists, for checkpointing and tools.
        self.prepared = PreparedObjects(self._models, self._optimizers, self._schedulers, self._dataloaders)
        self.project_configuration = resolve_project_configuration(project_dir, project_config)
        self._checkpoint_objects: list[Any] = []  # registered with register_for_checkpointing
        self._call_check = CallCheck(self.project_configuration.collective_timeout_s)
        self._save_hooks: dict = {}  # register_save_state_pre_hook
        self._load_hooks: dict = {}  # register_load_state_pre_hook
        self._no_sync_depth: dict[int, int] = {}  # id(model) -> open no_sync blocks
        self._trigger = False  # set_trigger / check_trigger
        self._progress: Optional[Progress] = None  # the running progress() tracker (progress.py)
        # Collective desync detection ([Note: desync detection] in distributed/watchdog.py).
        self._watchdog = desync.Watchdog.create(self.state, cfg.collective_timeout)
        if self._watchdog is not None:
            # A dropped Accelerator must not leave its thread polling the store for the
            # life of the process (a script or a test that builds several in turn).
            weakref.finalize(self, self._watchdog.abandon)

    # ------------------------------------------------------------ pickling
    # [Note: pickling an Accelerator]
    # Accelerate pickles its Accelerator (multiprocessing, notebook paths). A mixprec one
    # pickles its settings: config, policy, state (its process group by name, see [Note:
    # pickling a state] in distributed/state.py), dataloader and scheduler options, project
    # configuration, trigger. The engine (C++ objects bound to the group), the prepared
    # objects, registered checkpoint objects and hooks, trackers and the desync watchdog are
    # not pickled: the unpickled Accelerator builds a fresh engine of the same kind at its
    # first use (a collective on a multi-process group: every rank uses it), prepares anew,
    # and where its process group does not exist (another job, a process without one) it
    # raises a RuntimeError naming the fix when it communicates, not when unpickled.
    _join = None  # the running join_uneven_inputs block (mixprec/join.py)
    _NOT_PICKLED = ("_join", "_dispatch_group", "engine", "_engine", "_watchdog", "_models", "_optimizers", "_schedulers", "_dataloaders",
                    "prepared", "trackers", "_checkpoint_objects", "_save_hooks", "_load_hooks", "_no_sync_depth",
                    "_progress", "_autocast_gate", "_call_check", "gradient_state", "_ulysses",
                    "_policy_logged", "_ended")

    def __getstate__(self) -> dict:
        if self.mesh is not None:
            raise TypeError(
                "an Accelerator under tensor or sequence parallelism cannot be pickled: its rank mesh holds "
                "process subgroups that another process cannot find again; pickle the settings you need instead"
            )
        out = {k: v for k, v in self.__dict__.items() if k not in self._NOT_PICKLED}
        comm_cls, fused, options = self._engine_args
        out["_engine_args"] = (comm_cls, fused, {k: v for k, v in options.items() if k != "group"})
        gs = self.gradient_state
        engine = self.__dict__.get("_engine")
        out["_unpickled"] = {
            "accumulation_steps": gs.accumulation_steps, "sync_each_batch": gs.sync_each_batch,
            "collective_timeout_s": self._call_check.timeout_s,
            "engine_settings": None if engine is None else (
                engine.nonfinite_grads, engine.clip_in_step, engine.cache_weight_casts),
        }
        return out

    def __setstate__(self, values: dict) -> None:
        values = dict(values)
        extra = values.pop("_unpickled")
        self.__dict__.update(values)
        self._pending_engine_settings = extra["engine_settings"]
        self.gradient_state = GradientState(extra["accumulation_steps"])
        self.gradient_state.sync_each_batch = extra["sync_each_batch"]
        self._watchdog = None
        self._ulysses = None
        self._policy_logged = False
        self._ended = False
        self._autocast_gate = AutocastGate()
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self.prepared = PreparedObjects(self._models, self._optimizers, self._schedulers, self._dataloaders)
        self.trackers, self._checkpoint_objects = [], []
        self._save_hooks, self._load_hooks, self._no_sync_depth = {}, {}, {}
        self._progress = None
        self._call_check = CallCheck(extra["collective_timeout_s"])
        self._dispatch_group = None
        compat_state.register(self)

    @property
    def engine(self) -> Engine:
        """The engine of this Accelerator's backend (built at first use after unpickling)."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            engine = self._engine_after_unpickling()
        return engine

    @engine.setter
    def engine(self, value: Engine) -> None:
        self.__dict__["_engine"] = value

    def _engine_after_unpickling(self) -> Engine:
        if "_engine_args" not in self.__dict__:
            raise AttributeError("engine: this Accelerator's __init__ did not finish")
        comm_cls, fused, options = self._engine_args
        options = dict(options)
        if comm_cls.distributed:
            group = self.state.group
            if isinstance(group, DetachedGroup):
                group.rank()  # the RuntimeError naming the fix
            if group is None:
                raise RuntimeError(f"this unpickled Accelerator's {comm_cls.name} engine has no process group; "
                                   f"make a new Accelerator in this process")
            options["group"] = group
        engine = Engine(self.policy, self.device, comm_cls, fused_optimizer=fused, **options)
        settings = self.__dict__.pop("_pending_engine_settings", None)
        if settings is not None:
            engine.set_nonfinite_policy(settings[0])
            engine.clip_in_step, engine.cache_weight_casts = settings[1], settings[2]
        self._engine_args = (comm_cls, fused, options)
        self.engine = engine
        _LIVE.add(self)
        return engine

    def _renew_engine(self) -> None:
        """free_memory(): a fresh engine of the same kind, the old one's buffers released."""
        comm_cls, fused, options = self._engine_args
        old = self.engine
        old.release()
        self.engine = Engine(self.policy, self.device, comm_cls, fused_optimizer=fused, **options)
        self.engine.set_nonfinite_policy(old.nonfinite_grads)
        self.engine.clip_in_step = old.clip_in_step
        self.engine.cache_weight_casts = old.cache_weight_casts
        if self._tp:
            for layout in filter(None, map(tensor_parallel.layout_of, self._models)):
                tensor_parallel.attach(self.engine, layout, self.state.group.group_name)
        self.gradient_state.step, self.gradient_state.sync_gradients = 0, True

    # ------------------------------------------------------------------ info
    @property
    def _tp(self) -> bool:
        return self.mesh is not None and self.mesh.tp_size > 1

    @property
    def mixed_precision(self) -> str:
        return self.policy.name

    @property
    def backend(self) -> str:
        engine = self.__dict__.get("_engine")  # an unpickled Accelerator builds its engine at first use
        return engine.name if engine is not None else self._engine_args[0].name

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-batch ends an accumulation window."""
        return self.gradient_state.sync_gradients

    @property
    def dataloader_config(self):
        """The dataloader settings in effect, as a ``DataLoaderConfiguration``. Assigning one
        (mixprec's or Accelerate's) changes how dataloaders prepared from then on are served,
        as in Accelerate; those prepared before keep theirs."""
        from .compat.options import DataLoaderConfiguration

        return DataLoaderConfiguration(split_batches=self.split_batches, even_batches=self.even_batches,
                                       use_seedable_sampler=self.use_seedable_sampler, data_seed=self.data_seed,
                                       non_blocking=self.non_blocking, dispatch_batches=self.dispatch_batches,
                                       use_stateful_dataloader=self.use_stateful_dataloader)

    @dataloader_config.setter
    def dataloader_config(self, value) -> None:
        from .compat.options import DataLoaderConfiguration, read_fields

        dl = read_fields(value, DataLoaderConfiguration, "dataloader_config")
        self.split_batches, self.even_batches = bool(dl.split_batches), bool(dl.even_batches)
        self.use_seedable_sampler, self.data_seed = bool(dl.use_seedable_sampler), dl.data_seed
        self.non_blocking, self.dispatch_batches = bool(dl.non_blocking), dl.dispatch_batches
        self.use_stateful_dataloader = bool(dl.use_stateful_dataloader)
        if self.use_stateful_dataloader:
            _stateful_loader_class()

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

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
    def _check_not_reset(self) -> None:
        """After ``AcceleratorState._reset_state()`` an Accelerator made before it cannot
        prepare, as in Accelerate ([Note: state objects backed by the live Accelerator] in
        compat/state.py)."""
        if self.__dict__.get("_state_reset"):
            raise AttributeError(compat_state.RESET_MESSAGE.format(name="distributed_type"))

    def prepare(self, *objs: Any):
        """Wrap models, optimizers, dataloaders and schedulers; returned in the order given.

        Models are prepared first, then optimizers (so they can be pointed at fp32
        masters), then schedulers and dataloaders.
        """
        self._check_not_reset()
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

    @staticmethod
    def init_empty_weights(include_buffers: bool = False):
        """Accelerate's ``init_empty_weights``: parameters created inside are on the meta device
        (no memory); ``prepare()`` materialises them, under tensor parallelism only this rank's
        shards ([Note: materialising a meta model shard by shard] in parallel/materialize.py)::

            with accelerator.init_empty_weights():
                model = AutoModelForCausalLM.from_config(config)
            model = accelerator.prepare(model)
        """
        return materialize.init_empty_weights(include_buffers)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self._check_not_reset()
        if isinstance(model, PreparedOptimizer):
            raise TypeError("prepare_model() got an optimizer")
        if is_prepared(model) and model in self._models:
            return model
        _clear_stale_grads(model)
        compose(self, model)  # TP, the engine, SP, checkpointing: [Note: the order of the parallelisms]
        _gather_for_save_pretrained(self, model)
        self._models.append(model)
        if self._log_policy and not self._policy_logged:
            self.print(startup_line(self, model), flush=True)  # mixprec/startup.py
            self._policy_logged = True
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        self._check_not_reset()
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        if self._tp:
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

    def prepare_data_loader(self, dataloader: torch.utils.data.DataLoader,
                            device_placement: Optional[bool] = None) -> PreparedDataLoader:
        self._check_not_reset()
        if isinstance(dataloader, PreparedDataLoader):
            if dataloader in self._dataloaders:
                return dataloader  # preparing twice gives the same loader
            dataloader = dataloader.original  # another Accelerator's: shard the user's loader anew
        original = dataloader
        loader_cls = _stateful_loader_class() if self.use_stateful_dataloader else torch.utils.data.DataLoader
        # data_seed / use_seedable_sampler concern plain shuffling loaders only.
        plain_shuffle = (type(dataloader.sampler) is torch.utils.data.RandomSampler
                         and not dataloader.sampler.replacement
                         and dataloader.sampler.num_samples == len(dataloader.dataset))
        seed = self.data_seed if plain_shuffle else None
        seeded = plain_shuffle and (self.use_seedable_sampler or seed is not None)
        dispatch = self.dispatch_batches
        if dispatch is None:  # Accelerate's default: rank 0 reads a stream (an IterableDataset)
            dispatch = isinstance(dataloader.dataset, torch.utils.data.IterableDataset) and self.mesh is None
        if dispatch and self.mesh is not None:
            raise ValueError(
                "dataloader_config.dispatch_batches=True is not supported under tensor or sequence parallelism (the "
                "ranks of a TP/SP group read the same batches); use dispatch_batches=False"
            )
        if dispatch and self.state.world_size > 1:
            from .data.dispatch import DispatchedLoader

            if self._dispatch_group is None:  # its own group: [Note: dispatching batches]
                self._dispatch_group = torch.distributed.new_group(backend="gloo")
            if self.use_stateful_dataloader:  # rank 0 reads a StatefulDataLoader
                dataloader = _as_stateful(dataloader, loader_cls)
            dataloader = DispatchedLoader(dataloader, rank=self.state.rank, world_size=self.state.world_size,
                                          group=self._dispatch_group, split_batches=self.split_batches,
                                          even_batches=self.even_batches)
        elif self.state.world_size > 1:
            # Under tensor or sequence parallelism the ranks of a TP/SP group read the same
            # batches: the loader shards over the data-parallel ranks only.
            mesh = self.mesh
            dataloader = shard_dataloader(
                dataloader, self.state, split_batches=self.split_batches,
                even_batches=self.even_batches, seed=seed,
                use_seedable_sampler=self.use_seedable_sampler,
                shard=None if mesh is None else (mesh.dp_rank, mesh.dp_size), loader_cls=loader_cls,
            )
        elif seeded or self.use_stateful_dataloader:
            # One process: the same seeded order (seed + epoch) several processes would share;
            # or the samplers that keep a StatefulDataLoader's position (data/sharding.py).
            dataloader = shard_dataloader(dataloader, self.state, seed=seed,
                                          use_seedable_sampler=self.use_seedable_sampler, loader_cls=loader_cls)
        place = self.device_placement if device_placement is None else device_placement
        # Resumable: save_state records the position in the pass, load_state skips ahead
        # (or, with use_stateful_dataloader, restores the StatefulDataLoader's own state).
        kind = StatefulPreparedDataLoader if self.use_stateful_dataloader else ResumableDataLoader
        prepared = kind(dataloader, self.device if place else None, self.gradient_state,
                        original=original, non_blocking=self.non_blocking)
        sp = self.config.config.sequence_parallel
        if sp.prepare_batches:
            prepared.batch_transform = lambda batch, seq_dim=sp.seq_dim: self._sp_batch(batch, seq_dim)
        self._dataloaders.append(prepared)
        return prepared

    # ------------------------------------------------------ sequence parallelism
    def prepare_sp_inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                          position_ids: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1) -> dict:
        """This rank's kwargs for ``model(**batch)`` under ``sequence_parallel.size`` = P
        (docs/sequence_parallel.md): its slice of ``input_ids`` along ``seq_dim`` (the
        length must be a multiple of P), the slice's ``position_ids`` in the whole sequence
        (default ``0..S-1``), and with ``labels``: ``shift_labels`` (labels shifted one token
        left *before* slicing, so no target is lost at a slice border; also given as
        ``labels`` so HF models compute their loss) and ``num_items_in_batch``, the loss
        normaliser that makes the engine's average the exact whole-sequence loss
        ([Note: the sequence-parallel loss] in parallel/sequence/inputs.py). A padding
        ``attention_mask`` is not handed to the model: the attention applies the whole
        sequence's causal-and-padding mask itself (an all-ones mask is dropped). Without sequence parallelism: the whole sequence, same keys.
        Every rank of an SP group must pass the same whole batch (a prepared DataLoader
        gives it).

        Example::

            batch = accelerator.prepare_sp_inputs(input_ids=ids, labels=ids)
            loss = model(**batch).loss            # HF: sum of this slice's token losses / normaliser
            accelerator.backward(loss)
            logged = accelerator.reduce(loss.detach(), "mean")   # the whole-sequence loss
        """
        return sequence_parallel.prepare_inputs(self._ulysses, input_ids, labels, position_ids, attention_mask,
                                                seq_dim)

    def prepare_autosp_inputs(self, input_id: torch.Tensor, label_id: Optional[torch.Tensor] = None,
                              position_id: Optional[torch.Tensor] = None,
                              attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1) -> dict:
        """:meth:`prepare_sp_inputs` under DeepSpeed's AutoSP argument names
        (``deepspeed.compile.passes.sp_compile.prepare_autosp_inputs``); returns the kwargs
        for ``model(**batch)`` (DeepSpeed tags the tensors in place instead)."""
        return self.prepare_sp_inputs(input_id, label_id, position_id, attention_mask, seq_dim)

    def sp_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """Your own token loss under sequence parallelism: the cross-entropy of ``logits``
        against ``batch["shift_labels"]`` summed over this slice and divided by
        ``batch["num_items_in_batch"]`` (``batch`` from :meth:`prepare_sp_inputs`), which is
        what HF's built-in loss computes from the same batch.

        Example::

            batch = accelerator.prepare_sp_inputs(input_ids=ids, labels=ids)
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = accelerator.sp_loss(logits, batch)

        Pass ``position_ids`` (this slice's positions in the whole sequence): without them
        the model numbers every slice's tokens from 0, wrong positions for all but the first.
        """
        return sequence_parallel.token_loss(logits, batch)

    def _sp_batch(self, batch: Any, seq_dim: int) -> dict:
        """``sequence_parallel.prepare_batches``: a loader's mapping batch, sliced."""
        from collections.abc import Mapping

        keys = ("input_ids", "labels", "position_ids", "attention_mask")
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TypeError(f"sequence_parallel.prepare_batches needs batches that are mappings with 'input_ids' "
                            f"(and optional {', '.join(keys[1:])}), got {type(batch).__name__}; collate to a "
                            "dict, or call accelerator.prepare_sp_inputs yourself")
        out = {k: v for k, v in batch.items() if k not in keys}
        out.update(self.prepare_sp_inputs(*(batch.get(k) for k in keys), seq_dim=seq_dim))
        return out

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module. With ``keep_fp32_wrapper=False`` the policy's forward
        behaviour (autocast, input/output casts) is removed from it."""
        if not keep_fp32_wrapper:
            restore_class(model)
        return model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Full-precision state dict: parameters from the fp32 masters where there are, whole
        under tensor parallelism. A collective (every rank calls it) only where the weights
        must be gathered: zero3/fsdp, tensor parallelism, zero1/2 with low-precision stored
        parameters. Elsewhere (ddp, zero1/2 in fp32 storage) one rank may call it alone,
        e.g. under ``if accelerator.is_main_process:``, also after :meth:`end_training`."""
        if tensor_parallel.layout_of(model) is None and self.engine.comm.full_state_is_local(model):
            return self.engine.full_state_dict(model)
        if self._ended:
            raise RuntimeError(
                f"get_state_dict() after end_training(): {type(model).__name__}'s full weights are gathered from "
                f"the {self.backend} shards over the process group, which end_training() released; call "
                f"get_state_dict(model) (or save_pretrained/save_model) before accelerator.end_training()"
            )
        return self._gathered_state_dict(model)

    @desync.tracked("get_state_dict", desync.plain_signature)
    def _gathered_state_dict(self, model: nn.Module) -> dict:
        return tensor_parallel.full_state_dict(model, self.engine.full_state_dict(model))

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

    @desync.tracked("save_16bit_model")
    def save_16bit_model(self, model: nn.Module, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's call of the same name: the model's full weights, gathered from every
        TP, zero3 and fsdp shard, in the policy's compute dtype (bf16/fp16; fp32 under
        ``mixed_precision="no"``), written by the main process to ``save_dir/save_filename``
        (safetensors when the name ends in ``.safetensors``, ``torch.save`` otherwise),
        atomically. Every rank calls it; returns True once the file is written. The file
        loads with plain ``load_state_dict`` (or ``from_pretrained``), without mixprec.

        Example::

            accelerator.save_16bit_model(model, "export", "model.safetensors")
        """
        from .compat.export import write_single

        self._call_check(self.state, "save_16bit_model")
        state = self.get_state_dict(model)
        if exclude_frozen_parameters:
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        error = None
        if self.is_main_process:
            try:
                write_single(state, save_dir, save_filename, self.policy.compute_dtype)
            except (ValueError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
        error = collectives.broadcast_object_list(self.state, [error])[0]
        if error is not None:
            raise ValueError(f"save_16bit_model({str(save_dir)!r}, {save_filename!r}) failed: {error}")
        return True

    def gathered_parameters(self, params_or_module, modifier_rank: Optional[int] = None,
                            writeback: bool = False, rank0_only: bool = False):
        """Context in which the full values of ``params_or_module`` (a prepared module, a
        parameter, or an iterable of parameters) are present and can be read or changed.

        A collective: every rank of the group enters it. zero3/fsdp gather the units holding
        them on entry and free them on exit; the other backends hold full parameters
        already. ``modifier_rank=r``: rank r's values are broadcast on exit and written to
        the fp32 masters (and shards) of every rank; ``writeback=True``: each rank writes
        back what it owns from its own values. ``rank0_only``: only rank 0 keeps the values
        inside. Optimizer state is untouched. Nested scopes gather once (docs/fsdp.md,
        [Note: the gathering context] in engines/gathered.py).

        Example::

            with accelerator.gathered_parameters(model.head, modifier_rank=0):
                torch.nn.init.zeros_(model.head.weight)
        """
        return gathered.scope_for(self.engine, params_or_module, modifier_rank=modifier_rank,
                                  writeback=writeback, rank0_only=rank0_only)

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

    # ------------------------------------------------------------ processes
    def wait_for_everyone(self) -> None:
        """A barrier across all processes."""
        collectives.barrier(self.state)

    @contextlib.contextmanager
    def main_process_first(self):
        """Run the block on the main process first, then on the others (e.g. a download)."""
        if not self.is_main_process:
            _first_barrier(self.state)
        with desync.long_body() if self.is_main_process else contextlib.nullcontext():
            yield
        if self.is_main_process:
            _first_barrier(self.state)

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Like :meth:`main_process_first`, per node."""
        if not self.is_local_main_process:
            _first_barrier(self.state)
        with desync.long_body() if self.is_local_main_process else contextlib.nullcontext():
            yield
        if self.is_local_main_process:
            _first_barrier(self.state)

    def join_uneven_inputs(self, joinables, even_batches: Optional[bool] = None):
        """Context manager for loops where ranks get different numbers of batches (Accelerate's
        semantics): a rank whose data ran out leaves the block and shadows the forwards,
        backwards and optimizer steps the other ranks still run on ``joinables`` (prepared
        models and optimizers), on every backend, so their collectives complete
        ([Note: shadowing by announcement] in mixprec/join.py). ``even_batches`` overrides
        the prepared map-style dataloaders' setting inside the block (an iterable one keeps
        its own, with a warning). With even batches in effect it does nothing.

        Example::

            with accelerator.join_uneven_inputs([model, optimizer], even_batches=False):
                for x, y in loader:
                    accelerator.backward(loss_fn(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        """
        from .join import join_uneven_inputs

        return join_uneven_inputs(self, joinables, even_batches)

    def gather(self, tensor):
        """All-gather tensors (nested containers too), concatenated on dim 0."""
        return collectives.gather(self.state, tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """``gather``, dropping the samples even-batching duplicated at the end of an epoch;
        under tensor/sequence parallelism each sample once, from one rank per data-parallel
        rank ([Note: metrics over data-parallel ranks] in distributed/collectives.py)."""
        ranks = self._data_ranks()
        if use_gather_object or not _has_tensor(input_data):
            gathered = collectives.gather_object(self.state, input_data, ranks)
            flat = [x for part in gathered for x in (part if isinstance(part, list) else [part])]
            remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else None
            return flat[:remainder] if remainder else flat
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else None
        return collectives.gather_for_metrics(self.state, input_data, remainder, ranks)

    def _data_ranks(self) -> Optional[tuple]:
        """The ranks at this rank's (sp, tp) place of the mesh, one per data-parallel rank in
        order (``rank = (d * sp + s) * tp + t``, parallel/mesh.py); None without a mesh."""
        m = self.mesh
        if m is None:
            return None
        return tuple((d * m.sp_size + m.sp_rank) * m.tp_size + m.tp_rank for d in range(m.dp_size))

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Reduce tensors across processes (``"sum"``, ``"mean"``, ``"max"``, ``"min"``), then
        multiply by ``scale``; returns new tensors."""
        out = collectives.reduce(self.state, tensor, reduction)
        if scale != 1.0:
            from .utils import tree_map_tensors

            out = tree_map_tensors(lambda t: t * scale, out)
        return out

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        """Pad tensors on ``dim`` to the largest size over processes, so they can be gathered."""
        return collectives.pad_across_processes(self.state, tensor, dim, pad_index, pad_first)

    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Context manager giving this process its share of ``inputs``."""
        return collectives.split_between_processes(self.state, inputs, apply_padding)

    def end_training(self) -> None:
        """Tear down the process group this Accelerator initialised.

        The engine first drops its C++ objects that hold the group (reducers, sharding
        cores): a group destroyed here but kept alive by them would only be torn down at
        interpreter exit, where Gloo aborts ("terminate called without an active exception").
        """
        self._finish_trackers()
        self._ended = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self.engine.release()
        gc.collect()
        destroy_distributed(self.state)

    # ------------------------------------------------------------ checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with ``state_dict``/``load_state_dict``,
        e.g. an EMA or a custom counter) with every ``save_state``/``load_state``, in order."""
        bad = [o for o in objects if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise TypeError(
                f"register_for_checkpointing() got {[type(o).__name__ for o in bad]} without "
                "state_dict()/load_state_dict(); give objects that have both (wrap others in a small class)"
            )
        self._checkpoint_objects.extend(objects)

    @desync.tracked("save_state")
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> str:
        """Save models, optimizers, scaler, schedulers, RNG, dataloader positions and registered
        objects to ``output_dir`` (or the next ``checkpoint_<k>`` with automatic naming).

        Collective: every process calls it. Atomic: a crash leaves the previous checkpoint
        intact. Returns the directory written.

        Example::

            accelerator.save_state("ckpt/step_500")
        """
        from pathlib import Path

        from .checkpoint import rotation
        from .checkpoint.state import save_accelerator_state

        if not safe_serialization or save_model_func_kwargs:
            raise ValueError(
                f"save_state(safe_serialization={safe_serialization!r}, {sorted(save_model_func_kwargs)}): mixprec "
                "checkpoints have one format (checksummed tensor files, docs/checkpointing.md) and no "
                "per-model save options; call save_state(output_dir) and use save_model() for exports"
            )
        self._call_check(self.state, "save_state")
        config = self.project_configuration
        automatic = output_dir is None and config.automatic_checkpoint_naming
        if output_dir is None and not automatic:
            raise ValueError(
                "save_state() needs output_dir=, or Accelerator(project_config=ProjectConfiguration("
                "project_dir=..., automatic_checkpoint_naming=True))"
            )
        target = config.checkpoints_dir / f"checkpoint_{config.iteration}" if automatic else Path(output_dir)
        save_accelerator_state(self, target, self._checkpoint_objects)
        self._run_save_hooks(str(target))
        if automatic:
            config.iteration += 1
            if self.is_main_process:
                rotation.rotate(config.checkpoints_dir, config.total_limit)
            self.wait_for_everyone()
        return str(target)

    @desync.tracked("load_state")
    def load_state(self, input_dir: Optional[str] = None) -> str:
        """Restore what :meth:`save_state` wrote, into the prepared objects, whatever backend
        or world size saved it. Without ``input_dir`` (automatic naming) the newest complete
        checkpoint. Collective. A mismatch or a corrupt checkpoint raises and loads nothing.

        Example::

            accelerator.load_state("ckpt/step_500")
        """
        from pathlib import Path

        from .checkpoint import rotation
        from .checkpoint.state import load_accelerator_state

        self._call_check(self.state, "load_state")
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError(
                    "load_state() needs input_dir=, or automatic_checkpoint_naming=True in project_config"
                )
            source = rotation.latest_checkpoint(config.checkpoints_dir)
        else:
            source = Path(input_dir)
        self._run_load_hooks(str(source))
        load_accelerator_state(self, source, self._checkpoint_objects)
        number = rotation.checkpoint_number(source)
        if config.automatic_checkpoint_naming and number is not None:
            config.iteration = number + 1
        return str(source)

    @desync.tracked("save_model")
    def save_model(self, model: nn.Module, save_directory: str, max_shard_size: Union[int, str] = "10GB",
                   safe_serialization: bool = True, *, dtype: Union[str, torch.dtype, None] = None) -> str:
        """Write ``model``'s full weights (fp32 masters, cast to ``dtype`` if given) to
        ``save_directory/model.safetensors`` (``pytorch_model.bin`` with
        ``safe_serialization=False``), split into ``model-0000k-of-0000n.safetensors`` files
        plus an index when larger than ``max_shard_size`` (bytes, or ``"10GB"``, ``"500MiB"``).
        Call it on every process; the main process writes. Returns the file (or index) written.

        Example::

            accelerator.save_model(model, "export", dtype="bf16")
        """
        from .compat.export import parse_size, write_model

        self._call_check(self.state, "save_model")
        limit = parse_size(max_shard_size)
        state = self.get_state_dict(model)
        out = None
        error = None
        if self.is_main_process:
            try:
                out = write_model(state, save_directory, limit, safe_serialization, dtype)
            except (ValueError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
        error, out = collectives.broadcast_object_list(self.state, [error, out])
        if error is not None:
            raise ValueError(f"save_model({str(save_directory)!r}) failed: {error}")
        return str(out)


# [Note: shutdown without end_training]
# Most scripts never call end_training(). At interpreter exit the engines' C++ objects
# (reducers, sharding cores) would then keep the process group alive into finalization,
# where a Gloo worker still releasing a tensor aborts the process ([Note: exit after a
# collective] in distributed/state.py). So an atexit hook does what end_training() does
# for every Accelerator still alive: release the engine, then destroy the default group if
# an Accelerator created it (a group made by the caller is left to the caller).
_LIVE = registry.LIVE  # the Accelerators the exit hook releases (src/mixprec/registry.py)
# main_process_first's barrier, checked under its own name: the main process may be inside
# the block far longer than collective_timeout, which its peers' check allows.
_first_barrier = desync.tracked("main_process_first", desync.plain_signature)(collectives.barrier)
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
    elif live:
        let_collective_workers_finish()


atexit.register(_shutdown_at_exit)


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
        f"([Note: gradients before prepare()] in mixprec/accelerator.py)",
        StaleGradientsWarning, stacklevel=4,
    )


class StaleGradientsWarning(UserWarning):
    """``prepare()`` cleared gradients a backward before it left on the model's parameters."""


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


def _stateful_loader_class() -> type:
    """torchdata's StatefulDataLoader, for ``use_stateful_dataloader=True``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as e:
        raise ImportError(
            f"dataloader_config.use_stateful_dataloader=True needs torchdata's StatefulDataLoader, which is not "
            f"importable here ({e}); install it (`pip install torchdata`), or drop the option: prepared "
            f"dataloaders resume mid-epoch through save_state/load_state without it (docs/checkpointing.md)"
        ) from None
    return StatefulDataLoader


def _as_stateful(loader: torch.utils.data.DataLoader, loader_cls: type) -> torch.utils.data.DataLoader:
    """The same loader as a StatefulDataLoader (for rank 0 of a dispatched one)."""
    from .data.sharding import _KEPT

    if not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        one = DistributedState()  # one process: no communication, the loader's own order
        return shard_dataloader(loader, one, loader_cls=loader_cls)
    kept = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
    if loader.num_workers > 0:
        kept["prefetch_factor"] = loader.prefetch_factor
    else:
        kept.pop("persistent_workers", None)
    return loader_cls(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kept)


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1  # init_distributed reports a malformed WORLD_SIZE


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(x) for x in obj.values())
    return False


def _gather_for_save_pretrained(acc: "Accelerator", model: nn.Module) -> None:
    """zero3/fsdp/TP: give the prepared model's context the gather its ``save_pretrained``
    uses ([Note: save_pretrained of a sharded model] in src/mixprec/wrappers/model.py). Weak
    references: the model does not keep the Accelerator alive."""
    from .engines.gathered import is_guarded

    ctx = getattr(model, "_mixprec_ctx", None)
    if ctx is None or not (tensor_parallel.layout_of(model) is not None
                           or any(is_guarded(p) for p in model.parameters())):
        return
    acc_ref, model_ref = weakref.ref(acc), weakref.ref(model)

    def gather() -> dict:
        owner, m = acc_ref(), model_ref()
        if owner is None or m is None:
            raise RuntimeError("save_pretrained() of a zero3/fsdp/TP model whose Accelerator is gone: its full "
                               "weights cannot be gathered; pass state_dict= taken with accelerator.get_state_dict(model)")
        return owner.get_state_dict(m)

    ctx.full_state_dict = gather
