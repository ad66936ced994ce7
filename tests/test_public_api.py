"""The public API does not change silently: every public member of ``mixprec.Accelerator``
(its kind, signature and docstring), the public attributes an Accelerator instance carries,
and ``mixprec``'s top-level names (kind, signature, docstring) are compared with the record
in tests/public_api.json.

A deliberate API change updates the record: ``python tests/test_public_api.py --record``,
and the diff of tests/public_api.json shows what changed in review."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("public_api.json")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


def _member(cls: type, name: str) -> dict:
    """Kind, signature and docstring of ``cls.name`` as declared (looked up along the MRO)."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property):
        return {"kind": "property", "settable": raw.fset is not None,
                "signature": _signature(raw.fget), "doc": inspect.getdoc(raw)}
    if isinstance(raw, staticmethod):
        return {"kind": "staticmethod", "signature": _signature(raw.__func__), "doc": inspect.getdoc(raw.__func__)}
    if isinstance(raw, classmethod):
        return {"kind": "classmethod", "signature": _signature(raw.__func__), "doc": inspect.getdoc(raw.__func__)}
    if inspect.isfunction(raw):
        return {"kind": "method", "signature": _signature(raw), "doc": inspect.getdoc(raw)}
    return {"kind": "attribute", "type": type(raw).__name__}


def accelerator_api() -> dict:
    from mixprec import Accelerator

    members = {name: _member(Accelerator, name) for name in dir(Accelerator) if not name.startswith("_")}
    acc = Accelerator(cpu=True)
    try:
        instance = {name: type(value).__name__ for name, value in vars(acc).items() if not name.startswith("_")}
    finally:
        acc.end_training()
    return {
        "module": Accelerator.__module__,
        "doc": inspect.getdoc(Accelerator),
        "init": _signature(Accelerator.__init__),
        "members": members,
        "instance_attributes": dict(sorted(instance.items())),
    }


def top_level_api() -> dict:
    import mixprec

    out = {}
    for name in sorted(mixprec.__all__):
        obj = getattr(mixprec, name)
        if inspect.isclass(obj):
            entry = {"kind": "class", "signature": _signature(obj), "doc": inspect.getdoc(obj)}
        elif callable(obj):
            entry = {"kind": "function", "signature": _signature(obj), "doc": inspect.getdoc(obj)}
        else:
            entry = {"kind": type(obj).__name__, "value": repr(obj)}
        out[name] = entry
    return out


def current() -> dict:
    return {"Accelerator": accelerator_api(), "mixprec": top_level_api()}


def _diff(recorded: dict, now: dict, where: str) -> list[str]:
    lines = []
    for key in sorted(set(recorded) | set(now)):
        if key not in now:
            lines.append(f"{where}.{key}: removed")
        elif key not in recorded:
            lines.append(f"{where}.{key}: added")
        elif isinstance(recorded[key], dict) and isinstance(now[key], dict):
            lines += _diff(recorded[key], now[key], f"{where}.{key}")
        elif recorded[key] != now[key]:
            lines.append(f"{where}.{key}: {recorded[key]!r} -> {now[key]!r}")
    return lines


@pytest.mark.parametrize("part", ["Accelerator", "mixprec"])
def test_the_public_api_matches_the_record(part):
    recorded = json.loads(RECORD.read_text())[part]
    now = current()[part]
    changes = _diff(recorded, now, part)
    assert not changes, (
        "the public API changed:\n  " + "\n  ".join(changes)
        + "\nIf deliberate: python tests/test_public_api.py --record, and review the diff"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_public_api.py --record")
    RECORD.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")
