"""Safetensors files read through a memory map: a tensor is a view of the file's pages.

[Note: reading a checkpoint through its pages]
A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range) and the raw little-endian data. :class:`MappedSafetensors`
maps each file once (``MAP_PRIVATE``: a write to a view copies that page, the file is never
changed) and returns tensors that are views of the mapping, built with
``torch.frombuffer``: nothing is read until an element is, and what is read is the page
cache's, not the process's anonymous memory. A rank that copies only its slices of a
tensor (a ZeRO-3/FSDP shard, a tensor-parallel split) reads only those pages
([Note: a sharded core reads only its slices] in csrc/engines/sharded/core.cpp).

A tensor whose data does not start at a multiple of its element size (possible when a file
mixes dtypes) is copied instead of viewed; so is one asked for in another dtype.

``checkpoint_files(path)`` accepts what ``from_pretrained`` and ``mixprec consolidate``
write: a ``.safetensors`` file, a ``*.safetensors.index.json`` (a sharded checkpoint: its
``weight_map`` names the files), or a directory holding ``model.safetensors`` or
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Optional, Union

import torch

from .format import dtype_from_str

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(path: Union[str, os.PathLike]) -> list[Path]:
    """The safetensors files of the checkpoint at ``path`` (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        if (p / INDEX).is_file():
            p = p / INDEX
        elif (p / SINGLE).is_file():
            p = p / SINGLE
        else:
            found = sorted(x.name for x in p.iterdir())[:8]
            raise FileNotFoundError(
                f"{str(path)!r} holds neither {SINGLE} nor {INDEX} (it holds {found}); pass a .safetensors file, "
                f"an index json, or a directory written by save_pretrained / `mixprec consolidate`")
    if p.name.endswith(".index.json"):
        with open(p) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(p)!r} has no 'weight_map': not a sharded safetensors index")
        return [p.parent / name for name in dict.fromkeys(weight_map.values())]
    if p.suffix != ".safetensors":
        raise ValueError(f"{str(path)!r} is not a safetensors checkpoint (.safetensors file, index json or a "
                         "directory holding one); convert .bin checkpoints with save_pretrained first")
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint file {str(p)!r}")
    return [p]


class MappedSafetensors:
    """Every tensor of some safetensors files, as views of their mapped pages (the Note)."""

    def __init__(self, files: list) -> None:
        self.entries: dict[str, tuple] = {}  # key -> (file index, dtype, shape, byte offset, nbytes)
        self.files = [Path(f) for f in files]
        self._maps: list[Optional[mmap.mmap]] = [None] * len(self.files)
        for i, file in enumerate(self.files):
            with open(file, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError(f"{str(file)!r} is too short to be a safetensors file")
                (length,) = struct.unpack("<Q", head)
                header = json.loads(f.read(length))
            base = 8 + length
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                if key in self.entries:
                    raise ValueError(f"tensor {key!r} is in both {self.files[self.entries[key][0]]} and {file}")
                self.entries[key] = (i, dtype_from_str(info["dtype"]), tuple(info["shape"]), base + begin, end - begin)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple:
        return self.entries[key][2]

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][1]

    def _map(self, i: int) -> mmap.mmap:
        if self._maps[i] is None:
            with open(self.files[i], "rb") as f:
                self._maps[i] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[i]

    def tensor(self, key: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``key``'s tensor: a view of the file's pages, or a copy in ``dtype`` when that
        differs from the stored one (the Note)."""
        i, stored, shape, offset, nbytes = self.entries[key]
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=stored).element_size()
        if numel * itemsize != nbytes:
            raise ValueError(f"{key!r} in {self.files[i]}: {nbytes} bytes for shape {list(shape)} of {stored}")
        if numel == 0:
            out = torch.empty(shape, dtype=stored)
        elif offset % itemsize == 0:
            out = torch.frombuffer(self._map(i), dtype=stored, count=numel, offset=offset).view(shape)
        else:
            raw = bytearray(self._map(i)[offset:offset + nbytes])
            out = torch.frombuffer(raw, dtype=stored, count=numel).view(shape)
        return out if dtype is None or dtype == stored else out.to(dtype)
