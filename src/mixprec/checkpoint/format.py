"""The on-disk checkpoint format: one layout for every backend and world size.

A checkpoint is a directory::

    checkpoint_<k>/
      metadata.json              format version, mixprec/torch versions, backend, world size,
                                 policy, and for every global tensor its shape, dtype and the
                                 ranks' slices; a sha256 per other file
      tensors-rank00000.safetensors  the flat slices rank 0 wrote (key "<name>@<offset>")
      objects.pt                 scaler, schedulers, optimizer hyper-parameters, counters,
                                 registered objects (rank 0; torch.save, loaded weights_only)
      rank00000.pt               per-rank RNG states and dataloader positions
      COMPLETE                   written last; holds the sha256 of metadata.json

Every global tensor is identified by a name (``model/<param or buffer>``,
``optim/<i>/<param name>/<state key>``) and stored flat: a rank's slice is the element
range ``[offset, offset + numel)`` of the tensor's row-major flattening, so any engine can
read back any range whatever the world size or backend that wrote it.

Example::

    shard = Shard("model/0.weight", (64, 16), torch.float32, 0, w.reshape(-1), replicated=True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO, Iterable, Optional

import torch

FORMAT_VERSION = 1
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
OBJECTS = "objects.pt"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (incomplete, corrupt, or not matching the model)."""


def tensor_file(rank: int) -> str:
    return f"tensors-rank{rank:05d}.safetensors"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def model_prefix(index: int) -> str:
    """``model/`` for the first prepared model, ``model<i>/`` for the others."""
    return MODEL_PREFIX if index == 0 else f"model{index}/"


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one rank holds of one global tensor (the unit of the engine contract).

    Attributes:
        name: global tensor name, e.g. ``"model/encoder.0.weight"`` or
            ``"optim/0/encoder.0.weight/exp_avg"``.
        shape: the GLOBAL shape (as the unsharded tensor has it).
        dtype: the dtype it is saved in (fp32 for parameters with fp32 masters).
        offset: first element of the flat range this rank holds.
        tensor: the local elements, flat (1-D, ``numel`` elements; any device).
        replicated: every rank holds the same whole tensor, so only rank 0 writes it.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    offset: int
    tensor: torch.Tensor
    replicated: bool

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def check(self) -> None:
        """Raise when the slice does not fit its global tensor (never save a bad shard)."""
        total = numel_of(self.shape)
        if self.tensor.dim() != 1 and not (self.tensor.dim() == 0 and total == 1):
            raise ValueError(f"shard {self.name!r}: tensor must be flat (1-D), got shape {tuple(self.tensor.shape)}")
        if self.tensor.dtype != self.dtype:
            raise ValueError(f"shard {self.name!r}: tensor dtype {self.tensor.dtype} != declared {self.dtype}")
        if self.offset < 0 or self.offset + self.numel > total:
            raise ValueError(
                f"shard {self.name!r}: range [{self.offset}, {self.offset + self.numel}) lies outside "
                f"the global tensor of shape {tuple(self.shape)} ({total} elements)"
            )
        if self.replicated and (self.offset != 0 or self.numel != total):
            raise ValueError(
                f"shard {self.name!r} is marked replicated but holds [{self.offset}, "
                f"{self.offset + self.numel}) of {total} elements; a replicated shard holds the whole tensor"
            )


def numel_of(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------- dtypes
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_NAMES = {v: k for k, v in _ST_DTYPES.items()}
DTYPE_ALIASES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; supported: {sorted(map(str, _ST_DTYPES))}")
    return _ST_DTYPES[dtype]


def dtype_from_str(name: str) -> torch.dtype:
    if name not in _NAMES:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata; known: {sorted(_NAMES)}")
    return _NAMES[name]


def parse_dtype(value) -> Optional[torch.dtype]:
    """``None``, a torch dtype, or a name like ``"bf16"`` -> a torch dtype (or None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[value.lower()]
    raise ValueError(f"dtype={value!r} is not supported; use one of {sorted(DTYPE_ALIASES)} or a torch.dtype")


# ------------------------------------------------- streaming safetensors
def write_safetensors(f: BinaryIO, entries: list, producer, metadata: Optional[dict] = None) -> str:
    """Write a safetensors file one tensor at a time; returns the sha256 of what was written.

    ``entries`` is a list of ``(key, shape, dtype)`` known in advance (the header needs the
    offsets); ``producer(i)`` returns the i-th tensor when its turn comes, so at most one
    tensor is in memory. A produced tensor whose shape/dtype differ from its entry is refused.

    Example::

        with open("w.safetensors", "wb") as f:
            write_safetensors(f, [("w", (2, 2), torch.float32)], lambda i: torch.ones(2, 2))
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    start = 0
    for key, shape, dtype in entries:
        nbytes = numel_of(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": dtype_to_str(dtype), "shape": [int(s) for s in shape],
                       "data_offsets": [start, start + nbytes]}
        start += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()

    def put(data) -> None:
        digest.update(data)
        f.write(data)

    put(len(raw).to_bytes(8, "little"))
    put(raw)
    for i, (key, shape, dtype) in enumerate(entries):
        t = producer(i)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"tensor {key!r}: got shape {tuple(t.shape)} dtype {t.dtype}, expected shape "
                f"{tuple(shape)} dtype {dtype}; refusing to write a tensor that does not match"
            )
        if t.numel():
            put(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or directory (directories: so renames and new entries are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
