"""Write a checkpoint atomically from every rank (see :mod:`.format` for the layout).

[Note: atomic saves] Every rank writes into one temporary directory next to the target
(``.<name>.tmp-<host>-<pid>-<id>``, named by rank 0). Files are fsynced; rank 0 then gathers the ranks'
slice lists and file checksums, checks that the slices tile every global tensor exactly,
writes ``metadata.json``, writes ``COMPLETE`` last (holding the metadata's sha256), fsyncs
and renames the directory into place. A crash at any point before the rename leaves the
previous checkpoint untouched and only a temporary directory that no listing shows and
no load accepts; the next save removes it ([Note: stale temporaries]).

Example::

    write_checkpoint(state, Path("ckpt/checkpoint_3"), shards, rank_state, objects, meta)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
import signal
import uuid
from pathlib import Path
from typing import Optional

import torch

from ..distributed import collectives
from ..distributed.state import DistributedState
from ..utils import pid_alive
from . import format as fmt

# Test hook: the rank given here SIGKILLs itself half-way through writing its tensor file.
KILL_ENV = "MIXPREC_CHECKPOINT_TEST_KILL_RANK"
# Test hook: "1" makes rank 0 SIGKILL itself between the two renames of an overwrite (the
# previous checkpoint moved aside, the new one not yet in place: [Note: interrupted overwrite]).
KILL_BETWEEN_RENAMES_ENV = "MIXPREC_CHECKPOINT_TEST_KILL_BETWEEN_RENAMES"


def write_checkpoint(
    state: DistributedState,
    target: Path,
    shards: list,
    rank_state: dict,
    objects: Optional[dict],
    meta: dict,
) -> Path:
    """Collective: write this rank's part; rank 0 completes and renames. Returns ``target``."""
    target = Path(os.path.abspath(target))
    check_same_target(state, target)
    tmp_name = collectives.broadcast_object_list(state, [_temp_name(target.name, "tmp")])[0]
    tmp = target.parent / tmp_name
    if state.rank == 0:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent)
        tmp.mkdir()
    collectives.barrier(state)
    report = _run(lambda: _write_rank_files(state, tmp, shards, rank_state, objects))
    reports = collectives.gather_object(state, report)
    outcome = None
    if state.rank == 0:
        outcome = _first_error(reports)
        if outcome is None:
            # _complete returns {} or, through _run, {"error": ...}: an error must fail the save.
            outcome = _run(lambda: _complete(tmp, target, reports, meta)).get("error")
    outcome = collectives.broadcast_object_list(state, [outcome])[0]
    if outcome is not None:
        if state.rank == 0:  # every rank wrote and reported: nobody uses the temporary now
            shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"save_state({str(target)!r}) failed; the previous checkpoint is untouched: {outcome}")
    return target


def check_same_target(state: DistributedState, target: Path) -> None:
    """Every rank must save into the same directory (else only rank 0's would be written,
    holding the other ranks' files for a checkpoint they never asked for): all ranks raise."""
    targets = collectives.gather_object(state, [str(target)])
    if len(set(targets)) > 1:
        listed = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(targets))
        raise ValueError(
            f"save_state() got different directories on different ranks ({listed}); nothing was "
            "written. Pass the same output_dir on every process (e.g. not one built from the rank)"
        )


# [Note: stale temporaries] A save killed before its rename leaves `.<name>.tmp-...` (or,
# killed between the two renames of an overwrite, `.<name>.old-...`) behind for ever. The
# names carry the host and pid of the rank 0 that made them, so the next save (rank 0,
# before making its own) removes exactly those that are ours and dead: made on this host by
# a process that no longer exists (or by this very process, whose saves run one at a
# time). Temporaries of a live process, of another host, or not named this way are left.
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-(?P<id>[0-9a-f]{12})$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _temp_name(name: str, kind: str) -> str:
    return f".{name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def remove_stale_temporaries(parent: Path) -> list:
    """Remove the stale temporary directories of interrupted saves in ``parent``
    ([Note: stale temporaries]); returns the paths removed."""
    removed = []
    if not parent.is_dir():
        return removed
    host = _host()
    for entry in parent.iterdir():
        m = _TEMP.match(entry.name)
        if m is None or m["host"] != host or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or not pid_alive(pid):
            if m["kind"] == "old" and restore_moved_aside(parent / m["target"]) is not None:
                continue  # it was the only copy: put back, not removed
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# [Note: interrupted overwrite] Overwriting a checkpoint renames the existing one aside
# (``.<name>.old-<host>-<pid>-<id>``) and then the new one into place. A crash between the two
# renames leaves no ``<name>`` at all: the previous checkpoint is whole, only hidden. When
# ``<name>`` is missing and a complete ``.old-`` of a dead process of this host (or of this
# process) is there, it is renamed back (the newest, if several): ``load_state``, the listing
# of automatic checkpoints and the next save all do this first. The new checkpoint, whose
# save did not return, stays a temporary and is removed as one.
def restore_moved_aside(target: Path) -> Optional[Path]:
    """Rename the checkpoint an interrupted overwrite left aside back to ``target``
    ([Note: interrupted overwrite]); returns ``target`` when it did, else None."""
    target = Path(target)
    parent = target.parent
    if target.exists() or not parent.is_dir():
        return None
    host, candidates = _host(), []
    for entry in parent.iterdir():
        m = _TEMP.match(entry.name)
        if (m is None or m["kind"] != "old" or m["target"] != target.name or m["host"] != host
                or not entry.is_dir() or entry.is_symlink() or not (entry / fmt.COMPLETE).is_file()):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or not pid_alive(pid):
            candidates.append((entry.stat().st_mtime, entry))
    for _, entry in sorted(candidates, reverse=True):
        try:
            os.rename(entry, target)
        except OSError:  # another rank put it back first, or it is gone
            if target.exists():
                return target
            continue
        fmt.fsync_path(parent)
        return target
    return None


def _run(fn):
    try:
        return fn()
    except (ValueError, TypeError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _first_error(reports: list) -> Optional[str]:
    for rank, r in enumerate(reports):
        if "error" in r:
            return f"rank {rank}: {r['error']}"
    return None


# [Note: replicated shares] A tensor every rank holds (ddp, and the buffers/frozen
# parameters of the ZeRO engines) is written once, but not all by rank 0: every rank works
# out the same split from the same list (deterministic: names, sizes and order agree on
# every rank, and _complete refuses a table with a hole or overlap if they do not), so each
# rank writes and checksums about 1/world of the replicated bytes. Tensors of at least
# _SPLIT_BYTES are cut into world contiguous ranges; smaller ones go whole to the rank that
# has the fewest bytes so far.
_SPLIT_BYTES = 1 << 20


def my_share(shards: list, rank: int, world: int) -> list:
    """The shards this rank writes ([Note: replicated shares])."""
    for s in shards:
        s.check()
    if world == 1:
        return list(shards)
    load = [0] * world
    mine = []
    for s in shards:
        if not s.replicated:
            mine.append(s)
            continue
        nbytes = s.numel * s.tensor.element_size()
        if nbytes >= _SPLIT_BYTES and s.numel >= world:
            lo, hi = s.numel * rank // world, s.numel * (rank + 1) // world
            for r in range(world):
                load[r] += (s.numel * (r + 1) // world - s.numel * r // world) * s.tensor.element_size()
            mine.append(fmt.Shard(s.name, s.shape, s.dtype, lo, s.tensor.narrow(0, lo, hi - lo), False))
            continue
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += nbytes
        if owner == rank:
            mine.append(s)
    return mine


def _write_rank_files(state, tmp: Path, shards: list, rank_state: dict, objects: Optional[dict]) -> dict:
    mine = my_share(shards, state.rank, state.world_size)
    whole = {s.name for s in shards if s.replicated}  # every rank loads these whole
    entries = [(f"{s.name}@{s.offset}", (s.numel,), s.dtype) for s in mine]
    kill = os.environ.get(KILL_ENV) == str(state.rank)

    def produce(i: int) -> torch.Tensor:
        if kill and i >= len(mine) // 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return mine[i].tensor.reshape(-1)

    files = {}
    name = fmt.tensor_file(state.rank)
    with open(tmp / name, "wb") as f:
        record = write_safetensors_synced(f, entries, produce)
    files[name] = {"bytes": record["bytes"], "header": record["header"]}
    if kill:  # a rank holding no tensors of its own dies after its (empty) tensor file
        os.kill(os.getpid(), signal.SIGKILL)
    files[fmt.rank_file(state.rank)] = _write_blob(tmp / fmt.rank_file(state.rank), rank_state)
    if objects is not None:
        files[fmt.OBJECTS] = _write_blob(tmp / fmt.OBJECTS, objects)
    slices = [
        {"name": s.name, "shape": list(s.shape), "dtype": fmt.dtype_to_str(s.dtype), "offset": s.offset,
         "numel": s.numel, "replicated": s.name in whole, "key": key, "file": name, **where}
        for s, (key, _, _), where in zip(mine, entries, record["entries"])
    ]
    return {"files": files, "slices": slices}


def write_safetensors_synced(f, entries, produce) -> dict:
    """The rank's tensor file: ``produce`` hands out views of the live state, which stay as
    they are until the save returns, so pieces may wait for their region ([Note: aligned
    writes] in checkpoint/format.py)."""
    record = fmt.write_safetensors(f, entries, produce, hold=True)
    f.flush()
    os.fsync(f.fileno())
    return record


def _write_blob(path: Path, obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {fmt.CHECKSUM: fmt.checksum_bytes(data), "bytes": len(data)}


def _complete(tmp: Path, target: Path, reports: list, meta: dict) -> dict:
    tensors: dict = {}
    files: dict = {}
    for r in reports:
        files.update(r["files"])
        for s in r["slices"]:
            entry = tensors.setdefault(s["name"], {"shape": s["shape"], "dtype": s["dtype"], "shards": []})
            if entry["shape"] != s["shape"] or entry["dtype"] != s["dtype"]:
                raise ValueError(
                    f"tensor {s['name']!r}: ranks disagree on its global shape/dtype "
                    f"({entry['shape']} {entry['dtype']} vs {s['shape']} {s['dtype']})"
                )
            entry["shards"].append({k: s[k] for k in ("file", "key", "offset", "numel", "start", fmt.CHECKSUM)})
            if s["replicated"]:  # the reader assembles it in one buffer ([Note: verified shares])
                entry["replicated"] = True
    for name, entry in tensors.items():
        check_coverage(name, entry)
    metadata = {**meta, "format_version": fmt.FORMAT_VERSION, "tensors": tensors, "files": files}
    raw = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()  # the C encoder: 5x faster than indent=1
    with open(tmp / fmt.METADATA, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / fmt.COMPLETE, "w") as f:
        f.write(hashlib.sha256(raw).hexdigest() + "\n")
        f.flush()
        os.fsync(f.fileno())
    fmt.fsync_path(tmp)
    old = None
    if target.exists():
        old = target.parent / _temp_name(target.name, "old")
        os.rename(target, old)
        if os.environ.get(KILL_BETWEEN_RENAMES_ENV) == "1":
            fmt.fsync_path(target.parent)
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tmp, target)
    fmt.fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old)
    return {}


def check_coverage(name: str, entry: dict,
                   refusing: str = "refusing to write an incomplete tensor (an engine's state_shards is wrong)") -> None:
    """The slices of a tensor must tile ``[0, numel)`` exactly: no hole, no overlap, no empty
    slice standing in for a real tensor (``refusing`` ends the error: what is not done)."""
    total = fmt.numel_of(entry["shape"])
    pos = 0
    for s in sorted(entry["shards"], key=lambda s: (s["offset"], s["numel"])):
        if s["numel"] == 0 and total > 0:
            continue
        if s["offset"] != pos:
            what = "a hole" if s["offset"] > pos else "an overlap"
            raise ValueError(
                f"tensor {name!r} of shape {entry['shape']}: the ranks' slices leave {what} at element "
                f"{min(pos, s['offset'])}; {refusing}"
            )
        pos += s["numel"]
    if pos != total:
        raise ValueError(
            f"tensor {name!r} of shape {entry['shape']} has {total} elements but the ranks' slices "
            f"cover only {pos}; {refusing}"
        )
