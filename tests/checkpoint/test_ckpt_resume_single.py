"""Resume on one process: steps 6-10 after a save at 5 are bitwise those of an uninterrupted run."""

import pytest
import torch

from ckpt_training import setup, train


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_resume_is_bitwise(tmp_path, mixed_precision):
    # 48 samples / batch 8 = 6 batches per epoch: the save at step 5 is mid-epoch and
    # steps 7-10 run in the second epoch (a new shuffle drawn from the restored RNG).
    full, full_state, full_scale = train(mixed_precision, 10, save_at=5, save_dir=tmp_path / "c5")
    resumed, resumed_state, resumed_scale = train(mixed_precision, 10, load_dir=tmp_path / "c5")
    assert len(resumed) == 5
    assert resumed == full[5:]
    assert full_state.keys() == resumed_state.keys()
    for k in full_state:
        assert torch.equal(full_state[k], resumed_state[k]), k
    assert resumed_scale == full_scale


def test_resume_restores_counters_and_scheduler(tmp_path):
    train("fp16", 5, save_at=5, save_dir=tmp_path / "c")
    acc, model, opt, loader, sched, counter = setup("fp16")
    acc.load_state(tmp_path / "c")
    assert counter.n == 5
    assert sched.scheduler.last_epoch == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5)
    assert acc.engine.scaler_state_dict()["scale"] == 65536.0
    assert loader._mixprec_skip == 5


def test_save_state_needs_a_directory():
    acc, *_ = setup()
    with pytest.raises(ValueError, match="save_state\\(\\) needs output_dir="):
        acc.save_state()


def test_register_rejects_objects_without_state_dict():
    acc, *_ = setup()
    with pytest.raises(TypeError, match="object"):
        acc.register_for_checkpointing(object())
