"""Automatic naming and rotation; consolidated exports (CLI and save_model)."""

import pytest
import torch
from safetensors.torch import load_file

from ckpt_training import setup
from mixprec.checkpoint import list_checkpoints, write_state_dict
from mixprec.checkpoint.writer import check_coverage
from mixprec.cli import main


def test_rotation_keeps_the_newest_complete(tmp_path):
    acc, *_ = setup(project_dir=tmp_path, total_limit=2)
    written = [acc.save_state() for _ in range(4)]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["checkpoint_2", "checkpoint_3"]
    assert written[-1].endswith("checkpoint_3")
    (tmp_path / "checkpoints" / "checkpoint_9").mkdir()  # no COMPLETE marker: never listed
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["checkpoint_2", "checkpoint_3"]
    acc2, *_ = setup(project_dir=tmp_path, total_limit=2)
    assert acc2.load_state().endswith("checkpoint_3")
    assert acc2.save_state().endswith("checkpoint_4")


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_consolidate_cli_equals_get_state_dict(tmp_path, dtype, capsys):
    acc, model, opt, *_ = setup("bf16")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    acc.save_state(tmp_path / "c")
    out = tmp_path / "full.safetensors"
    argv = ["consolidate", str(tmp_path / "c"), str(out)] + (["--dtype", dtype] if dtype else [])
    assert main(argv) == 0
    loaded = load_file(str(out))
    expected = acc.get_state_dict(model)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, None: torch.float32}[dtype]
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert loaded[k].dtype == want
        assert torch.equal(loaded[k], v.to(want)), k


def test_consolidate_cli_reports_a_bad_checkpoint(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o.safetensors")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_save_model_writes_masters(tmp_path):
    acc, model, *_ = setup("bf16")
    path = acc.save_model(model, tmp_path / "export", dtype="fp32")
    loaded = load_file(path)
    for k, v in acc.get_state_dict(model).items():
        assert torch.equal(loaded[k], v), k


def test_empty_tensors_are_never_written(tmp_path):
    with pytest.raises(ValueError, match=r"refusing to write empty tensors \['w'\]"):
        write_state_dict({"w": torch.empty(0), "b": torch.ones(2)}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match="cover only 0"):
        check_coverage("w", {"shape": [4, 4], "shards": [{"offset": 0, "numel": 0}]})
    with pytest.raises(ValueError, match="a hole at element 8"):
        check_coverage("w", {"shape": [4, 4], "shards": [{"offset": 0, "numel": 8}, {"offset": 12, "numel": 4}]})
