"""Open a checkpoint, prove it complete and intact, and read any range of any tensor.

Example::

    reader = CheckpointReader("project/checkpoints/checkpoint_3")   # raises if incomplete/corrupt
    reader.index["model/0.weight"]             # ((64, 16), torch.float32)
    w = reader("model/0.weight", 0, 1024)      # flat elements [0, 1024), from any rank's file
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from . import format as fmt
from .format import CheckpointError


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
        self.metadata = json.loads(raw)
        version = self.metadata.get("format_version")
        if version != fmt.FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} has format_version={version!r}; this mixprec reads "
                f"version {fmt.FORMAT_VERSION}. Use the mixprec version that wrote it"
            )
        if verify_files:
            for name, info in self.metadata["files"].items():
                self._verify(name, info)
        self.index = {
            name: (tuple(e["shape"]), fmt.dtype_from_str(e["dtype"])) for name, e in self.metadata["tensors"].items()
        }
        self._handles: dict = {}

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
        return torch.load(self.path / fmt.OBJECTS, weights_only=True)

    def rank_state(self, rank: int) -> Optional[dict]:
        """Rank ``rank``'s RNG states and dataloader positions (None if it did not exist)."""
        path = self.path / fmt.rank_file(rank)
        return torch.load(path, weights_only=True) if rank < self.world_size and path.is_file() else None
