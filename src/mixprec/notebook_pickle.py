"""Pickle functions and classes of a notebook by value, for spawned processes.

See ``[Note: functions defined in a notebook]`` in :mod:`mixprec.notebook` for why. Anything
whose ``__module__`` is a ``__main__`` that a spawned child cannot re-import (a Jupyter
kernel, the REPL, ``python -c``, or code ``exec``'d into a namespace of its own) is stored
by value; everything else as plain pickle stores it.

Example::

    payload = dumps((train, (3e-4,)))     # in the notebook
    fn, args = pickle.loads(payload)      # in the spawned process: rebuilt in its __main__
"""

from __future__ import annotations

import importlib
import io
import linecache
import marshal
import os
import pickle
import sys
import types
from typing import Any, Callable

__all__ = ["by_value", "code_global_names", "dumps"]


def _main_is_reimported() -> bool:
    """Whether a spawned child re-imports the parent's ``__main__`` (then by-reference works).

    Mirrors what ``multiprocessing.spawn`` does: a main module run by name (``python -m
    pkg.mod``) or from a file is re-imported; an interactive one (Jupyter, the REPL,
    ``python -c``) or a package's ``__main__`` is not.
    """
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:
        return not spec_name.endswith("__main__")
    path = getattr(main, "__file__", None)
    return bool(path) and not hasattr(sys, "ps1") and os.path.basename(path) != "ipykernel_launcher.py"


def by_value(obj: Any) -> bool:
    """Functions/classes of ``__main__`` that a spawned child could not find by name."""
    if getattr(obj, "__module__", None) != "__main__":
        return False
    if not _main_is_reimported():
        return True
    found: Any = sys.modules["__main__"]
    for part in getattr(obj, "__qualname__", "<?>").split("."):
        found = getattr(found, part, None)
    return found is not obj  # e.g. exec'd into a namespace of its own


def code_global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_global_names(const)
    return names


_EMPTY_CELL = "<mixprec: empty cell>"


def _child_main_globals() -> dict:
    return sys.modules["__main__"].__dict__


def _make_function(code_bytes: bytes, name: str, n_cells: int) -> types.FunctionType:
    """Child side: a function skeleton in ``__main__``; :func:`_set_function_state` fills it."""
    code = marshal.loads(code_bytes)
    closure = tuple(types.CellType() for _ in range(n_cells)) or None
    return types.FunctionType(code, _child_main_globals(), name, None, closure)


def _set_function_state(fn: types.FunctionType, state: tuple) -> types.FunctionType:
    referenced, defaults, kwdefaults, cells, qualname, attrs, doc, source = state
    if source is not None:  # so tracebacks in this process show the cell's lines
        name = fn.__code__.co_filename
        linecache.cache.setdefault(name, (sum(map(len, source)), None, source, name))
    for key, value in referenced.items():
        fn.__globals__.setdefault(key, value)
    fn.__defaults__ = defaults
    fn.__kwdefaults__ = kwdefaults
    fn.__qualname__ = qualname
    fn.__doc__ = doc
    fn.__dict__.update(attrs)
    fn.__module__ = "__main__"
    for cell, value in zip(fn.__closure__ or (), cells):
        if value != _EMPTY_CELL:
            cell.cell_contents = value
    return fn


def _make_class(metaclass: type, name: str, bases: tuple) -> type:
    """Child side: a class skeleton; :func:`_set_class_state` adds its attributes."""
    main = sys.modules["__main__"]
    existing = getattr(main, name, None)
    cls = metaclass(name, bases, {"__module__": "__main__"})
    if existing is None:
        setattr(main, name, cls)  # so instances pickled by reference later resolve too
    return cls


def _set_class_state(cls: type, state: dict) -> type:
    for key, value in state.items():
        setattr(cls, key, value)
    return cls


# Class attributes that type() creates itself, or that cannot be set after creation.
_CLASS_SKIP = {"__dict__", "__weakref__", "__module__"}


class _NotebookPickler(pickle.Pickler):
    """Pickler that stores functions and classes of a non-importable ``__main__`` by value."""

    def reducer_override(self, obj: Any):
        if isinstance(obj, types.FunctionType) and by_value(obj):
            return self._reduce_function(obj)
        if isinstance(obj, type) and by_value(obj):
            return self._reduce_class(obj)
        if isinstance(obj, types.ModuleType):
            return _import_module, (obj.__name__,)
        return NotImplemented

    @staticmethod
    def _reduce_function(fn: types.FunctionType):
        names = code_global_names(fn.__code__)
        referenced = {
            n: fn.__globals__[n] for n in sorted(names)
            if n in fn.__globals__ and not n.startswith("__")
        }
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not assigned yet
                cells.append(_EMPTY_CELL)
        source = linecache.getlines(fn.__code__.co_filename) or None
        state = (referenced, fn.__defaults__, fn.__kwdefaults__, tuple(cells), fn.__qualname__,
                 dict(fn.__dict__), fn.__doc__, source)
        n_cells = len(fn.__closure__ or ())
        # Skeleton first, state after: the function is memoised before its globals are
        # pickled, so recursion (a function naming itself, a method's __class__ cell) works.
        skeleton = (marshal.dumps(fn.__code__), fn.__name__, n_cells)
        return _make_function, skeleton, state, None, None, _set_function_state

    @staticmethod
    def _reduce_class(cls: type):
        state = {}
        for key, value in vars(cls).items():
            if key in _CLASS_SKIP:
                continue
            if isinstance(value, staticmethod):
                value = _Wrapped(staticmethod, value.__func__)
            elif isinstance(value, classmethod):
                value = _Wrapped(classmethod, value.__func__)
            elif isinstance(value, property):
                value = _Property(value.fget, value.fset, value.fdel, value.__doc__)
            state[key] = value
        return _make_class, (type(cls), cls.__name__, cls.__bases__), state, None, None, _set_class_state


class _Wrapped:
    """A staticmethod/classmethod in transit (those objects do not pickle themselves)."""

    def __init__(self, kind: type, func: Callable) -> None:
        self.kind, self.func = kind, func

    def __reduce__(self):
        return self.kind, (self.func,)


class _Property:
    def __init__(self, *parts: Any) -> None:
        self.parts = parts

    def __reduce__(self):
        return property, self.parts


def _import_module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)``, with notebook functions and classes stored by value."""
    buf = io.BytesIO()
    _NotebookPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
