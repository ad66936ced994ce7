"""mixprec: correct, fast mixed-precision training for your own PyTorch loop."""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C

__version__ = "0.1.0"
__all__ = ["__version__", "build_info"]


def build_info() -> dict:
    """What the compiled core contains: torch version it was built against, CUDA yes/no."""
    return dict(_C.build_info())
