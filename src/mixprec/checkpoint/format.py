"""The on-disk checkpoint format: one layout for every backend and world size.

A checkpoint is a directory::

    checkpoint_<k>/
      metadata.json              format version, mixprec/torch versions, backend, world size,
                                 policy, and for every global tensor its shape, dtype and the
                                 ranks' slices (each with its byte offset and checksum); a
                                 checksum per other file and per tensor file's header
      tensors-rank00000.safetensors  the flat slices rank 0 wrote (key "<name>@<offset>")
      objects.pt                 scaler, schedulers, optimizer hyper-parameters, counters,
                                 registered objects (rank 0; torch.save, loaded weights_only)
      rank00000.pt               per-rank RNG states and dataloader positions
      COMPLETE                   written last; holds the sha256 of metadata.json

[Note: checksums] Every checksum in ``metadata.json`` is stored under the name of its
algorithm: ``{"bytes": n, "xxh3_128": "..."}`` for a file, ``"header": {...}`` for a tensor
file's safetensors header, and ``"start"`` (byte offset in its file) plus ``"xxh3_128"`` on
every slice of the shard table. Checksums are computed on the bytes as they are written
and as they are read (one pass each), and a rank verifies only the slices it reads
(checkpoint/reader.py, [Note: verified shares]). The writer uses xxh3_128 from the
``xxhash`` package, a dependency (about 20-28 GB/s on one core), and zlib's crc32 where
xxhash cannot be imported (about 7 GB/s); checkpoints written before this format carry a ``sha256`` per whole file and
still load (every file is then checked whole, as they always were).

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
import io
import json
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Optional

import zlib

import torch

try:  # optional: the fastest checksum; zlib's crc32 (stdlib) otherwise
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

FORMAT_VERSION = 1
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
OBJECTS = "objects.pt"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def state_names_by_head(index) -> dict:
    """Group a checkpoint's optimizer-state tensor names by their parameter:
    ``"optim/<j>/<param key>/"`` -> ``{state key: full name}``. One pass over ``index``, so a
    load that looks up every parameter's state is linear in the number of tensors (a scan
    of ``index`` per parameter was quadratic: 0.5 s of a 0.6 s load at 1,536 tensors)."""
    heads: dict = {}
    for name in index:
        if name.startswith(OPTIM_PREFIX):
            head, _, skey = name.rpartition("/")
            heads.setdefault(head + "/", {})[skey] = name
    return heads


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


# -------------------------------------------------------------- checksums
class _Crc32:
    """zlib's crc32 behind hashlib's update/hexdigest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


CHECKSUMS = ("xxh3_128", "crc32", "sha256")  # the names a metadata entry may carry
CHECKSUM = "xxh3_128" if _xxhash is not None else "crc32"  # what new checkpoints use


def new_checksum(algorithm: Optional[str] = None):
    """A fresh hasher (``update(bytes)``, ``hexdigest()``) for one of :data:`CHECKSUMS`
    (None: :data:`CHECKSUM`, what new checkpoints use)."""
    algorithm = CHECKSUM if algorithm is None else algorithm
    if algorithm == "xxh3_128":
        if _xxhash is None:
            raise CheckpointError(
                "this checkpoint's checksums are xxh3_128 but the xxhash package is not installed; "
                "pip install xxhash (or mixprec[fast-checksum]) to load it"
            )
        return _xxhash.xxh3_128()
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} in checkpoint metadata; known: {list(CHECKSUMS)}")


def checksum_in(entry: dict) -> Optional[tuple]:
    """``(algorithm, hex digest)`` of a metadata entry, or None when it names none."""
    for algorithm in CHECKSUMS:
        if isinstance(entry.get(algorithm), str):
            return algorithm, entry[algorithm]
    return None


def checksum_bytes(data, algorithm: Optional[str] = None) -> str:
    h = new_checksum(algorithm)
    h.update(data)
    return h.hexdigest()


# ------------------------------------------------- streaming safetensors
def write_safetensors(f: BinaryIO, entries: list, producer, metadata: Optional[dict] = None, *,
                      hold: bool = False) -> dict:
    """Write a safetensors file one tensor at a time; returns what the metadata records of it
    ([Note: checksums]): ``{"bytes", "header": {"bytes", <algorithm>}, "entries": [{"start",
    <algorithm>}, ...]}``, each checksum computed on the bytes as they are written.

    ``entries`` is a list of ``(key, shape, dtype)`` known in advance (the header needs the
    offsets); ``producer(i)`` returns the i-th tensor when its turn comes, so at most one
    tensor is in memory. A produced tensor whose shape/dtype differ from its entry is refused.
    ``hold=True`` says the produced tensors stay alive and unchanged until the file is written
    (the live state of a save): the end of one may then wait to go out in one write with the
    start of the next ([Note: aligned writes]); otherwise each tensor is written out before
    the next is produced.

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
    head = len(raw).to_bytes(8, "little") + raw
    out = _RegionWriter(f)
    out.add(memoryview(head))
    record = {"bytes": len(head), "header": {"bytes": len(head), CHECKSUM: checksum_bytes(head)}, "entries": []}
    pos = len(head)
    scratch = None  # the bounded staging buffer of tensors that are not CPU-contiguous
    for i, (key, shape, dtype) in enumerate(entries):
        t = producer(i)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"tensor {key!r}: got shape {tuple(t.shape)} dtype {t.dtype}, expected shape "
                f"{tuple(shape)} dtype {dtype}; refusing to write a tensor that does not match"
            )
        digest = new_checksum()
        if t.numel():
            scratch = _write_chunks(out, t.detach().reshape(-1), digest, scratch)
            if not hold:
                out.flush()
        del t
        record["entries"].append({"start": pos, CHECKSUM: digest.hexdigest()})
        pos += numel_of(shape) * torch.empty((), dtype=dtype).element_size()
    out.flush()
    record["bytes"] = pos
    return record


# [Note: streaming I/O] Tensor bytes move in chunks of CHUNK_BYTES: each chunk is checksummed
# and written (or read and checksummed) while it is in the CPU's cache, so each byte is
# touched once in memory. A CPU tensor that is contiguous is written from its own memory;
# any other (another device, strided) goes through one reused buffer of CHUNK_BYTES, so a
# save never holds a copy of a whole tensor, let alone of the checkpoint
# (checkpoint/reader.py streams the same way on load).
#
# [Note: aligned writes] What reaches the kernel is one write per CHUNK_BYTES-aligned region
# of the *file* (``os.writev`` of the pieces that fill it: the end of one tensor, the start of
# the next, the header), not one per chunk of each tensor. The kernel sizes the page-cache
# folios of a buffered write by the write's length and the alignment of where it starts:
# 4 MiB writes that start a few hundred bytes past a boundary (the header's length) left
# 288 MiB of a 604 MB checkpoint in 2 MiB folios and the rest in ever smaller ones (144 MiB
# in 1 MiB folios, 72 in 512 KiB, ...; measured on this machine's ext4 with the
# filemap:mm_filemap_add_to_page_cache tracepoint), and cutting each tensor's chunks at file
# boundaries still left a run of small folios at every tensor's start (432 MiB in 2 MiB
# folios). Region by region, all but the file's first and last region are 2 MiB folios. The
# bytes, and so the file and its checksums, are the same. Small folios cost the page cache
# more per byte, and when they are dropped the memory comes back in pieces too small for
# the 2 MiB folios a cold read's read-ahead allocates (docs/checkpointing.md, "Speed").
CHUNK_BYTES = 4 << 20


class _RegionWriter:
    """Pieces of a file written in order, one ``os.writev`` per CHUNK_BYTES-aligned region of
    the file ([Note: aligned writes]); a file object without a descriptor gets each piece as
    it comes. A piece must stay unchanged until ``flush`` (``add(..., stable=False)`` flushes
    at once)."""

    MAX_PARTS = 512  # below IOV_MAX (1024 on Linux)

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        try:
            f.flush()
            self.fd: Optional[int] = f.fileno()
            self.pos = os.lseek(self.fd, 0, os.SEEK_CUR)
        except (AttributeError, OSError, io.UnsupportedOperation):
            self.fd, self.pos = None, 0
        self.parts: list = []
        self.pending = 0

    def add(self, piece: memoryview, stable: bool = True) -> None:
        if self.fd is None:
            self.f.write(piece)
            self.pos += len(piece)
            return
        self.parts.append(piece)
        self.pending += len(piece)
        if (not stable or len(self.parts) >= self.MAX_PARTS
                or self.pos // CHUNK_BYTES != (self.pos + self.pending) // CHUNK_BYTES):  # reached a boundary
            self.flush()

    def room(self) -> int:
        """Bytes from the end of what was added to the next region boundary."""
        return CHUNK_BYTES - (self.pos + self.pending) % CHUNK_BYTES

    def flush(self) -> None:
        parts = self.parts
        while parts:
            n = os.writev(self.fd, parts)
            if n <= 0:  # a regular file takes at least a byte or raises (ENOSPC, EIO)
                raise OSError(f"writev wrote nothing at byte {self.pos} of the file; nothing more was written")
            self.pos += n
            self.pending -= n
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts and n:
                parts[0] = parts[0][n:]
        self.parts, self.pending = [], 0


def _write_chunks(out: _RegionWriter, flat: torch.Tensor, digest, scratch: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Write the 1-D ``flat`` through ``out`` in pieces that end at its region boundaries
    ([Note: aligned writes]), feeding ``digest``; returns the staging buffer (made on first
    need, reused by the caller for the next tensor)."""
    if flat.device.type == "cpu" and flat.is_contiguous():  # bytes from its own memory, cut anywhere
        data = memoryview(flat.view(torch.uint8).numpy())
        lo = 0
        while lo < len(data):
            chunk = data[lo: lo + out.room()]
            digest.update(chunk)
            out.add(chunk)
            lo += len(chunk)
        return scratch
    size = flat.element_size()
    total, lo = flat.numel(), 0
    while lo < total:
        n = min(max(1, out.room() // size), total - lo)  # whole elements: one may cross a boundary
        if scratch is None:
            scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8,
                                  pin_memory=flat.device.type == "cuda" and torch.cuda.is_available())
        staged = scratch[: n * size].view(flat.dtype)
        staged.copy_(flat.narrow(0, lo, n))
        chunk = memoryview(staged.view(torch.uint8).numpy())
        digest.update(chunk)
        out.add(chunk, stable=False)  # the staging buffer is reused: written at once
        lo += n
    return scratch


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    return checksum_file(path, "sha256", chunk)


def checksum_file(path: Path, algorithm: Optional[str] = None, chunk: int = 1 << 22) -> str:
    digest = new_checksum(algorithm)
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


def atomic_write(path: Path, write: Callable) -> Path:
    """``write(f)`` into a temporary file beside ``path`` (fsynced), then renamed onto it:
    a failure leaves any previous ``path`` in place."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
