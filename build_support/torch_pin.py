"""Build-time metadata provider (scikit-build-core): mixprec's runtime dependencies, with torch
pinned to the exact release the wheel's extension is compiled against.

A libtorch extension only works with the torch it was built with (src/mixprec/_torch_guard.py
checks it at import). So a wheel built with ``pip wheel --no-build-isolation .`` declares
``torch==<that release>``, as torchvision's wheels do. An sdist keeps the declared range
(``pin-torch = "no"`` in pyproject.toml's override for the sdist state): whoever builds from it
compiles against their own torch, within that range. So does a wheel built where no torch
is importable (it then has no extension to pin to; CMakeLists.txt refuses that build).

Wired in pyproject.toml under ``[tool.scikit-build.metadata.dependencies]``. REQUIRES below
is mixprec's dependency list, with torch's supported range.
"""

from __future__ import annotations

import re

# torch: 2.13 is built and tested in CI; 2.11 and 2.12 are compile-checked against their
# headers (.ci/torch_headers_check.sh). Only what is built and tested is claimed (docs/building.md).
# numpy: torch does not depend on it, but its object collectives (all_gather_object,
# broadcast_object_list: mixprec's structure check, checkpoints, dataloader order) read the
# received bytes through Tensor.numpy(); without it every multi-process run fails
# (tests/test_dependencies.py, .ci/wheel_check.sh).
# xxhash: checkpoint checksums at 20+ GB/s a core (xxh3_128; zlib's crc32, the fallback, runs at
# about 7 GB/s, which adds ~15% to a cold load of a 600 MB checkpoint: docs/checkpointing.md).
REQUIRES = ["torch>=2.11,<2.14", "safetensors>=0.4", "pyyaml>=6", "numpy>=1.22", "xxhash>=3.0"]


def _pinned(requires, torch_version):
    release = torch_version.split("+", 1)[0]
    out = []
    for req in requires:
        if re.match(r"^torch(?![\w.-])", req.strip()):
            out.append(f"torch=={release}")
        else:
            out.append(req)
    return out


def dynamic_metadata(field, settings):
    if field != "dependencies":
        raise ValueError(f"build_support/torch_pin.py provides 'dependencies', not {field!r}")
    requires = list(REQUIRES)
    if settings.get("pin-torch", "yes") == "no":  # the sdist (pyproject.toml's override)
        return requires
    try:
        import torch
    except ImportError:
        return requires
    return _pinned(requires, torch.__version__)
