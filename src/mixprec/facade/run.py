"""The resolved run: what ``Accelerator(...)``'s arguments come to, built once.

:func:`build_run` reads the arguments (mixprec's and Accelerate's, src/mixprec/compat/setup.py),
resolves the configuration once (every source: file, environment, arguments; the ddp block
takes ``DistributedDataParallelKwargs`` only when ddp runs), picks the precision policy and the
device, joins the process group, lays out the tensor/sequence-parallel mesh and builds the
engine. The engine is built from an :class:`EngineSpec`, the one place that writes the
engine's settings: ``free_memory()`` and an unpickled Accelerator build theirs from the same
spec (facade/lifetime.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Optional

import torch

from .. import activation_checkpointing as act_ckpt
from .. import registry
from ..compat.setup import CompatSettings
from ..compat.setup import translate as translate_accelerate_options
from ..compat.state import AcceleratorState
from ..config.fields import DTYPES
from ..config.resolve import ResolvedConfig, flatten_object
from ..config.resolve import resolve as resolve_config
from ..device import check_device_supports, pick_device
from ..distributed.state import DistributedState, destroy_distributed, init_distributed, init_single_process_group
from ..engines import Engine, resolve_backend
from ..parallel import sequence as sequence_parallel
from ..parallel import tensor as tensor_parallel
from ..policy import PrecisionPolicy, ScalerConfig


class NotGiven:
    """Default of arguments for which None is a meaningful value (e.g. "disabled")."""

    def __repr__(self) -> str:
        return "<from config>"


NOT_GIVEN = NotGiven()

# The constructor arguments that are config keys (None: not given).
CONFIG_KEY_ARGUMENTS = (
    "mixed_precision", "gradient_accumulation_steps", "cpu", "backend", "param_dtype", "keep_fp32_modules",
    "fused_optimizer", "step_scheduler_with_optimizer", "log_policy", "split_batches", "even_batches",
    "data_seed", "gradient_clipping", "nonfinite_grads", "clip_in_step", "cache_weight_casts",
)


@dataclasses.dataclass
class EngineSpec:
    """What an engine is built from: its Comm class, options (with ``group`` for a
    distributed backend) and the settings the Accelerator gives it."""

    comm: type
    fused_optimizer: bool
    options: dict
    nonfinite_grads: str
    clip_in_step: bool
    cache_weight_casts: bool
    cpu_fp16_matmul: str = "auto"

    def build(self, policy: PrecisionPolicy, device: Any) -> Engine:
        engine = Engine(policy, device, self.comm, fused_optimizer=self.fused_optimizer, **self.options)
        engine.set_nonfinite_policy(self.nonfinite_grads)
        engine.clip_in_step = self.clip_in_step
        engine.cache_weight_casts = self.cache_weight_casts
        engine.cpu_fp16_matmul = self.cpu_fp16_matmul
        return engine

    def following(self, engine: Engine) -> "EngineSpec":
        """This spec with the settings ``engine`` has now (a loop may have changed them)."""
        return dataclasses.replace(self, nonfinite_grads=engine.nonfinite_grads, clip_in_step=engine.clip_in_step,
                                   cache_weight_casts=engine.cache_weight_casts,
                                   cpu_fp16_matmul=engine.cpu_fp16_matmul)

    def with_group(self, group: Any) -> "EngineSpec":
        """This spec over ``group`` (None: without one, as pickled)."""
        options = {k: v for k, v in self.options.items() if k != "group"}
        if group is not None:
            options["group"] = group
        return dataclasses.replace(self, options=options)


@dataclasses.dataclass
class Run:
    """The resolved run (see the module docstring)."""

    config: ResolvedConfig
    policy: PrecisionPolicy
    state: AcceleratorState
    mesh: Any  # the (dp, sp, tp) rank mesh under tensor/sequence parallelism (parallel/mesh.py), else None
    ulysses: Any  # the sequence-parallel attention (parallel/sequence/), else None
    engine_spec: EngineSpec
    engine: Engine
    compat: CompatSettings  # Accelerate's options beyond the config keys


def build_run(arguments: dict) -> Run:
    """The run of ``Accelerator(**arguments)`` (every constructor argument, by name)."""
    given = {name: arguments[name] for name in CONFIG_KEY_ARGUMENTS}
    compat = translate_accelerate_options(
        given, dataloader_config=arguments["dataloader_config"],
        gradient_accumulation_plugin=arguments["gradient_accumulation_plugin"],
        kwargs_handlers=arguments["kwargs_handlers"], scaler=arguments["scaler"],
        scheduler_step_rule=arguments["scheduler_step_rule"],
    )
    scaler = arguments["scaler"] if compat.scaler is None else compat.scaler
    timeout = arguments["timeout"] if compat.timeout is None else compat.timeout
    options = dict(arguments["engine_options"] or {})
    group = options.pop("group", None)  # a process group: not a config value
    # The world size is known before the group exists (launchers export WORLD_SIZE).
    config = resolve_config(
        arguments["config"], args=_config_args(compat.given, arguments, scaler), engine_options=options,
        world_size=env_world_size(), backend_options={"ddp": compat.ddp_options},
    )
    policy = _policy(config, arguments["policy"])
    creates_group = not _group_exists()
    state, comm = _join_group(pick_device(arguments["device"], config.config.cpu), config, timeout)
    mesh, ulysses = _mesh(config, comm, state)
    if creates_group and state.group is not None:
        registry.CREATED_GROUPS.add(state.group.group_name)
    check_device_supports(state.device, policy)
    options = config.engine_options()
    if comm.distributed:
        # TP: the DP group; SP: the whole world ([Note: the sequence-parallel loss]).
        dp_group = mesh.dp_group if mesh is not None and mesh.tp_size > 1 else state.group
        options["group"] = group if group is not None else dp_group
    cfg = config.config
    spec = EngineSpec(comm, cfg.fused_optimizer, options, cfg.nonfinite_grads, cfg.clip_in_step,
                      cfg.cache_weight_casts, cfg.cpu_fp16_matmul)
    try:
        engine = spec.build(policy, state.device)
    except BaseException:
        if creates_group:  # nothing else will tear down the group made for this engine
            destroy_distributed(state)
        raise
    # Accelerate's attribute names over the same DistributedState (compat/state.py).
    state = AcceleratorState.from_state(state, mixed_precision=policy.name, backend_name=comm.name)
    return Run(config, policy, state, mesh, ulysses, spec, engine, compat)


def _config_args(given: dict, arguments: dict, scaler: Optional[ScalerConfig]) -> dict:
    """``{config key: (value, argument name)}`` of the config-key arguments given."""
    args = {key: (value, key) for key, value in given.items() if value is not None}
    if arguments["max_consecutive_overflows"] is not NOT_GIVEN:
        args["max_consecutive_overflows"] = (arguments["max_consecutive_overflows"], "max_consecutive_overflows")
    if scaler is not None:
        if not isinstance(scaler, ScalerConfig):
            raise TypeError(f"scaler={scaler!r} must be a mixprec.ScalerConfig")
        args.update({f"scaler.{k}": (v, f"scaler.{k}") for k, v in flatten_object(scaler).items()})
    if arguments["activation_checkpointing"] is not None:
        args.update(act_ckpt.config_args(arguments["activation_checkpointing"]))
    return args


def _policy(config: ResolvedConfig, policy: Optional[PrecisionPolicy]) -> PrecisionPolicy:
    """The precision policy: ``policy=`` or the ``mixed_precision`` preset, with the config's
    ``param_dtype``, ``keep_fp32_modules`` and (given) ``scaler.*`` keys."""
    cfg, settings = config.config, config.settings
    given_scaler = any(s.kind != "default" for k, s in settings.items() if k.startswith("scaler."))
    return resolve_policy(
        cfg.mixed_precision if settings["mixed_precision"].kind != "default" else None,
        policy,
        param_dtype=DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
        keep_fp32_modules=tuple(cfg.keep_fp32_modules),
        scaler=cfg.scaler if given_scaler else None,
    )


def resolve_policy(mixed_precision: Optional[str], policy: Optional[PrecisionPolicy], **overrides: Any) -> PrecisionPolicy:
    """``policy`` (checked against ``mixed_precision``) or the preset, with ``overrides``
    (None and () mean not given)."""
    overrides = {k: v for k, v in overrides.items() if v is not None and v != ()}
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


def _group_exists() -> bool:
    """A group that existed before any Accelerator belongs to whoever made it."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _join_group(device: Any, config: ResolvedConfig, timeout: datetime.timedelta) -> tuple[DistributedState, type]:
    """This process's state in the job, and the backend's Comm class (a distributed backend
    on one process gets a one-process group)."""
    state = init_distributed(device, timeout=timeout)
    comm = resolve_backend(config.config.backend, state.world_size)
    if comm.distributed and state.group is None:
        state = init_single_process_group(state, timeout=timeout)
    return state, comm


def _mesh(config: ResolvedConfig, comm: type, state: DistributedState) -> tuple[Any, Any]:
    """The (dp, sp, tp) rank layout under tensor and/or sequence parallelism
    (parallel/mesh.py); under SP, the group's Ulysses attention (parallel/sequence/)."""
    tp_size = config.config.tensor_parallel.size
    sp_size = config.config.sequence_parallel.size
    mesh = ulysses = None
    if sp_size > 1:  # the (dp, sp, tp) mesh, TP x SP included
        mesh, ulysses = sequence_parallel.setup(comm, state, sp_size, tp_size)
    if tp_size > 1:
        mesh = tensor_parallel.setup(comm, state, tp_size, mesh)
    return mesh, ulysses


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1  # init_distributed reports a malformed WORLD_SIZE
