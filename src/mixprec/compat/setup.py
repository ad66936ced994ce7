"""Turn Accelerate's constructor options into mixprec's settings (used by ``Accelerator.__init__``).

Each Accelerate option maps onto a mixprec argument; giving both with different values
raises a ValueError naming the two, as two config sources do (mixprec/config/resolve.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Optional

from .options import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ddp_engine_options,
    read_fields,
    sort_handlers,
)

SCHEDULER_RULES = ("accelerate", "optimizer")


@dataclasses.dataclass
class CompatSettings:
    """What the Accelerate-style options asked for, beyond the config keys."""

    given: dict  # config-key arguments (split_batches, even_batches, data_seed, gradient_accumulation_steps)
    use_seedable_sampler: bool = False
    non_blocking: bool = False
    sync_each_batch: bool = False
    dispatch_batches: Optional[bool] = None  # None: True for an IterableDataset (mixprec/data/dispatch.py)
    use_stateful_dataloader: bool = False
    ddp_options: dict = dataclasses.field(default_factory=dict)
    timeout: Optional[datetime.timedelta] = None
    scaler: Any = None  # a mixprec.ScalerConfig from GradScalerKwargs


def _merge(given: dict, key: str, value: Any, source: str) -> None:
    if value is None:
        return
    if given.get(key) is not None and given[key] != value:
        raise ValueError(
            f"{key}={given[key]!r} conflicts with {source}={value!r}; give the setting once"
        )
    given[key] = value


def translate(
    given: dict,
    *,
    dataloader_config: Any,
    gradient_accumulation_plugin: Any,
    kwargs_handlers: Any,
    scaler: Any,
    scheduler_step_rule: str,
) -> CompatSettings:
    """``given`` (the config-key arguments, None = not given) completed from the Accelerate options."""
    given = dict(given)
    out = CompatSettings(given=given)
    if scheduler_step_rule not in SCHEDULER_RULES:
        raise ValueError(
            f"scheduler_step_rule={scheduler_step_rule!r} must be 'accelerate' (a prepared scheduler steps "
            f"once per data-parallel rank per optimizer step unless split_batches) or 'optimizer' (once per step)"
        )
    if dataloader_config is not None:
        dl = read_fields(dataloader_config, DataLoaderConfiguration, "dataloader_config")
        out.dispatch_batches = dl.dispatch_batches
        out.use_stateful_dataloader = bool(dl.use_stateful_dataloader)
        _merge(given, "split_batches", dl.split_batches, "dataloader_config.split_batches")
        _merge(given, "even_batches", dl.even_batches, "dataloader_config.even_batches")
        _merge(given, "data_seed", dl.data_seed, "dataloader_config.data_seed")
        out.use_seedable_sampler = bool(dl.use_seedable_sampler)
        out.non_blocking = bool(dl.non_blocking)
    if gradient_accumulation_plugin is not None:
        plugin = read_fields(gradient_accumulation_plugin, GradientAccumulationPlugin, "gradient_accumulation_plugin")
        if not plugin.sync_with_dataloader:
            raise ValueError(
                "gradient_accumulation_plugin.sync_with_dataloader=False is not supported: the last batch of "
                "a prepared dataloader always closes the accumulation window; drop the option"
            )
        _merge(given, "gradient_accumulation_steps", plugin.num_steps, "gradient_accumulation_plugin.num_steps")
        out.sync_each_batch = bool(plugin.sync_each_batch)
    handlers = sort_handlers(kwargs_handlers)
    if "DistributedDataParallelKwargs" in handlers:
        out.ddp_options = ddp_engine_options(handlers["DistributedDataParallelKwargs"])
    if "InitProcessGroupKwargs" in handlers:
        out.timeout = handlers["InitProcessGroupKwargs"].timeout
    if "GradScalerKwargs" in handlers:
        from ..policy import ScalerConfig

        h = handlers["GradScalerKwargs"]
        if not h.enabled:
            raise ValueError(
                "GradScalerKwargs(enabled=False): mixprec's fp16 always scales the loss (unscaled fp16 "
                "gradients underflow); use mixed_precision='bf16' (no scaling needed) or keep enabled=True"
            )
        if scaler is not None:
            raise ValueError("scaler= and kwargs_handlers=[GradScalerKwargs(...)] both configure the loss "
                             "scaler; give one of them")
        out.scaler = ScalerConfig(init_scale=h.init_scale, growth_factor=h.growth_factor,
                                  backoff_factor=h.backoff_factor, growth_interval=h.growth_interval)
    return out
