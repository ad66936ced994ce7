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
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


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


def _write_rank_files(state, tmp: Path, shards: list, rank_state: dict, objects: Optional[dict]) -> dict:
    mine = [s for s in shards if not s.replicated or state.rank == 0]
    for s in mine:
        s.check()
    entries = [(f"{s.name}@{s.offset}", (s.numel,), s.dtype) for s in mine]
    kill = os.environ.get(KILL_ENV) == str(state.rank)

    def produce(i: int) -> torch.Tensor:
        if kill and i >= len(mine) // 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return mine[i].tensor.reshape(-1)

    files = {}
    name = fmt.tensor_file(state.rank)
    with open(tmp / name, "wb") as f:
        files[name] = write_safetensors_synced(f, entries, produce)
    if kill:  # a rank holding no tensors of its own dies after its (empty) tensor file
        os.kill(os.getpid(), signal.SIGKILL)
    files[fmt.rank_file(state.rank)] = _write_blob(tmp / fmt.rank_file(state.rank), rank_state)
    if objects is not None:
        files[fmt.OBJECTS] = _write_blob(tmp / fmt.OBJECTS, objects)
    slices = [
        {"name": s.name, "shape": list(s.shape), "dtype": fmt.dtype_to_str(s.dtype), "offset": s.offset,
         "numel": s.numel, "replicated": s.replicated, "key": key, "file": name}
        for s, (key, _, _) in zip(mine, entries)
    ]
    return {"files": files, "slices": slices}


def write_safetensors_synced(f, entries, produce) -> dict:
    digest = fmt.write_safetensors(f, entries, produce)
    f.flush()
    os.fsync(f.fileno())
    return {"sha256": digest, "bytes": f.tell()}


def _write_blob(path: Path, obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


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
            entry["shards"].append({k: s[k] for k in ("file", "key", "offset", "numel")})
    for name, entry in tensors.items():
        check_coverage(name, entry)
    metadata = {**meta, "format_version": fmt.FORMAT_VERSION, "tensors": tensors, "files": files}
    raw = json.dumps(metadata, indent=1, sort_keys=True).encode()
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
