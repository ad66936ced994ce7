"""Imports inside src/mixprec point down: no two modules import each other, directly or
through others (docs/design.md, "Layers").

The graph is read from the source (ast), not by importing: an edge ``a -> b`` for every
``import``/``from ... import`` in ``a`` that names module ``b`` of src/mixprec (``from pkg
import sub`` names ``pkg.sub`` when ``sub`` is a submodule, else ``pkg``; the package whose
``__init__`` runs first is named too, except a package the importer lives in, which is being
imported already). Imports under ``if TYPE_CHECKING:`` never run and are not edges.

Two graphs are checked:

* module-level imports: these run while a module is being imported, so a circle among them
  breaks (or silently half-initialises) an import; no circle is allowed, no exception;
* every import, also those inside functions: a function-level import is the usual way to
  hide a circle from the import machinery, but the dependency is still there (a lower module
  that reaches up into the facade). No circle is allowed except through the edges in
  ``KNOWN_BACK_EDGES``, each named with its reason; an edge listed there that no longer
  exists fails too, so the list only shrinks.

A third test imports ``mixprec.config`` in a process where ``mixprec._C`` cannot be imported:
the configuration layer (reading, checking and explaining a config file) works without the
compiled extension.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "mixprec"

# (importer, imported) -> why the back edge is still there. Each one closes a circle in the
# every-import graph; remove the entry with the import.
KNOWN_BACK_EDGES: dict[tuple[str, str], str] = {
    ("mixprec.diagnostics", "mixprec.diagnostics.doctor"):
        "diagnostics/__init__.py imports doctor (a tool that builds an Engine over the whole stack) "
        "while wrappers/model.py and engines/units.py import the package's low modules "
        "(dtype_errors, locate), which runs that __init__; fix: doctor out of the package, or the "
        "low modules out of it",
    ("mixprec.parallel.tensor.engine", "mixprec.parallel.tensor"):
        "parallel/tensor/engine.py imports layout_of from its package's __init__ inside a function; "
        "fix: layout_of in a module of its own that both import",
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module_level: bool) -> list[ast.stmt]:
    """The import statements that run: at module level (also inside if/try/with/class
    bodies), and with ``module_level=False`` inside functions too."""
    found: list[ast.stmt] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not module_level:
                    walk(node.body)
            else:
                for name in ("body", "orelse", "finalbody"):
                    child = getattr(node, name, None)
                    if isinstance(child, list):
                        walk(child)
                for handler in getattr(node, "handlers", None) or []:
                    walk(handler.body)

    walk(tree.body)
    return found


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a package's ``__init__`` binds at module level (so ``from pkg import x`` of one
    of them reads the package, not a submodule)."""
    names = set()
    for node in _imports(tree, module_level=True):
        names.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def import_graph(module_level: bool) -> dict[str, set[str]]:
    modules = _modules()
    trees = {name: ast.parse(path.read_text()) for name, (path, _) in modules.items()}
    bound = {name: _bound_names(trees[name]) for name, (_, is_pkg) in modules.items() if is_pkg}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (_, is_pkg) in modules.items():
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for node in _imports(trees[name], module_level):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = []
                reads_package = False
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules or (source in bound and alias.name not in bound[source]):
                        targets.append(sub)  # a submodule (or a built one: _C, _build_torch)
                    else:
                        reads_package = True
                if reads_package or not (name == source or name.startswith(source + ".")):
                    targets.append(source)
            for target in targets:
                # importing a.b.c runs a/__init__ and a/b/__init__ first, unless the
                # importer is inside them (they are being imported already)
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    step = ".".join(parts[:i])
                    inside = name == step or name.startswith(step + ".")
                    if step in modules and step != name and (step == target or not inside):
                        graph[name].add(step)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    lines = []
    for component in found:
        members = set(component)
        lines.append(f"circle of {len(component)} modules:")
        lines += [f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in component]
    return "\n".join(lines)


def test_the_graph_sees_module_and_function_level_imports():
    """The reader itself: a module-level edge, a function-level one, a TYPE_CHECKING one."""
    module_level, every = import_graph(module_level=True), import_graph(module_level=False)
    assert "mixprec.config.resolve" in module_level["mixprec.config"]
    assert "mixprec.engines.base" in module_level["mixprec.engines"]
    # join.py names Accelerator for type hints only
    assert not any(t.startswith("mixprec.accelerator") for t in every["mixprec.join"])
    assert module_level["mixprec.selftest"] < every["mixprec.selftest"]  # `from . import Accelerator` in a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_module_level_imports_have_no_circle():
    graph = import_graph(module_level=True)
    found = circles(graph)
    assert not found, "module-level import circle(s) in src/mixprec:\n" + _describe(graph, found)


def test_no_import_circle_counting_function_level_imports():
    graph = import_graph(module_level=False)
    stale = [edge for edge in KNOWN_BACK_EDGES if edge[1] not in graph.get(edge[0], ())]
    assert not stale, f"KNOWN_BACK_EDGES lists imports that are gone, remove them: {stale}"
    for importer, imported in KNOWN_BACK_EDGES:
        graph[importer].discard(imported)
    found = circles(graph)
    assert not found, (
        "import circle(s) in src/mixprec (function-level imports included); make the lower module "
        "stop importing the higher one (move the shared name down):\n" + _describe(graph, found))


NO_CORE = textwrap.dedent("""
    import importlib.abc, sys

    class NoCore(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "mixprec._C":
                raise ImportError("mixprec._C is made unimportable by the test")

    sys.meta_path.insert(0, NoCore())
    import mixprec.config
    resolved = mixprec.config.resolve({"backend": "zero3", "mixed_precision": "bf16"}, env={})
    print("backend", resolved.backend, resolved.config.mixed_precision)
    print("loaded _C", "mixprec._C" in sys.modules)
    try:
        mixprec.Accelerator
    except ImportError as e:
        print("Accelerator:", e)
""")


def test_the_config_layer_imports_without_the_compiled_extension():
    out = subprocess.run([sys.executable, "-c", NO_CORE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "backend zero3 bf16" in lines and "loaded _C False" in lines, out.stdout
    message = next(line for line in lines if line.startswith("Accelerator:"))
    # the names that need the compiled core say so, and how to get it
    assert "mixprec._C" in message and "made unimportable by the test" in message and "make install" in message


def test_the_config_names_every_engine():
    """The backend names live in config/schema.py (below the engines); ENGINES has one Comm
    class for each, in the same order."""
    from mixprec.config.schema import BACKEND_NAMES
    from mixprec.engines import ENGINES

    assert BACKEND_NAMES == ("auto", *ENGINES)
    assert all(comm.name == name for name, comm in ENGINES.items())
