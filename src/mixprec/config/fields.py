"""Reading the schema: flat key paths, field documentation, and checking/normalising a value
against a field's type (from YAML/JSON/Python values, or from text: env vars, CLI flags).

[Note: lists of records]
A leaf typed ``tuple[SomeDataclass, ...]`` (e.g. ``tensor_parallel.partition_config.layer_specs``)
holds a list of *records*: each entry is a mapping (YAML/JSON/dict) or an instance of the
dataclass, checked field by field like a block (unknown keys with a suggestion, required
fields, types, ``checked`` rules) and built into the dataclass; errors name the entry as
``path[index].key``. The list itself is one leaf (one source, one env var: YAML/JSON text).
A record's fields are leaves; a field without a default is required.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

import torch


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or given twice with different values."""


_MISSING = dataclasses.MISSING
REQUIRED = dataclasses.MISSING  # the "default" of a record field that must be given
_DTYPE_ALIASES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NULL_TEXT = ("null", "none", "~", "")
_TRUE_TEXT = ("true", "1", "yes", "on")
_FALSE_TEXT = ("false", "0", "no", "off")


@dataclass(frozen=True)
class FieldInfo:
    """One leaf of the schema: ``path`` (``"zero3.prefetch"``), its type, default and doc."""

    path: str
    type: Any
    default: Any
    doc: str
    rule: str = ""  # what a valid value is, when more than its type says, e.g. "an int >= 1"
    check: Any = None  # predicate implementing ``rule``
    label: str = "use one of "  # how an error introduces the valid choices
    why: Any = None  # value -> what exactly breaks ``rule`` (appended to the error), optional


def is_block(tp: Any) -> bool:
    """True for a nested block (a dataclass type) rather than a leaf value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of dataclass ``cls`` (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


@functools.lru_cache(maxsize=None)
def block_fields(cls: type) -> dict[str, tuple[Any, Any, dataclasses.Field]]:
    """``{name: (type, default, Field)}`` of dataclass ``cls`` in declaration order; the default
    of a field that has none (a required record field) is :data:`REQUIRED`."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = REQUIRED
        out[f.name] = (hints[f.name], default, f)
    return out


@functools.lru_cache(maxsize=None)
def leaves(cls: type, prefix: str = "") -> dict[str, FieldInfo]:
    """Every leaf of the schema rooted at ``cls``, by dotted path, in declaration order."""
    out: dict[str, FieldInfo] = {}
    docs = field_docs(cls)
    for name, (tp, default, f) in block_fields(cls).items():
        path = f"{prefix}{name}"
        if is_block(tp):
            out.update(leaves(tp, path + "."))
        else:
            out[path] = FieldInfo(path, tp, default, docs.get(name, ""), f.metadata.get("rule", ""),
                                  f.metadata.get("check"), f.metadata.get("label", "use one of "),
                                  f.metadata.get("why"))
    return out


def record_type(tp: Any) -> Optional[type]:
    """The dataclass of a list-of-records leaf (``tuple[Spec, ...]``), else None
    (see [Note: lists of records])."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if args and is_block(args[0]):
            return args[0]
    return None


def suggest(name: str, valid: typing.Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the closest valid name, or ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def describe_type(tp: Any) -> str:
    """A human description of a field type, e.g. ``"one of 'torch', 'deepspeed'"``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is Union:
        parts = [describe_type(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return f"null or {text}" if type(None) in args else text
    if origin is tuple:
        if is_block(args[0]):
            return f"a list of mappings with keys {', '.join(block_fields(args[0]))}"
        return "a list of strings" if args[0] is str else f"a list of {describe_type(args[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def coerce(info: FieldInfo, value: Any, source: str, *, text: bool = False) -> Any:
    """``value`` checked against ``info``'s type and rule, normalised (dtypes to their short
    names, lists to tuples, ints to floats where a float is expected). ``text``: the value
    is a string from an environment variable or a command-line flag, parsed by type.
    Raises :class:`ConfigError` naming the key, the value, its source and what is valid."""
    record = record_type(info.type)
    if record is not None:
        out = _coerce_records(info, record, value, source, text)
        _check(info, value, out, source)
        return out
    try:
        out = _coerce(info.type, value, text)
    except _Mismatch:
        choices = _choices(info.type)
        if choices is not None:
            raise ConfigError(
                f"{info.path}={value!r} is not supported; {info.label}{choices} (from {source})."
                f"{suggest(value, [c.strip(chr(39)) for c in choices.split(', ')]) if isinstance(value, str) else ''}"
            ) from None
        raise ConfigError(
            f"{info.path}={value!r} must be {info.rule or describe_type(info.type)} (from {source})"
        ) from None
    _check(info, value, out, source)
    return out


def _check(info: FieldInfo, value: Any, out: Any, source: str) -> None:
    """``info``'s rule on the normalised ``out``: a ConfigError saying what is valid (and,
    where the field says, exactly what breaks it)."""
    if info.check is not None and not info.check(out):
        detail = f": {info.why(out)}" if info.why is not None else ""
        raise ConfigError(f"{info.path}={value!r} must be {info.rule}{detail} (from {source})")


def _coerce_records(info: FieldInfo, record: type, value: Any, source: str, text: bool) -> tuple:
    """A list of mappings (or ``record`` instances) -> a tuple of ``record`` (see
    [Note: lists of records]). Text (an env var, a flag) is read as YAML/JSON."""
    if text and isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{info.path}={value!r} must be a YAML/JSON list of mappings, e.g. "
                f"'[{{{', '.join(f'{k}: ...' for k in _required(record))}}}]' (from {source}): "
                f"{' '.join(str(e).split())}"
            ) from None
        value = [] if value is None else value
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{info.path}={value!r} must be {describe_type(info.type)} (from {source})")
    return tuple(coerce_record(record, item, f"{info.path}[{i}]", source) for i, item in enumerate(value))


def _required(record: type) -> list[str]:
    return [name for name, (_tp, default, _f) in block_fields(record).items() if default is REQUIRED]


def coerce_record(record: type, item: Any, path: str, source: str) -> Any:
    """One entry of a list of records, built into ``record``: ``item`` is a mapping or a
    ``record`` instance (re-checked). ``path`` names the entry in errors, e.g.
    ``"tensor_parallel.partition_config.layer_specs[1]"``."""
    fields = block_fields(record)
    if isinstance(item, record):
        given = {name: getattr(item, name) for name in fields}
    elif isinstance(item, Mapping):
        given = dict(item)
    else:
        raise ConfigError(
            f"{path}={item!r} must be a mapping with keys {', '.join(fields)} (from {source}); "
            f"required: {', '.join(_required(record))}"
        )
    for key in given:
        if key not in fields:
            raise ConfigError(
                f"unknown key {key!r} in {path} (from {source}).{suggest(str(key), fields)} "
                f"Valid keys of an entry: {', '.join(fields)}"
            )
    infos = leaves(record, path + ".")
    kwargs = {}
    for name, (tp, default, _f) in fields.items():
        if is_block(tp):  # invariant: records hold leaves only
            raise TypeError(f"record field {record.__name__}.{name} is a block; records hold leaves only")
        info = infos[f"{path}.{name}"]
        if name in given:
            kwargs[name] = coerce(info, given[name], source)
        elif default is REQUIRED:
            raise ConfigError(
                f"{path} has no {name!r} (from {source}): add {name}: "
                f"<{info.rule or describe_type(info.type)}> (required keys of an entry: "
                f"{', '.join(_required(record))})"
            )
    return record(**kwargs)


def _choices(tp: Any):
    """``"'a', 'b'"`` when ``tp`` is a choice of strings (optionally null), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Union and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return None


class _Mismatch(Exception):
    pass


def _coerce(tp: Any, value: Any, text: bool) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return _coerce_union(args, value, text)
    if origin is Literal:
        return _coerce_literal(args, value)
    if origin is tuple:
        if text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        # Classes are accepted where class names are expected (e.g. units=[MyBlock]).
        return tuple(_coerce(args[0], v.__name__ if isinstance(v, type) else v, text) for v in value)
    if tp in (bool, int, float, str):
        return _coerce_scalar(tp, value, text)
    raise TypeError(f"schema type {tp!r} is not handled by mixprec.config.fields")  # invariant


def _coerce_union(args: tuple, value: Any, text: bool) -> Any:
    if type(None) in args and (value is None or (text and str(value).strip().lower() in _NULL_TEXT)):
        return None
    members = [a for a in args if a is not type(None)]
    if text and str in members and isinstance(value, str) and not value.startswith("size:"):
        members.sort(key=lambda a: a is str)  # text "A,B" is a list; only "size:<n>" is a string
    for arg in members:
        try:
            return _coerce(arg, value, text)
        except _Mismatch:
            continue
    raise _Mismatch


def _coerce_literal(args: tuple, value: Any) -> Any:
    if args and set(args) <= set(_DTYPE_ALIASES.values()):  # a dtype: accept torch dtypes and aliases
        key = value.replace("torch.", "") if isinstance(value, str) else value
        if isinstance(key, (str, torch.dtype)) and key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
        raise _Mismatch
    if isinstance(value, str) and value in args:
        return value
    if value is False and "no" in args:  # YAML 1.1 reads an unquoted `no` as false
        return "no"
    raise _Mismatch


def _coerce_scalar(tp: type, value: Any, text: bool) -> Any:
    """bool, int, float or str; ``text``: also from its text (an env var, a flag)."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.strip().lower() in _TRUE_TEXT + _FALSE_TEXT:
            return value.strip().lower() in _TRUE_TEXT
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (tp is float or isinstance(value, int)):
        return float(value) if tp is float else value
    if text and isinstance(value, str):
        try:
            return int(value.strip()) if tp is int else float(value.strip().replace(".inf", "inf"))
        except ValueError:
            raise _Mismatch from None
    raise _Mismatch


def to_plain(value: Any) -> Any:
    """A normalised value as YAML/JSON writes it (tuples as lists, inf as a float, a record
    as a mapping of its required fields and those not at their default)."""
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    if is_block(type(value)):
        return {k: to_plain(v) for k, v in _record_items(value)}
    return value


def _record_items(record: Any) -> list[tuple[str, Any]]:
    return [(name, getattr(record, name)) for name, (_tp, default, _f) in block_fields(type(record)).items()
            if default is REQUIRED or getattr(record, name) != default]


def format_value(value: Any) -> str:
    """A value as it is written in a YAML file (``null``, ``true``, ``[a, b]``, ``.inf``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if value is REQUIRED:
        return "required"
    if isinstance(value, tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if is_block(type(value)):  # a record: a YAML flow mapping
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in _record_items(value)) + "}"
    return str(value)
