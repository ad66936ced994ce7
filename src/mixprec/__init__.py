"""mixprec: correct, fast mixed-precision training for your own PyTorch loop.

Example::

    from mixprec import Accelerator
    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _torch_guard

_torch_guard.check()  # before _C is loaded: a mismatched torch is an error, not a crash

# [Note: mixprec without its compiled core]
# The configuration layer (mixprec.config: read, check and explain a config file) and the
# other pure-Python modules import without the compiled extension. When mixprec._C cannot be
# imported, `import mixprec` still succeeds and every top-level name raises the ImportError
# naming the cause and the rebuild when it is used (`from mixprec import Accelerator` fails
# at that line, as before); `import mixprec.config` works. tests/test_import_graph.py checks it.
try:
    from . import _C  # noqa: E402
except ImportError as e:
    _CORE_ERROR: "ImportError | None" = e
else:
    _CORE_ERROR = None
    from .accelerator import Accelerator, StaleGradientsWarning
    from .checkpoint.rotation import ProjectConfiguration
    from .compat import (
        AcceleratorState,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        PartialState,
    )
    from .config import ConfigError, MixprecConfig
    from .diagnostics import doctor
    from .engines.gathered import GatheredParameters, summon_full_params
    from .engines.units import set_leaf_modules
    from .errors import (
        CollectiveDesyncError,
        MixprecDtypeError,
        MixprecError,
        NonFiniteGradientsError,
        NotPreparedError,
        OverflowStormError,
        PeerFailedError,
        UnitOrderError,
        UnscaledBackwardError,
        UnshardedParameterError,
    )
    from .notebook import NotebookLaunchError, notebook_launcher
    from .parallel.materialize import init_empty_weights
    from .parity import ParityReport, ParityTolerance, parity_check
    from .policy import PrecisionPolicy, ScalerConfig
    from .step import StepResult
    from .utils import find_executable_batch_size
    from .wrappers.dataloader import skip_first_batches

__version__ = "0.1.0"
__all__ = [
    "Accelerator",
    "AcceleratorState",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GatheredParameters",
    "GradientAccumulationPlugin",
    "init_empty_weights",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "PartialState",
    "build_info",
    "CollectiveDesyncError",
    "ConfigError",
    "doctor",
    "find_executable_batch_size",
    "MixprecConfig",
    "MixprecDtypeError",
    "MixprecError",
    "NonFiniteGradientsError",
    "NotPreparedError",
    "notebook_launcher",
    "NotebookLaunchError",
    "OverflowStormError",
    "PeerFailedError",
    "parity_check",
    "ParityReport",
    "ParityTolerance",
    "PrecisionPolicy",
    "ProjectConfiguration",
    "ScalerConfig",
    "StaleGradientsWarning",
    "set_leaf_modules",
    "skip_first_batches",
    "StepResult",
    "summon_full_params",
    "UnitOrderError",
    "UnscaledBackwardError",
    "UnshardedParameterError",
    "__version__",
]


def build_info() -> dict:
    """What the compiled core contains: torch version it was built against, CUDA yes/no."""
    if _CORE_ERROR is not None:
        raise _core_missing("build_info")
    return dict(_C.build_info())


def _core_missing(name: str) -> ImportError:
    error = ImportError(
        f"mixprec.{name} needs mixprec's compiled core, mixprec._C, which could not be imported "
        f"({_CORE_ERROR}); build and install it: {_torch_guard.REBUILD}. Without it only the "
        f"pure-Python modules work (mixprec.config)"
    )
    error.__cause__ = _CORE_ERROR
    return error


def __getattr__(name: str):
    if _CORE_ERROR is not None and name in __all__:
        raise _core_missing(name)
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
