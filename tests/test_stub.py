"""The _C.pyi stub names exactly what the compiled module exports."""

import ast
from pathlib import Path

from mixprec import _C


def test_stub_matches_compiled_module():
    stub = Path(__file__).resolve().parents[1] / "src" / "mixprec" / "_C.pyi"
    tree = ast.parse(stub.read_text())
    declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    exported = {n for n in dir(_C) if not n.startswith("_")}
    public = {n for n in declared if not n.startswith("_")}
    assert public == exported, (sorted(public - exported), sorted(exported - public))
    # Private entry points the stub declares (test hooks such as _advance_step_counters_) exist.
    assert {n for n in declared - public if not hasattr(_C, n)} == set()
