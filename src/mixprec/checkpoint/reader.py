"""Open a checkpoint, prove it complete, intact and well-formed, and read any range of any tensor.

[Note: well-formed] The sha256 checks prove the files are the ones the metadata names, not
that the metadata is right: an edited or hand-assembled checkpoint can pass them with a
shard table that has a hole, names a key its file does not hold, or a dtype its file does
not store. The constructor therefore also checks every field it will ever read (required
metadata fields, every tensor's shape, dtype and slice table, every slice's file and key in
that file's safetensors header) so that a later read cannot fail half-way through a load.
Every rank runs the same checks of the metadata on every tensor, not only on the ranges it
will read.

[Note: verified shares] Every byte is checked before anything is loaded, each rank checking
a share. ``CheckpointReader(path, share=(rank, world))`` (what ``load_state`` uses) verifies
in its constructor the header and every slice of the tensor files ``k`` with
``k % world == rank`` (for a load by the layout that saved, exactly the files this rank
wrote: half of a ddp checkpoint, this rank's slices of a ZeRO one). It streams them through
one reused buffer of ``format.CHUNK_BYTES`` ([Note: streaming I/O] in format.py), checksumming
each chunk while it is in the CPU's cache, and keeps nothing: memory stays bounded whatever
the checkpoint's size. ``load_state`` then agrees on every rank's verdict before anything
changes (checkpoint/state.py, [Note: two-phase load]) and calls :meth:`shares_agreed`: every
byte was checked by some rank, so the load reads ``read_into`` straight into the live
tensors (fp32 masters, parameters, buffers, optimizer state; engines/replicated_state.py and
engines/zero_state.py), a plain ``pread`` into memory that is already mapped, with no
staging copy and no second checksum. A slice that nobody verified (a reader without
``share`` built with ``verify_files=False``) is checksummed as it is read, and a read that
covers part of such a slice verifies the whole slice first. Without ``share`` the
constructor checks every byte (as ``mixprec consolidate`` and a bare reader need). The
small files (``objects.pt``, ``rank*.pt``) are checked whenever they are loaded. Old
checkpoints, with one sha256 per whole file, are checked whole as before.

So a load reads the bytes of its share twice, once to verify (before the agreement) and
once into the model (after): that is what "a failure loads nothing" costs without staging
the checkpoint in memory. The second read is served by the page cache when the checkpoint
fits in it, and streams from the disk again when it does not.

Example::

    reader = CheckpointReader("project/checkpoints/checkpoint_3")   # raises if incomplete/corrupt
    reader.index["model/0.weight"]             # ((64, 16), torch.float32)
    w = reader("model/0.weight", 0, 1024)      # flat elements [0, 1024), from any rank's file
"""

from __future__ import annotations

import hashlib
import io
import json
import os
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

    def __init__(self, path, verify_files: bool = True, share: Optional[tuple] = None) -> None:
        self.path = Path(path)
        self._fds: dict = {}
        self._verified: set = set()  # (file, start) of the slices checksummed by this process
        self._agreed = False  # shares_agreed(): every slice was checksummed by some rank
        self._scratch: Optional[torch.Tensor] = None  # the reused buffer of CHUNK_BYTES
        self._headers_ok: set = set()
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
        self.index = {
            name: (tuple(e["shape"]), fmt.dtype_from_str(e["dtype"])) for name, e in self.metadata["tensors"].items()
        }
        self._handles: dict = {}
        files = self.metadata["files"]
        self._slices_of: dict = {}  # tensor file -> [(tensor name, shard)]
        for name, e in self.metadata["tensors"].items():
            for sh in e["shards"]:
                self._slices_of.setdefault(sh["file"], []).append((name, sh))
        if verify_files:
            rank, world = share if share is not None else (0, 1)
            tensor_files = sorted(n for n in files if n.startswith("tensors-rank"))
            mine = set(tensor_files[rank::world]) if share is not None else set(tensor_files)
            for name, info in files.items():
                if self._is_sliced(name):
                    if name in mine:
                        self._verify_sliced_file(name)
                    else:
                        self._check_size(name, info)
                else:  # small files, and whole-file checksums of old checkpoints
                    self._verify(name, info)
            if any(not self._is_sliced(n) for n in self._slices_of):
                self._check_slices()

    def _is_sliced(self, file: str) -> bool:
        """A tensor file whose header and slices carry their own checksums ([Note: checksums])."""
        return isinstance(self.metadata["files"][file].get("header"), dict)

    def shares_agreed(self) -> None:
        """Every rank verified its share and all agreed ([Note: verified shares]): later reads
        go straight into their destination without checksumming again."""
        self._agreed = True

    def release(self) -> None:
        """Drop the staging buffer and close the files (the reader stays usable)."""
        self._scratch = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            fd = os.open(self.path / file, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # larger read-ahead for the sequential reads
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[file] = fd
        return self._fds[file]

    def _chunk_buffer(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(fmt.CHUNK_BYTES, dtype=torch.uint8)
        return self._scratch

    def _stream(self, file: str, start: int, nbytes: int, out: Optional[torch.Tensor], digest) -> None:
        """Bytes ``[start, start + nbytes)`` of ``file`` in chunks ([Note: streaming I/O]):
        into ``out`` (flat, ``nbytes`` bytes of any dtype and device; None: nowhere), each
        chunk fed to ``digest`` (None: no checksum) while it is in the cache. A CPU ``out``
        that is contiguous is read into directly; anything else goes through the reused
        buffer."""
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        view = memoryview(out.view(torch.uint8).numpy()) if direct and nbytes else None
        size = out.element_size() if out is not None else 1
        step = fmt.CHUNK_BYTES
        for lo in range(0, nbytes, step):
            n = min(step, nbytes - lo)
            if direct:
                chunk = view[lo: lo + n]
            else:
                staged = self._chunk_buffer()[:n]
                chunk = memoryview(staged.numpy())
            self._pread(file, start + lo, chunk)
            if digest is not None:
                digest.update(chunk)
            if out is not None and not direct:
                out.narrow(0, lo // size, n // size).copy_(staged.view(out.dtype))

    def _pread(self, file: str, start: int, view: memoryview) -> None:
        fd, done, total = self._fd(file), 0, len(view)
        while done < total:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                if self._agreed:  # its size was checked before the agreement: it changed since
                    raise CheckpointError(
                        f"checkpoint {str(self.path)!r}: {file} ends at byte {start + done}, shorter than when "
                        "it was verified: the checkpoint changed while it was being loaded, and what was read "
                        "before this point is loaded. Load it again, or another checkpoint"
                    )
                raise CheckpointError(
                    f"checkpoint {str(self.path)!r}: {file} ends at byte {start + done}, its metadata says "
                    f"more (truncated or corrupt); nothing was loaded. Load another checkpoint"
                )
            done += n

    def _pread_into(self, file: str, start: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.view(torch.uint8).numpy()) if buf.numel() else memoryview(b"")
        fd, done, total = self._fd(file), 0, len(view)
        while done < total:
            n = os.preadv(fd, [view[done: done + (1 << 30)]], start + done)
            if n <= 0:
                raise CheckpointError(
                    f"checkpoint {str(self.path)!r}: {file} ends at byte {start + done}, its metadata says "
                    f"more (truncated or corrupt); nothing was loaded. Load another checkpoint"
                )
            done += n

    def _corrupt(self, file: str, what: str, algorithm: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(self.path)!r}: {file} fails its checksum ({algorithm}) on {what} (corrupt); "
            "nothing was loaded. Load another checkpoint"
        )

    def _check_size(self, name: str, info: dict) -> None:
        path = self.path / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(self.path)!r} lacks its file {name!r}; nothing was loaded")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: {name} has {size} bytes, its metadata says "
                f"{info['bytes']} (truncated or corrupt); nothing was loaded. Load another checkpoint"
            )

    def _verify_header(self, file: str) -> None:
        """The file's safetensors header has its checksum and lists every slice the table
        puts in this file at the byte range, shape and dtype the table says."""
        if file in self._headers_ok:
            return
        info = self.metadata["files"][file]
        self._check_size(file, info)
        head = info["header"]
        raw = torch.empty(head["bytes"], dtype=torch.uint8)
        self._pread_into(file, 0, raw)
        data = raw.numpy().tobytes()
        algorithm, expected = fmt.checksum_in(head)
        if fmt.checksum_bytes(data, algorithm) != expected:
            raise self._corrupt(file, "its header", algorithm)
        try:
            header = json.loads(data[8:])
        except ValueError as e:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {file} has an unreadable header ({e})") from None
        for name, sh in self._slices_of.get(file, []):
            where = f"tensors.{name}.shards[{self.metadata['tensors'][name]['shards'].index(sh)}]"
            if sh["key"] not in header:
                raise self._bad(where + ".key", f"{sh['key']!r} is not in {file}")
            e = header[sh["key"]]
            dtype = self.metadata["tensors"][name]["dtype"]
            if e.get("shape") != [sh["numel"]] or e.get("dtype") != dtype:
                raise self._bad(where, f"{file}[{sh['key']!r}] stores shape {e.get('shape')} dtype "
                                f"{e.get('dtype')}, the table says [{sh['numel']}] {dtype}")
            lo = sh["start"] - head["bytes"]
            if e.get("data_offsets") != [lo, lo + self._nbytes(name, sh)]:
                raise self._bad(where + ".start", f"{file}[{sh['key']!r}] lies at bytes {e.get('data_offsets')} "
                                f"of its data, the table says {[lo, lo + self._nbytes(name, sh)]}")
        self._headers_ok.add(file)

    def _nbytes(self, name: str, sh: dict) -> int:
        return sh["numel"] * torch.empty((), dtype=self.index[name][1]).element_size()

    def _read_slice(self, name: str, sh: dict, out: Optional[torch.Tensor] = None) -> None:
        """The whole slice ``sh`` of ``name`` into ``out`` (None: only verified), streamed and
        checksummed on the way unless it was verified already ([Note: verified shares])."""
        known = self._agreed or (sh["file"], sh["start"]) in self._verified
        if known and out is None:
            return
        if not known:
            self._verify_header(sh["file"])
        algorithm, expected = fmt.checksum_in(sh)
        digest = None if known else fmt.new_checksum(algorithm)
        self._stream(sh["file"], sh["start"], self._nbytes(name, sh), out, digest)
        if digest is not None:
            if digest.hexdigest() != expected:
                raise self._corrupt(sh["file"], f"the slice {sh['key']!r}", algorithm)
            self._verified.add((sh["file"], sh["start"]))

    def _verify_sliced_file(self, file: str) -> None:
        """Verify a tensor file's header and every slice in it, keeping nothing."""
        self._verify_header(file)
        for name, sh in sorted(self._slices_of.get(file, []), key=lambda x: x[1]["start"]):
            self._read_slice(name, sh)

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
            head = info.get("header") if isinstance(info, dict) else None
            summed = isinstance(info, dict) and (
                fmt.checksum_in(info) is not None
                or (isinstance(head, dict) and isinstance(head.get("bytes"), int) and fmt.checksum_in(head) is not None))
            if not (summed and isinstance(info.get("bytes"), int)) or "/" in name or name.startswith("."):
                raise self._bad(f"files.{name}", f"must be {{bytes: int, <checksum>: str}} or {{bytes: int, header: "
                                f"{{bytes: int, <checksum>: str}}}} (checksums: {list(fmt.CHECKSUMS)}) naming a "
                                f"file of the checkpoint, got {info!r}")
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
                if isinstance(m["files"][sh["file"]].get("header"), dict):
                    info = m["files"][sh["file"]]
                    nbytes = sh["numel"] * torch.empty((), dtype=fmt.dtype_from_str(e["dtype"])).element_size()
                    start = sh.get("start")
                    if (not isinstance(start, int) or isinstance(start, bool) or fmt.checksum_in(sh) is None
                            or start < info["header"]["bytes"] or start + nbytes > info["bytes"]):
                        raise self._bad(f"{where}.shards[{k}]", f"must have a start (byte offset) inside the data of "
                                        f"{sh['file']} ({info['header']['bytes']}..{info['bytes']}) and a checksum, "
                                        f"got {sh!r}")
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
                if self._is_sliced(sh["file"]):
                    continue
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
        """A whole file against its size and checksum (small files; old tensor files)."""
        self._check_size(name, info)
        if self._is_sliced(name):
            self._verify_sliced_file(name)
            return
        algorithm, expected = fmt.checksum_in(info)
        if fmt.checksum_file(self.path / name, algorithm) != expected:
            raise self._corrupt(name, "its contents", algorithm)

    def _read_blob_bytes(self, name: str) -> bytes:
        info = self.metadata["files"].get(name)
        if info is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {name} is not listed in {fmt.METADATA}")
        self._check_size(name, info)
        data = (self.path / name).read_bytes()
        algorithm, expected = fmt.checksum_in(info)
        if fmt.checksum_bytes(data, algorithm) != expected:
            raise self._corrupt(name, "its contents", algorithm)
        return data

    @property
    def world_size(self) -> int:
        return int(self.metadata["world_size"])

    def __call__(self, name: str, offset: int, numel: int) -> torch.Tensor:
        """Flat elements ``[offset, offset + numel)`` of the global tensor ``name`` (a new tensor)."""
        if name not in self.index:
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no tensor {name!r}")
        if numel < 0:
            raise ValueError(f"{name!r}: range [{offset}, {offset + numel}) has a negative length")
        out = torch.empty(numel, dtype=self.index[name][1])
        self.read_into(name, offset, out)
        return out

    def read_into(self, name: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Read flat elements ``[offset, offset + out.numel())`` of ``name`` into ``out``, a 1-D
        tensor of the tensor's dtype on any device (a CPU one that is contiguous is read into
        directly, without a copy: [Note: verified shares]). Returns ``out``."""
        if name not in self.index:
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no tensor {name!r}")
        shape, dtype = self.index[name]
        if out.dim() != 1 or out.dtype != dtype:
            raise ValueError(f"{name!r}: read_into needs a 1-D {dtype} tensor, got shape "
                             f"{tuple(out.shape)} dtype {out.dtype}")
        total, numel = fmt.numel_of(shape), out.numel()
        if offset < 0 or offset + numel > total:
            raise ValueError(f"{name!r}: range [{offset}, {offset + numel}) outside its {total} elements")
        end = offset + numel
        filled = 0
        for s in self.metadata["tensors"][name]["shards"]:
            lo, hi = max(offset, s["offset"]), min(end, s["offset"] + s["numel"])
            if lo >= hi:
                continue
            part = out[lo - offset: hi - offset]
            if self._is_sliced(s["file"]):
                if lo == s["offset"] and hi == s["offset"] + s["numel"]:
                    self._read_slice(name, s, part)
                else:  # part of a slice: the whole slice is verified first (read, not kept)
                    self._read_slice(name, s)
                    size = out.element_size()
                    self._stream(s["file"], s["start"] + (lo - s["offset"]) * size, (hi - lo) * size, part, None)
            else:
                part.copy_(self._handle(s["file"]).get_slice(s["key"])[lo - s["offset"]: hi - s["offset"]])
            filled += hi - lo
        if filled != numel:
            raise CheckpointError(f"{name!r}: the checkpoint's slices cover {filled} of the {numel} elements asked for")
        torch.autograd.graph.increment_version(out)  # a pread is a write torch does not see (see read_into below)
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
        data = self._read_blob_bytes(name)
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True)
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


def read_into(read, name: str, offset: int, dst: torch.Tensor) -> None:
    """Fill ``dst`` (any shape, any device) with flat elements ``[offset, offset + dst.numel())``
    of ``name`` from ``read`` (a :class:`CheckpointReader`, or any ``read(name, offset, numel)``
    callable, such as a folder written by Accelerate or a tensor-parallel view, which may
    forward other attributes to the reader it wraps but reads other ranges): in place, without
    a staging copy, when ``read`` is a :class:`CheckpointReader` and ``dst`` is contiguous in
    the checkpoint's dtype; else through a temporary of ``dst``'s size."""
    dst = dst.detach()
    if type(read) is CheckpointReader and dst.is_contiguous() and dst.dtype == read.index[name][1]:
        read.read_into(name, offset, dst.view(-1))
        # A pread is a write torch does not see: bump the version as copy_ would, so that
        # whatever checks it sees the new values (the forward's weight copies, [Note: the
        # update writes the forward's weights] in engines/weight_casts.py; autograd's saved
        # tensors).
        torch.autograd.graph.increment_version(dst)
        return
    with torch.no_grad():
        dst.copy_(read(name, offset, dst.numel()).reshape(dst.shape))
