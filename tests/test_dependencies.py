"""Issue #36 point 8: every runtime dependency is declared (build_support/torch_pin.py,
REQUIRES, what a built wheel's metadata lists). A bare venv holding only the wheel and its
declared dependencies runs everything; .ci/wheel_check.sh checks that end to end.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import torch.distributed.distributed_c10d as c10d

ROOT = Path(__file__).resolve().parents[1]
# Import names of the declared distributions.
IMPORT_NAME = {"pyyaml": "yaml"}


def _declared() -> set[str]:
    spec = importlib.util.spec_from_file_location("torch_pin", ROOT / "build_support" / "torch_pin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = {re.split(r"[<>=!~\[; ]", r.strip(), maxsplit=1)[0].lower() for r in module.REQUIRES}
    return {IMPORT_NAME.get(n, n) for n in names}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level packages imported when the module is imported (not inside a function, and
    not in a ``try`` that handles ImportError)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_package_mixprec_imports_at_import_time_is_declared():
    declared = _declared()
    missing = {}
    for path in (ROOT / "src" / "mixprec").rglob("*.py"):
        for name in _module_level_imports(path) - set(sys.stdlib_module_names) - {"mixprec"}:
            if name not in declared:
                missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported at import time but not declared in build_support/torch_pin.py: {missing}"


def test_numpy_is_declared_because_torch_object_collectives_need_it():
    """mixprec's structure check, checkpoints and dataloader order use torch's object
    collectives (all_gather_object, broadcast_object_list), which turn the received bytes
    back into objects through ``Tensor.numpy()``: without numpy every multi-process run fails
    with "Numpy is not available" (torch itself does not depend on numpy)."""
    assert ".numpy()" in inspect.getsource(c10d._tensor_to_object)
    assert "numpy" in _declared()
