"""Open a checkpoint, prove it complete, intact and well-formed, and read any range of any tensor.

[Note: well-formed] The sha256 checks prove the files are the ones the metadata names, not
that the metadata is right: an edited or hand-assembled checkpoint can pass them with a
shard table that has a hole, names a key its file does not hold, or a dtype its file does
not store. The constructor therefore also checks every field it will ever read (required
metadata fields, every tensor's shape, dtype and slice table, every slice's file and key in
that file's safetensors header) so that a later read cannot fail half-way through a load.
Every rank runs the same checks on every tensor, not only on the ranges it will read.

Example::

    reader = CheckpointReader("project/checkpoints/checkpoint_3")   # raises if incomplete/corrupt
    reader.index["model/0.weight"]             # ((64, 16), torch.float32)
    w = reader("model/0.weight", 0, 1024)      # flat elements [0, 1024), from any rank's file
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from . import format as fmt
from .format import CheckpointError
from .writer import check_coverage


# What Accelerate's save_state writes (accelerate/utils/constants.py): weights, optimizer,
# scheduler, sampler and RNG files, without mixprec's metadata.json and COMPLETE marker.
_ACCELERATE_FILES = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin|"
                               r"scheduler(_\d+)?\.bin|sampler(_\d+)?\.bin|random_states_\d+\.pkl|scaler\.pt|"
                               r"custom_checkpoint_\d+\.pkl|dl_state_dict(_\d+)?\.bin)$")


def refuse_accelerate_folder(path: Path) -> None:
    """Raise a :class:`CheckpointError` naming the format when ``path`` is a folder written by
    Accelerate's ``save_state`` (a complete folder, in another format: not an interrupted save).
    ``Accelerator.load_state`` reads such folders (checkpoint/accelerate_folder.py); this
    reader, and what is built on it (``mixprec consolidate``), read mixprec checkpoints."""
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if (path / fmt.METADATA).exists():
        return
    theirs = [n for n in names if _ACCELERATE_FILES.match(n)]
    if not any(n.startswith("random_states_") or n.startswith("optimizer") for n in theirs):
        return
    weights = next((n for n in theirs if n.startswith(("model", "pytorch_model"))), None)
    whole = f"; its model weights are already whole in {str(path / weights)!r}" if weights else ""
    raise CheckpointError(
        f"checkpoint {str(path)!r} is a folder written by Accelerate's save_state ({', '.join(theirs[:5])}), not "
        f"a mixprec checkpoint (metadata.json, tensors-rank*.safetensors, COMPLETE): CheckpointReader and "
        f"`mixprec consolidate` read mixprec checkpoints only, nothing was loaded. accelerator.load_state("
        f"{str(path)!r}) after prepare() loads it (docs/checkpointing.md, 'Loading an Accelerate checkpoint'){whole}"
    )


class CheckpointReader:
    """A verified checkpoint. ``index`` maps every tensor name to ``(shape, dtype)``;
    calling the reader returns a flat range of a tensor; ``metadata`` is the parsed
    ``metadata.json``. Integrity (the ``COMPLETE`` marker, the metadata checksum, every
    file's size and sha256) is checked in the constructor, before anything is read."""

    def __init__(self, path, verify_files: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {str(self.path)!r} does not exist; check the path")
        marker = self.path / fmt.COMPLETE
        if not marker.is_file():
            refuse_accelerate_folder(self.path)
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} is incomplete (no {fmt.COMPLETE} marker: its save was "
                "interrupted); nothing was loaded. Load an earlier checkpoint"
            )
        raw = (self.path / fmt.METADATA).read_bytes() if (self.path / fmt.METADATA).is_file() else b""
        expected = marker.read_text().strip()
        if hashlib.sha256(raw).hexdigest() != expected:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {fmt.METADATA} does not match the checksum in "
                f"{fmt.COMPLETE} (edited or corrupt); nothing was loaded. Restore it or load another checkpoint"
            )
        try:
            self.metadata = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {fmt.METADATA} is not valid JSON ({e})") from None
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {fmt.METADATA} is not a JSON object")
        version = self.metadata.get("format_version")
        if version != fmt.FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} has format_version={version!r}; this mixprec reads "
                f"version {fmt.FORMAT_VERSION}. Use the mixprec version that wrote it"
            )
        self._check_fields()
        if verify_files:
            for name, info in self.metadata["files"].items():
                self._verify(name, info)
        self.index = {
            name: (tuple(e["shape"]), fmt.dtype_from_str(e["dtype"])) for name, e in self.metadata["tensors"].items()
        }
        self._handles: dict = {}
        if verify_files:
            self._check_slices()

    def _bad(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(self.path)!r}: {fmt.METADATA} field '{field}': {problem}; nothing was "
            "loaded. The checkpoint was edited or assembled by hand: restore it or load another"
        )

    def _check_fields(self) -> None:
        """The metadata fields a load reads exist and have the right types ([Note: well-formed])."""
        m = self.metadata
        ws = m.get("world_size")
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            raise self._bad("world_size", f"must be an int >= 1, got {ws!r}")
        for key in ("tensors", "files"):
            if not isinstance(m.get(key), dict):
                raise self._bad(key, f"must be an object, got {type(m.get(key)).__name__}")
        for name, info in m["files"].items():
            if not (isinstance(info, dict) and isinstance(info.get("bytes"), int)
                    and isinstance(info.get("sha256"), str)) or "/" in name or name.startswith("."):
                raise self._bad(f"files.{name}", f"must be {{bytes: int, sha256: str}} naming a file "
                                f"of the checkpoint, got {info!r}")
        for name, e in m["tensors"].items():
            where = f"tensors.{name}"
            if not isinstance(e, dict):
                raise self._bad(where, f"must be an object, got {e!r}")
            shape = e.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                      and d >= 0 for d in shape):
                raise self._bad(where + ".shape", f"must be a list of ints >= 0, got {shape!r}")
            if not isinstance(e.get("dtype"), str):
                raise self._bad(where + ".dtype", f"must be a dtype name, got {e.get('dtype')!r}")
            try:
                fmt.dtype_from_str(e["dtype"])
            except CheckpointError as err:
                raise self._bad(where + ".dtype", str(err)) from None
            shards = e.get("shards")
            if not isinstance(shards, list):
                raise self._bad(where + ".shards", f"must be a list, got {shards!r}")
            for k, sh in enumerate(shards):
                ok = (isinstance(sh, dict) and isinstance(sh.get("file"), str) and isinstance(sh.get("key"), str)
                      and all(isinstance(sh.get(f), int) and not isinstance(sh.get(f), bool) and sh[f] >= 0
                              for f in ("offset", "numel")))
                if not ok:
                    raise self._bad(f"{where}.shards[{k}]", f"must be {{file, key, offset >= 0, numel >= 0}}, got {sh!r}")
                if sh["file"] not in m["files"]:
                    raise self._bad(f"{where}.shards[{k}].file",
                                    f"{sh['file']!r} is not one of the checkpoint's files {sorted(m['files'])}")
            try:
                check_coverage(name, e, refusing="refusing to read an incomplete tensor")
            except ValueError as err:
                raise self._bad(where + ".shards", str(err)) from None

    def _check_slices(self) -> None:
        """Every slice's key is in its safetensors file, 1-D with its numel and its tensor's dtype."""
        for name, e in self.metadata["tensors"].items():
            dtype = e["dtype"]
            for k, sh in enumerate(e["shards"]):
                where = f"tensors.{name}.shards[{k}]"
                try:
                    handle = self._handle(sh["file"])
                    if sh["key"] not in handle.keys():
                        raise self._bad(where + ".key", f"{sh['key']!r} is not in {sh['file']}")
                    sl = handle.get_slice(sh["key"])
                    shape, stored = list(sl.get_shape()), sl.get_dtype()
                except CheckpointError:
                    raise
                except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                    raise CheckpointError(
                        f"checkpoint {str(self.path)!r}: {sh['file']} is not a readable safetensors file "
                        f"({type(err).__name__}: {err}); nothing was loaded"
                    ) from None
                if shape != [sh["numel"]] or stored != dtype:
                    raise self._bad(where, f"{sh['file']}[{sh['key']!r}] stores shape {shape} dtype "
                                    f"{stored}, the table says [{sh['numel']}] {dtype}")

    def _verify(self, name: str, info: dict) -> None:
        path = self.path / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(self.path)!r} lacks its file {name!r}; nothing was loaded")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {name} has {size} bytes, its metadata says "
                f"{info['bytes']} (truncated or corrupt); nothing was loaded. Load another checkpoint"
            )
        if fmt.sha256_file(path) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {name} fails its sha256 check (corrupt); nothing "
                "was loaded. Load another checkpoint"
            )

    @property
    def world_size(self) -> int:
        return int(self.metadata["world_size"])

    def __call__(self, name: str, offset: int, numel: int) -> torch.Tensor:
        """Flat elements ``[offset, offset + numel)`` of the global tensor ``name``."""
        if name not in self.index:
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no tensor {name!r}")
        shape, dtype = self.index[name]
        total = fmt.numel_of(shape)
        if offset < 0 or numel < 0 or offset + numel > total:
            raise ValueError(f"{name!r}: range [{offset}, {offset + numel}) outside its {total} elements")
        out = torch.empty(numel, dtype=dtype)
        end = offset + numel
        filled = 0
        for s in self.metadata["tensors"][name]["shards"]:
            lo, hi = max(offset, s["offset"]), min(end, s["offset"] + s["numel"])
            if lo >= hi:
                continue
            part = self._handle(s["file"]).get_slice(s["key"])[lo - s["offset"]: hi - s["offset"]]
            out[lo - offset: hi - offset] = part
            filled += hi - lo
        if filled != numel:
            raise CheckpointError(f"{name!r}: the checkpoint's slices cover {filled} of the {numel} elements asked for")
        return out

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def names(self, prefix: str = "") -> list:
        return [n for n in self.index if n.startswith(prefix)]

    def objects(self) -> dict:
        """What rank 0 saved besides tensors (scaler, schedulers, counters, registered objects)."""
        return self._load_blob(fmt.OBJECTS)

    def rank_state(self, rank: int) -> Optional[dict]:
        """Rank ``rank``'s RNG states and dataloader positions (None if it did not exist)."""
        path = self.path / fmt.rank_file(rank)
        return self._load_blob(fmt.rank_file(rank)) if rank < self.world_size and path.is_file() else None

    def _load_blob(self, name: str) -> dict:
        """``torch.load`` of a non-tensor file; anything unreadable is a CheckpointError."""
        try:
            obj = torch.load(self.path / name, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError,
                AttributeError, KeyError, IndexError) as e:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {name} cannot be unpickled ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); nothing was loaded. Load another checkpoint"
            ) from None
        if not isinstance(obj, dict):
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {name} holds a {type(obj).__name__}, not the dict "
                "mixprec writes; nothing was loaded"
            )
        return obj
