"""The running torch must be the one ``mixprec._C`` was compiled against.

A libtorch C++ extension is tied to the exact torch release it was built with: its symbols,
class layouts and inline code come from that release's headers. Loaded beside another
release it fails later, as an undefined symbol or, worse, as memory corruption. Another
package can swap torch without a word (torchvision's PyPI wheel pulls a CUDA torch, for one),
so ``import mixprec`` compares the two before it loads ``_C``, as torchvision does.

What is compared: the release (``2.13.0`` of ``2.13.0+cpu``; the local label names the
wheel's flavour, not its ABI) and the CUDA flavour (``torch.version.cuda``: ``None`` for a CPU
build, ``"13.0"`` for a CUDA 13.0 build). The build side is written by CMakeLists.txt into
``mixprec/_build_torch.py`` when the extension is compiled.

``MIXPREC_ALLOW_TORCH_MISMATCH=1`` turns the error into a warning, for those who know the
two releases are compatible.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

OVERRIDE_ENV = "MIXPREC_ALLOW_TORCH_MISMATCH"
REBUILD = (
    "pip install --no-build-isolation --force-reinstall --no-deps mixprec "
    "(from a source checkout: make install, or pip install --no-build-isolation -e .)"
)


class TorchMismatchError(ImportError):
    """The running torch is not the one mixprec's compiled core was built against."""


def _release(version: str) -> str:
    return str(version).split("+", 1)[0]


def _flavour(cuda: Optional[str]) -> str:
    return "CPU" if not cuda else f"CUDA {cuda}"


def mismatch(built_version: str, built_cuda: Optional[str], running_version: str,
             running_cuda: Optional[str]) -> Optional[str]:
    """A message naming both torches and the fix, or None when they match."""
    same_release = _release(built_version) == _release(running_version)
    same_flavour = (built_cuda or None) == (running_cuda or None)
    if same_release and same_flavour:
        return None
    return (
        f"mixprec's compiled core (mixprec._C) was built against torch {built_version} "
        f"({_flavour(built_cuda)}), but torch {running_version} ({_flavour(running_cuda)}) is "
        "installed: a C++ extension only works with the torch release it was compiled "
        f"against. Rebuild mixprec against the installed torch: {REBUILD}; or reinstall "
        f"torch {_release(built_version)}. Set {OVERRIDE_ENV}=1 to import anyway (a warning "
        "instead of this error)."
    )


def check(build_record=None) -> None:
    """Raise TorchMismatchError (or warn, with the override set) when the running torch is
    not the one ``_C`` was built against. ``build_record``: the module written at build time
    (``mixprec._build_torch``), given by tests."""
    import torch

    if build_record is None:
        try:
            from . import _build_torch as build_record
        except ImportError:  # built before the record existed: nothing to compare
            return
    message = mismatch(build_record.TORCH_VERSION, build_record.TORCH_CUDA,
                       torch.__version__, torch.version.cuda)
    if message is None:
        return
    if os.environ.get(OVERRIDE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        warnings.warn(f"{message} ({OVERRIDE_ENV} is set: importing anyway)", RuntimeWarning,
                      stacklevel=3)
        return
    raise TorchMismatchError(message)
