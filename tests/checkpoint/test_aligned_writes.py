"""[Note: aligned writes] in checkpoint/format.py: a tensor file reaches the kernel as one
write per CHUNK_BYTES-aligned region of the file, so the page cache holds it in large
folios, and the file is byte for byte what it was (safetensors readers and the checksums
agree). Before, every tensor was written in 4 MiB chunks counted from its own start, so
no write after the header began on a boundary."""

from __future__ import annotations

import io
import os

import pytest
import torch
from safetensors import safe_open

from mixprec.checkpoint import format as fmt

MiB = 1 << 20


def _tensors():
    g = torch.Generator().manual_seed(0)
    # sizes that leave every tensor start off the 4 MiB grid: 5 MiB, 3 bytes short of 1 MiB,
    # a 2-byte dtype after an odd-sized one, 9 MiB, and an empty one
    return [
        ("a", torch.randn(5 * MiB // 4, generator=g)),
        ("b", torch.randint(0, 255, (MiB - 3,), dtype=torch.uint8, generator=g)),
        ("c", torch.randn(3 * MiB // 2 + 7, generator=g).bfloat16()),
        ("d", torch.randn(9 * MiB // 4, generator=g)),
        ("e", torch.empty(0)),
        ("f", torch.randn(1000, generator=g).double()),
    ]


def _write(path, tensors, hold, monkeypatch=None, cap=None):
    """Write ``tensors``, recording each kernel write as (offset, bytes)."""
    calls = []
    real = os.writev

    def writev(fd, parts):
        start = os.lseek(fd, 0, os.SEEK_CUR)
        if cap is not None:  # a short write: the kernel may take fewer bytes than offered
            out, left = [], cap
            for p in parts:
                if left <= 0:
                    break
                out.append(memoryview(p)[:left])
                left -= len(out[-1])
            parts = out
        n = real(fd, parts)
        calls.append((start, n))
        return n

    if monkeypatch is not None:
        monkeypatch.setattr(fmt.os, "writev", writev)
    entries = [(k, tuple(t.shape), t.dtype) for k, t in tensors]
    with open(path, "wb") as f:
        record = fmt.write_safetensors(f, entries, lambda i: tensors[i][1], hold=hold)
    return record, calls


def _check_file(path, tensors, record):
    with safe_open(str(path), framework="pt") as f:
        for k, t in tensors:
            assert torch.equal(f.get_tensor(k), t), k
    raw = path.read_bytes()
    assert len(raw) == record["bytes"]
    assert fmt.checksum_bytes(raw[: record["header"]["bytes"]]) == record["header"][fmt.CHECKSUM]
    for (k, t), e in zip(tensors, record["entries"]):
        nbytes = t.numel() * t.element_size()
        assert fmt.checksum_bytes(raw[e["start"]: e["start"] + nbytes]) == e[fmt.CHECKSUM], k


def test_held_tensors_are_written_one_aligned_region_at_a_time(tmp_path, monkeypatch):
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    record, calls = _write(path, tensors, True, monkeypatch)
    _check_file(path, tensors, record)
    assert sum(n for _, n in calls) == record["bytes"]
    assert [s for s, _ in calls] == sorted(s for s, _ in calls)
    # every write but the last ends on a 4 MiB boundary, so every write but the first starts on one
    for start, n in calls[:-1]:
        assert (start + n) % fmt.CHUNK_BYTES == 0, (start, n)
    assert all(start % fmt.CHUNK_BYTES == 0 for start, _ in calls[1:])
    assert len(calls) == -(-record["bytes"] // fmt.CHUNK_BYTES)  # one per region


def test_unheld_tensors_are_written_out_before_the_next_is_produced(tmp_path, monkeypatch):
    """Without ``hold`` (consolidate: each tensor made, written, dropped) a tensor's pieces
    never wait for the next tensor; its chunks still end on the file's boundaries."""
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    produced_at = []
    calls = []
    real = os.writev

    def writev(fd, parts):
        n = real(fd, parts)
        calls.append((os.lseek(fd, 0, os.SEEK_CUR) - n, n))
        return n

    monkeypatch.setattr(fmt.os, "writev", writev)
    entries = [(k, tuple(t.shape), t.dtype) for k, t in tensors]

    def produce(i):
        produced_at.append(sum(n for _, n in calls))  # bytes on disk when tensor i is asked for
        return tensors[i][1]

    with open(path, "wb") as f:
        record = fmt.write_safetensors(f, entries, produce)
    _check_file(path, tensors, record)
    for i, done in enumerate(produced_at[1:], 1):
        assert done == record["entries"][i]["start"], (i, done)  # everything before it was written
    for start, n in calls:
        end = start + n
        assert end % fmt.CHUNK_BYTES == 0 or any(end == e["start"] + t.numel() * t.element_size()
                                                 for (_, t), e in zip(tensors, record["entries"])) \
            or end == record["header"]["bytes"], (start, n)


def test_short_writes_and_many_tiny_tensors_still_write_every_byte(tmp_path, monkeypatch):
    """The kernel may take part of a writev (each call capped at 100,003 bytes here), and a
    region may hold more tensors than one writev takes (IOV_MAX): neither loses a byte."""
    tensors = _tensors()[:3] + [(f"tiny{i}", torch.full((3,), float(i))) for i in range(1500)]
    path = tmp_path / "t.safetensors"
    record, calls = _write(path, tensors, True, monkeypatch, cap=100_003)
    _check_file(path, tensors, record)
    assert max(n for _, n in calls) <= 100_003
    assert sum(n for _, n in calls) == record["bytes"]


def test_a_file_object_without_a_descriptor_gets_the_same_bytes(tmp_path):
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    record, _ = _write(path, tensors, True)
    buf = io.BytesIO()
    entries = [(k, tuple(t.shape), t.dtype) for k, t in tensors]
    assert fmt.write_safetensors(buf, entries, lambda i: tensors[i][1], hold=True) == record
    assert buf.getvalue() == path.read_bytes()


@pytest.mark.parametrize("hold", [True, False])
def test_a_strided_tensor_goes_through_the_staging_buffer_and_is_written_at_once(tmp_path, monkeypatch, hold):
    """A tensor that is not CPU-contiguous is staged in the reused buffer: each staged piece
    is written before the buffer is refilled, so a later piece cannot overwrite it."""
    g = torch.Generator().manual_seed(1)
    strided = [("s", torch.randn(3 * MiB // 4, 4, generator=g).t()),
               ("t", torch.randn(MiB, 3, generator=g)[:, 1])]
    path = tmp_path / "t.safetensors"
    record, _ = _write(path, strided, hold, monkeypatch)
    _check_file(path, [(k, t.contiguous()) for k, t in strided], record)
