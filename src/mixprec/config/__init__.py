"""One typed configuration for a run, read from a YAML/JSON file, ``MIXPREC_*`` environment
variables and ``Accelerator(...)`` arguments, each value from exactly one source (see
docs/configuration.md).

Example::

    from mixprec import Accelerator
    accelerator = Accelerator(config="mixprec.yaml")
    print(accelerator.config.source("backend"))   # e.g. "file mixprec.yaml"
"""

from .fields import ConfigError
from .resolve import CONFIG_FILE_ENV, ResolvedConfig, Setting, config_to_dict, env_name, load_file, resolve
from .schema import (
    DDPOptions,
    FSDPOptions,
    MixprecConfig,
    SequenceParallelOptions,
    TensorParallelOptions,
    TPLayerSpec,
    TPPartitionConfig,
    Zero3Options,
    ZeroOptions,
)

__all__ = [
    "CONFIG_FILE_ENV",
    "ConfigError",
    "DDPOptions",
    "FSDPOptions",
    "MixprecConfig",
    "ResolvedConfig",
    "SequenceParallelOptions",
    "Setting",
    "TPLayerSpec",
    "TPPartitionConfig",
    "TensorParallelOptions",
    "Zero3Options",
    "ZeroOptions",
    "config_to_dict",
    "env_name",
    "load_file",
    "resolve",
]
