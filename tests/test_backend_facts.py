"""What a backend does is asked of its engine class (src/mixprec/engines), not decided by
comparing its name elsewhere: a new backend then states its facts in one place.

The first test reads every module outside src/mixprec/engines (ast) for a comparison with a
backend name (``backend == "zero3"``, ``name in ("zero3", "fsdp")``...); the others check
the facts the facade, the Accelerate state and ``mixprec config explain`` now ask for."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator, DistributedType
from mixprec.config.schema import BACKEND_NAMES
from mixprec.engines import ENGINES
from _helpers import END_AFTER_TEST

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mixprec"
ENGINE_NAMES = set(BACKEND_NAMES) - {"auto"}

# Modules that may compare backend names, and why.
ALLOWED = {
    "config/importers.py": "translates DeepSpeed / Accelerate config files into mixprec's config blocks, "
                           "which are named after the backends (the target vocabulary, not an engine's behaviour)",
}


def _names_a_backend(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in ENGINE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(e) for e in node.elts)
    return False


def backend_name_comparisons() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("engines/") or rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                if _names_a_backend(node.left) or any(_names_a_backend(c) for c in node.comparators):
                    found.append(f"src/mixprec/{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_reader_finds_a_backend_name_comparison(tmp_path):
    tree = ast.parse("x = backend in ('zero3', 'fsdp') or name == 'ddp' or kind == 'gloo'")
    hits = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and (_names_a_backend(n.left) or any(_names_a_backend(c) for c in n.comparators))]
    assert len(hits) == 2


def test_no_backend_name_is_compared_outside_the_engines():
    found = backend_name_comparisons()
    assert not found, ("backend names compared outside src/mixprec/engines; ask the engine's Comm class "
                       "(a class attribute or classmethod declared on it, see tests/test_explain_facts.py) instead:\n  " + "\n  ".join(found))


def test_the_engine_classes_state_their_facts():
    assert {name for name, comm in ENGINES.items() if comm.shards_parameters} == {"zero3", "fsdp"}
    assert {name for name, comm in ENGINES.items() if not comm.distributed} == {"single"}
    assert {name for name, comm in ENGINES.items() if comm.owns_masters} == {"zero1", "zero2", "zero3", "fsdp"}


_MADE = END_AFTER_TEST  # ended after each test by tests/conftest.py


@pytest.mark.parametrize("backend, expected", [
    ("single", DistributedType.NO), ("ddp", DistributedType.MULTI_CPU), ("zero1", DistributedType.MULTI_CPU),
    ("zero2", DistributedType.MULTI_CPU), ("zero3", DistributedType.FSDP), ("fsdp", DistributedType.FSDP),
])
def test_accelerate_distributed_type_of_each_backend_on_one_process(backend, expected):
    acc = Accelerator(backend=backend, mixed_precision="bf16" if backend != "single" else "no",
                      device=torch.device("cpu"), log_policy=False)
    _MADE.append(acc)
    assert acc.backend == backend and acc.state.backend_name == backend
    assert acc.distributed_type == expected and acc.state.distributed_type == expected
