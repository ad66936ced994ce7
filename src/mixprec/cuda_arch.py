"""Does this build of mixprec hold CUDA kernels the running GPU can execute?

The fused Adam/AdamW/SGD steps launch mixprec's own kernels (csrc/kernels/cuda/optim.cu);
everything else on CUDA calls torch's ops. The kernels are compiled for the archs of
MIXPREC_CUDA_ARCHS ([Note: CUDA archs] in build_support/cuda_archs.cmake), and the extension
reports them: ``mixprec.build_info()["cuda_archs"]``, CMake CUDA_ARCHITECTURES entries
("75-real": machine code only, "120-virtual": PTX only, "120": both). Without a matching
image the first fused step dies with CUDA's "no kernel image is available for execution on
the device"; :func:`check_device` says so when the engine is built (``Accelerator(...)`` on a CUDA device) instead, naming the GPU, its
compute capability and the build option.

The rules, CUDA's own: machine code for X.y runs on X.z with z >= y (an arch-specific
"90a" only on 9.0; a family "100f" on 10.x, x >= 0); PTX for X.y is compiled by the driver
for any GPU of capability >= X.y ("a" PTX: only X.y; "f" PTX: the same major).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import torch

from .errors import MixprecError

__all__ = ["UnsupportedGPUError", "parse_archs", "kernel_image_for", "check_device", "compiled_archs"]

_ENTRY = re.compile(r"^(\d+)(\d)([af]?)(-real|-virtual)?$")


class UnsupportedGPUError(MixprecError):
    """The GPU is not covered by this build's CUDA kernels (or the build has none)."""


def parse_archs(entries: Sequence[str]) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """``(sass, ptx)``: the (major, minor, variant) of the machine code and of the PTX that
    CUDA_ARCHITECTURES ``entries`` stand for; variant is "", "a" or "f"."""
    sass, ptx = [], []
    for entry in entries:
        m = _ENTRY.match(str(entry))
        if m is None:
            raise ValueError(f"mixprec: {entry!r} is not a CUDA_ARCHITECTURES entry (expected e.g. "
                             f"'80', '90a-real' or '120-virtual'); the extension's cuda_archs come "
                             f"from CMakeLists.txt, rebuild it")
        cap = (int(m[1]), int(m[2]), m[3])
        if m[4] != "-virtual":
            sass.append(cap)
        if m[4] != "-real":
            ptx.append(cap)
    return sass, ptx


def kernel_image_for(entries: Sequence[str], capability: tuple[int, int]) -> Optional[str]:
    """How a GPU of ``capability`` runs kernels compiled for ``entries``: ``"sm_80"`` (that
    machine code), ``"compute_120 (PTX, compiled by the driver)"``, or None (it cannot)."""
    major, minor = int(capability[0]), int(capability[1])
    sass, ptx = parse_archs(entries)
    for M, m, v in sorted(sass, key=lambda c: (c[0], c[1]), reverse=True):
        ok = (M, m) == (major, minor) if v == "a" else (M == major and m <= minor)
        if ok:
            return f"sm_{M}{m}{v}"
    for M, m, v in sorted(ptx, key=lambda c: (c[0], c[1]), reverse=True):
        if v == "a":
            ok = (M, m) == (major, minor)
        elif v == "f":
            ok = M == major and m <= minor
        else:
            ok = (M, m) <= (major, minor)
        if ok:
            return f"compute_{M}{m}{v} (PTX, compiled by the driver)"
    return None


def compiled_archs() -> tuple[bool, list[str]]:
    """``(has CUDA kernels, their CUDA_ARCHITECTURES entries)`` of the loaded extension."""
    from . import _C

    info = _C.build_info()
    return bool(info["cuda"]), [str(a) for a in info["cuda_archs"]]


def _describe(entries: Sequence[str]) -> str:
    sass, ptx = parse_archs(entries)
    parts = [f"sm_{M}{m}{v}" for M, m, v in sass] + [f"PTX compute_{M}{m}{v}" for M, m, v in ptx]
    return ", ".join(parts)


_REBUILD = ("pip install --no-build-isolation --force-reinstall --no-deps mixprec "
            "(from a checkout: make install)")


def check_device(device: torch.device) -> str:
    """Refuse a CUDA ``device`` the fused kernels cannot run on, before any work is done on
    it: a build without CUDA kernels, or a GPU whose compute capability no compiled arch
    covers (module docstring). Returns how the kernels run there ("sm_90",
    "compute_120 (PTX, ...)"). Raises :class:`UnsupportedGPUError` naming the GPU, its
    capability and the fix. The engine calls it when its fused optimizer steps are on
    (``fused_optimizer``, src/mixprec/engines/base.py): nothing else launches mixprec's kernels."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"mixprec.cuda_arch.check_device: {device} is not a CUDA device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    has_cuda, entries = compiled_archs()
    if not has_cuda:
        raise UnsupportedGPUError(
            f"mixprec: cuda:{index} is a CUDA device, but this build of mixprec has no CUDA "
            f"kernels (mixprec.build_info()['cuda'] is False: it was built without nvcc or "
            f"with a CPU torch). Rebuild it where torch has CUDA and nvcc is installed: "
            f"MIXPREC_CUDA=ON {_REBUILD}; docs/building.md.")
    capability = tuple(torch.cuda.get_device_capability(index))
    how = kernel_image_for(entries, capability)
    if how is not None:
        return how
    name = torch.cuda.get_device_name(index)
    cc = f"{capability[0]}.{capability[1]}"
    wanted = ";".join([*entries, f"{capability[0]}{capability[1]}"])
    raise UnsupportedGPUError(
        f"mixprec: the GPU cuda:{index} ({name}, compute capability {cc}) cannot run this "
        f"build's CUDA kernels, compiled for {_describe(entries) or 'no arch'} "
        f"(mixprec.build_info()['cuda_archs'] = {entries}); its first fused optimizer step "
        f"would fail with 'no kernel image is available'. Rebuild for it with "
        f"MIXPREC_CUDA_ARCHS=\"{wanted}\" {_REBUILD} (MIXPREC_CUDA_ARCHS=AUTO builds every "
        f"generation your nvcc supports; docs/building.md), or pass fused_optimizer=False "
        f"to step with torch's optimizers instead.")
