"""Checkpoint I/O at the disk's speed, still atomic and verified: checksums named by their
algorithm per entry (old sha256 checkpoints load), each rank verifies its share of the
bytes, replicated tensors are written by every rank, and an overwrite killed between its
two renames is put back by the next load ([Note: checksums] in checkpoint/format.py,
[Note: verified shares] in checkpoint/reader.py, [Note: replicated shares] and
[Note: interrupted overwrite] in checkpoint/writer.py)."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from mixprec import Accelerator
from mixprec.checkpoint import CheckpointError, CheckpointReader, list_checkpoints
from mixprec.checkpoint import format as fmt
from mixprec.checkpoint.format import COMPLETE, METADATA, OBJECTS, Shard, rank_file, sha256_file, tensor_file
from mixprec.checkpoint.writer import (KILL_BETWEEN_RENAMES_ENV, _complete, _write_rank_files, my_share,
                                       remove_stale_temporaries)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(700, 1000, generator=g),          # 2.8 MB: split by range
            "mid": torch.randn(300, 1000, generator=g).bfloat16(),
            "small": torch.randn(17, generator=g),
            "step": torch.tensor([3.0]),
            "flag": torch.tensor([True, False, True])}


def _two_rank_checkpoint(tmp_path, tensors):
    """What two ranks of a replicated backend (ddp) write: the same whole tensors on each."""
    shards = [Shard("model/" + n, tuple(t.shape), t.dtype, 0, t.reshape(-1), True) for n, t in tensors.items()]
    tmp = tmp_path / ".ck.tmp"
    tmp.mkdir()
    reports = [_write_rank_files(SimpleNamespace(rank=r, world_size=2), tmp, shards, {"rank": r},
                                 {"counter": 1} if r == 0 else None) for r in range(2)]
    target = tmp_path / "ck"
    _complete(tmp, target, reports, {"world_size": 2})
    return target


def _flip_data_byte(ck, file):
    meta = json.loads((ck / METADATA).read_text())
    start = min(sh["start"] for e in meta["tensors"].values() for sh in e["shards"] if sh["file"] == file)
    data = bytearray((ck / file).read_bytes())
    data[start + 5] ^= 0x10
    (ck / file).write_bytes(bytes(data))


def test_replicated_tensors_are_written_by_every_rank_and_read_back_exactly(tmp_path):
    tensors = _tensors()
    ck = _two_rank_checkpoint(tmp_path, tensors)
    sizes = [(ck / tensor_file(r)).stat().st_size for r in range(2)]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(s > 0.4 * total for s in sizes), (sizes, total)
    reader = CheckpointReader(ck)
    for n, t in tensors.items():
        got = reader("model/" + n, 0, t.numel()).reshape(t.shape)
        assert got.dtype == t.dtype and torch.equal(got, t), n
    # a range across the two ranks' slices of the split tensor
    flat = tensors["big"].reshape(-1)
    assert torch.equal(reader("model/big", 349_990, 20), flat[349_990:350_010])
    for rank in range(2):  # as load_state reads: its share verified up front, the rest verified as read
        shared = CheckpointReader(ck, share=(rank, 2))
        assert torch.equal(shared("model/big", 349_990, 20), flat[349_990:350_010])
        for n, t in tensors.items():
            got = shared("model/" + n, 0, t.numel()).reshape(t.shape)
            assert got.dtype == t.dtype and torch.equal(got, t), (rank, n)
        shared.release()
    meta = json.loads((ck / METADATA).read_text())
    assert len(meta["tensors"]["model/big"]["shards"]) == 2 and meta["tensors"]["model/big"]["replicated"]
    for sh in meta["tensors"]["model/big"]["shards"]:
        assert fmt.checksum_in(sh)[0] == fmt.CHECKSUM and isinstance(sh["start"], int)


def test_shares_tile_every_replicated_tensor_whatever_the_world():
    tensors = _tensors()
    shards = [Shard("model/" + n, tuple(t.shape), t.dtype, 0, t.reshape(-1), True) for n, t in tensors.items()]
    for world in (1, 2, 3, 5):
        covered = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in tensors.items()}
        for r in range(world):
            for s in my_share(shards, r, world):
                covered[s.name[len("model/"):]][s.offset: s.offset + s.numel] += 1
                assert torch.equal(s.tensor, tensors[s.name[len("model/"):]].reshape(-1)[s.offset: s.offset + s.numel])
        assert all(bool((c == 1).all()) for c in covered.values()), world


def test_each_rank_verifies_its_share_and_what_it_reads(tmp_path):
    ck = _two_rank_checkpoint(tmp_path, _tensors())
    _flip_data_byte(ck, tensor_file(1))
    with pytest.raises(CheckpointError, match=r"tensors-rank00001.safetensors fails its checksum"):
        CheckpointReader(ck)                      # a bare reader checks every byte
    with pytest.raises(CheckpointError, match=r"tensors-rank00001.safetensors fails its checksum"):
        CheckpointReader(ck, share=(1, 2))        # rank 1's share holds the damage
    reader = CheckpointReader(ck, share=(0, 2))   # rank 0's share is intact
    meta = reader.metadata["tensors"]
    in_file0 = [n for n, e in meta.items() if all(sh["file"] == tensor_file(0) for sh in e["shards"])]
    assert in_file0
    for n in in_file0:
        reader(n, 0, fmt.numel_of(reader.index[n][0]))
    damaged = next(n for n, e in meta.items() if any(sh["file"] == tensor_file(1) and sh["numel"] > 8
                                                      for sh in e["shards"]))
    with pytest.raises(CheckpointError, match="fails its checksum"):  # read: verified on the way
        reader(damaged, 0, fmt.numel_of(reader.index[damaged][0]))


def test_damaged_header_is_refused(tmp_path):
    ck = _two_rank_checkpoint(tmp_path, _tensors())
    data = bytearray((ck / tensor_file(0)).read_bytes())
    i = data.index(b'"shape"')
    data[i + 1] = ord("S")
    (ck / tensor_file(0)).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tensors-rank00000.safetensors fails its checksum .* on its header"):
        CheckpointReader(ck, share=(0, 2))
    CheckpointReader(ck, share=(1, 2))  # rank 1 does not verify rank 0's file


def _train_and_save(path, seed=0):
    torch.manual_seed(seed)
    acc = Accelerator(cpu=True, log_policy=False, backend="single")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(8, 16)
    acc.backward(model(x).float().square().mean())
    opt.step()
    opt.zero_grad()
    if path is not None:
        acc.save_state(str(path))
    return acc, model, opt


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(k, v.clone()) for st in opt.state.values() for k, v in sorted(st.items())])


def _assert_state(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert len(a[1]) == len(b[1]) and all(ka == kb and torch.equal(x, y) for (ka, x), (kb, y) in zip(a[1], b[1]))


def _to_sha256_format(ck):
    """Rewrite a checkpoint as mixprec wrote them before [Note: checksums]: one sha256 per
    whole file, no byte offsets or checksums in the shard table."""
    meta = json.loads((ck / METADATA).read_text())
    for e in meta["tensors"].values():
        for sh in e["shards"]:
            for k in ("start", *fmt.CHECKSUMS):
                sh.pop(k, None)
    meta["files"] = {n: {"sha256": sha256_file(ck / n), "bytes": (ck / n).stat().st_size} for n in meta["files"]}
    raw = json.dumps(meta, indent=1, sort_keys=True).encode()
    (ck / METADATA).write_bytes(raw)
    (ck / COMPLETE).write_text(hashlib.sha256(raw).hexdigest() + "\n")


def test_sha256_checkpoints_of_the_previous_format_still_load(tmp_path):
    acc, model, opt = _train_and_save(tmp_path / "ck")
    saved = _state(model, opt)
    _to_sha256_format(tmp_path / "ck")
    acc2, model2, opt2 = _train_and_save(None, seed=1)
    acc2.load_state(str(tmp_path / "ck"))
    _assert_state(_state(model2, opt2), saved)
    data = bytearray((tmp_path / "ck" / tensor_file(0)).read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "ck" / tensor_file(0)).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"fails its checksum \(sha256\)"):
        acc2.load_state(str(tmp_path / "ck"))


def test_crc32_checkpoints_load_and_refuse_damage(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "CHECKSUM", "crc32")
    acc, model, opt = _train_and_save(tmp_path / "ck")
    saved = _state(model, opt)
    meta = json.loads((tmp_path / "ck" / METADATA).read_text())
    assert set(meta["files"][OBJECTS]) == {"crc32", "bytes"}
    assert all("crc32" in sh for e in meta["tensors"].values() for sh in e["shards"])
    acc2, model2, opt2 = _train_and_save(None, seed=1)
    acc2.load_state(str(tmp_path / "ck"))
    _assert_state(_state(model2, opt2), saved)
    before = _state(model2, opt2)
    _flip_data_byte(tmp_path / "ck", tensor_file(0))
    with pytest.raises(CheckpointError, match=r"fails its checksum \(crc32\)"):
        acc2.load_state(str(tmp_path / "ck"))
    _assert_state(_state(model2, opt2), before)


def test_damaged_rank_file_is_refused_before_anything_loads(tmp_path):
    acc, model, opt = _train_and_save(tmp_path / "ck")
    acc2, model2, opt2 = _train_and_save(None, seed=1)
    before = _state(model2, opt2)
    data = bytearray((tmp_path / "ck" / rank_file(0)).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "ck" / rank_file(0)).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank00000.pt fails its checksum"):
        acc2.load_state(str(tmp_path / "ck"))
    _assert_state(_state(model2, opt2), before)


def _overwrite_killed_between_renames(folder):
    """A process saves folder/checkpoint_1, saves again over it and is SIGKILLed between
    the two renames; returns the state of the first save (what must come back)."""
    first = folder / "first.pt"
    code = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_ckpt_fast_io import _train_and_save, _state
        acc, model, opt = _train_and_save({str(folder / "checkpoint_1")!r})
        torch.save(_state(model, opt), {str(first)!r})
        opt.step()  # the second save holds different numbers
        os.environ[{KILL_BETWEEN_RENAMES_ENV!r}] = "1"
        acc.save_state({str(folder / "checkpoint_1")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != KILL_BETWEEN_RENAMES_ENV})
    assert proc.returncode == -9, proc.stderr
    names = sorted(p.name for p in folder.iterdir())
    assert "checkpoint_1" not in names
    assert any(n.startswith(".checkpoint_1.old-") for n in names), names
    assert any(n.startswith(".checkpoint_1.tmp-") for n in names), names
    return torch.load(first)


def test_overwrite_killed_between_renames_is_put_back_by_load_state(tmp_path):
    saved = _overwrite_killed_between_renames(tmp_path)
    acc, model, opt = _train_and_save(None, seed=1)
    acc.load_state(str(tmp_path / "checkpoint_1"))
    _assert_state(_state(model, opt), saved)
    assert not any(p.name.startswith(".checkpoint_1.old-") for p in tmp_path.iterdir())


def test_overwrite_killed_between_renames_is_listed_and_kept_by_the_next_save(tmp_path):
    saved = _overwrite_killed_between_renames(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_1"]
    reader = CheckpointReader(tmp_path / "checkpoint_1")
    assert torch.equal(reader("model/0.weight", 0, 16 * 32), saved[0]["0.weight"].reshape(-1))
    # killed again: the next save's clean-up puts it back instead of removing it
    os.rename(tmp_path / "checkpoint_1", tmp_path / f".checkpoint_1.old-{_host()}-{_dead_pid()}-0123456789ab")
    removed = remove_stale_temporaries(tmp_path)
    assert (tmp_path / "checkpoint_1" / COMPLETE).is_file()
    assert all(p.name.startswith(".checkpoint_1.tmp-") for p in removed) and removed


def _host():
    from mixprec.checkpoint.writer import _host as host

    return host()


def _dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)
