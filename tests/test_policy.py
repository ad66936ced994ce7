import dataclasses

import pytest
import torch

from mixprec import PrecisionPolicy


def test_presets_resolve_to_documented_numerics():
    bf16 = PrecisionPolicy.from_mixed_precision("bf16")
    assert (bf16.compute_dtype, bf16.master_dtype, bf16.reduce_dtype, bf16.accumulate_dtype) == (
        torch.bfloat16, torch.float32, torch.float32, torch.float32)
    assert not bf16.loss_scaling and bf16.param_dtype is None
    fp16 = PrecisionPolicy.from_mixed_precision("fp16")
    assert fp16.compute_dtype == torch.float16 and fp16.loss_scaling
    assert fp16.master_dtype == torch.float32
    no = PrecisionPolicy.from_mixed_precision("no")
    assert no.compute_dtype == torch.float32 and not no.autocast_enabled
    pure = PrecisionPolicy.from_mixed_precision("bf16-pure")
    assert pure.master_dtype is None and pure.param_dtype == torch.bfloat16


def test_policy_is_frozen_and_keyword_only():
    p = PrecisionPolicy.from_mixed_precision("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = torch.float16
    with pytest.raises(TypeError):
        PrecisionPolicy("bf16")  # positional arguments are refused


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"mixed_precision='bf8'.*'no', 'bf16', 'fp16', 'bf16-pure'"):
        PrecisionPolicy.from_mixed_precision("bf8")


def test_masters_can_only_be_dropped_by_a_pure_policy():
    with pytest.raises(ValueError, match="only allowed as an explicit opt-in"):
        PrecisionPolicy.from_mixed_precision("bf16", param_dtype=torch.bfloat16, master_dtype=None)


def test_loss_scaling_only_with_fp16():
    with pytest.raises(ValueError, match="loss scaling is for fp16"):
        PrecisionPolicy.from_mixed_precision("bf16", loss_scaling=True)


def test_unknown_override_field_is_named():
    with pytest.raises(ValueError, match="unknown PrecisionPolicy field.*'compute'"):
        PrecisionPolicy.from_mixed_precision("bf16", compute=torch.float16)


def test_describe_mentions_every_dtype():
    line = PrecisionPolicy.from_mixed_precision("fp16", param_dtype=torch.float16).describe()
    assert "compute=fp16" in line and "params=fp16" in line and "masters=fp32" in line
    assert "loss_scaling=dynamic" in line


def test_accumulate_dtype_follows_the_masters_and_is_not_a_setting():
    assert PrecisionPolicy.from_mixed_precision("fp16").accumulate_dtype == torch.float32
    assert PrecisionPolicy.from_mixed_precision("bf16-pure").accumulate_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"accumulate_dtype=torch.bfloat16 is not a setting"):
        PrecisionPolicy.from_mixed_precision("bf16", accumulate_dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        PrecisionPolicy(name="bf16", accumulate_dtype=torch.float32)
