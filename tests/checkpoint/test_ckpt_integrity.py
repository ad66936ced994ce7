"""Incomplete, corrupt or mismatched checkpoints are refused with a clear error and load nothing."""

import json
import os
import shutil

import pytest
import torch

from ckpt_training import setup, train
from mixprec.checkpoint import CheckpointError, CheckpointReader
from mixprec.checkpoint.format import COMPLETE, METADATA, tensor_file


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "c"
    train("bf16", 3, save_at=3, save_dir=path)
    return path


def _fresh_and_snapshot(**kw):
    acc, model, opt, loader, sched, counter = setup("bf16", **kw)
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [m.clone() for m in acc.engine.master_of.values()]
    return acc, model, opt, snap, masters


def _assert_unchanged(acc, model, opt, snap, masters):
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), k
    for m, before in zip(acc.engine.master_of.values(), masters):
        assert torch.equal(m, before)
    assert len(opt.state) == 0


def _copy(saved, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst


def test_truncated_tensor_file_is_refused(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    f = ck / tensor_file(0)
    os.truncate(f, f.stat().st_size // 2)
    acc, model, opt, snap, masters = _fresh_and_snapshot()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        acc.load_state(ck)
    _assert_unchanged(acc, model, opt, snap, masters)


def test_flipped_byte_fails_checksum(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    f = ck / tensor_file(0)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        CheckpointReader(ck)


def test_edited_metadata_is_refused(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    meta = json.loads((ck / METADATA).read_text())
    meta["world_size"] = 4
    (ck / METADATA).write_text(json.dumps(meta))
    acc, model, opt, snap, masters = _fresh_and_snapshot()
    with pytest.raises(CheckpointError, match="edited or corrupt"):
        acc.load_state(ck)
    _assert_unchanged(acc, model, opt, snap, masters)


def test_missing_marker_is_incomplete(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    (ck / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        CheckpointReader(ck)


def test_renamed_layer_lists_keys_and_loads_nothing(saved):
    # A model whose last Linear moved from index 4 to 5: keys change, nothing may load.
    from ckpt_training import make_model

    acc2, *_ = setup("bf16")
    renamed = make_model(renamed=True)
    optim2 = torch.optim.AdamW(renamed.parameters(), lr=1e-2)
    acc2._models.clear()
    acc2._optimizers.clear()
    renamed, optim2 = acc2.prepare(renamed, optim2)
    before = {k: v.clone() for k, v in renamed.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        acc2.load_state(saved)
    text = str(info.value)
    assert "missing keys ['model/5.bias', 'model/5.weight']" in text
    assert "unexpected keys" in text and "'model/4.weight'" in text
    for k, v in renamed.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_misshaped_key_is_listed(saved):
    acc2, *_ = setup("bf16")
    acc2._models.clear()
    acc2._optimizers.clear()
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 5))
    acc2.prepare(other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(CheckpointError, match=r"mis-shaped keys \['model/4.bias: checkpoint \(4,\) vs model \(5,\)'"):
        acc2.load_state(saved)


def test_loading_fp16_scaler_state_into_bf16_is_refused(tmp_path):
    train("fp16", 2, save_at=2, save_dir=tmp_path / "c")
    acc, model, opt, snap, masters = _fresh_and_snapshot()
    with pytest.raises(CheckpointError, match="mixed_precision='fp16'"):
        acc.load_state(tmp_path / "c")
    _assert_unchanged(acc, model, opt, snap, masters)


def test_a_save_whose_completion_fails_raises_and_keeps_the_previous(tmp_path):
    """The metadata step (rank 0 checks the slices tile every tensor) failing must fail the
    save: a state_shards that leaves a hole raised nothing once, and the checkpoint stayed a
    temporary directory while save_state() returned."""
    from mixprec.checkpoint.format import Shard

    acc, model, opt, loader, sched, counter = setup("bf16")
    target = tmp_path / "c"
    acc.save_state(str(target))
    before = (target / METADATA).read_bytes()
    real = acc.engine.state_shards

    def with_a_hole(models, optimizers):
        shards = real(models, optimizers)
        s = shards[0]
        half = s.tensor.numel() // 2
        shards[0] = Shard(s.name, s.shape, s.dtype, s.offset, s.tensor[:half], s.replicated)
        return shards

    acc.engine.state_shards = with_a_hole
    with pytest.raises(ValueError, match="failed; the previous checkpoint is untouched"):
        acc.save_state(str(target))
    assert (target / METADATA).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
