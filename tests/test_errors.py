"""Acceptance: bad input names the value and the fix."""

import numpy as np
import pytest
import torch

from mixprec import Accelerator


def test_unknown_mixed_precision():
    with pytest.raises(ValueError, match=r"mixed_precision='fp8' is not supported; use one of 'no', 'bf16'"):
        Accelerator(mixed_precision="fp8")


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match=r"backend='deepspeed' is not supported; valid backends: 'auto', 'single'"):
        Accelerator(backend="deepspeed")


def test_fp16_on_a_device_without_fp16_support():
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' needs fp16 autocast, which device 'meta' "
                                         r"does not support; use mixed_precision='no'"):
        Accelerator(mixed_precision="fp16", device="meta")


def test_bad_device_string():
    with pytest.raises(ValueError, match=r"device='gpu0' is not a valid torch device"):
        Accelerator(device="gpu0")


@pytest.mark.parametrize("obj", ["model.pt", np.zeros(3), {"lr": 1.0}])
def test_prepare_of_an_unsupported_object(obj):
    acc = Accelerator(cpu=True, log_policy=False)
    with pytest.raises(TypeError, match=r"prepare\(\) got an object of type .* which it cannot wrap; it accepts: "
                                        r"torch.nn.Module, torch.optim.Optimizer"):
        acc.prepare(torch.nn.Linear(2, 2), obj)


def test_policy_conflicting_with_mixed_precision_names_both():
    from mixprec import PrecisionPolicy

    with pytest.raises(ValueError, match=r"mixed_precision='fp16' conflicts with policy.name='bf16'"):
        Accelerator(mixed_precision="fp16", policy=PrecisionPolicy.from_mixed_precision("bf16"))


def test_prepare_returns_in_order_given():
    acc = Accelerator(cpu=True, log_policy=False)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    out = acc.prepare(sched, loader, opt, model)
    assert out[3] is model
    assert out[2].optimizer is opt and out[1].dataloader is loader and out[0].scheduler is sched


def test_policy_is_printed_once(capsys):
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    acc.prepare(torch.nn.Linear(2, 2))
    assert capsys.readouterr().out.count("mixprec policy: mixed_precision='bf16'") == 1


def test_build_info():
    import mixprec

    info = mixprec.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["cuda"] in (True, False)


def test_startup_line_names_backend_world_process_group_policy_layout(capsys, monkeypatch):
    """Issue 29, point 5 on one process: `auto` resolving to single, and zero2 chosen by the
    environment (over a one-process group: 1 gradient bucket for 2 parameters)."""
    monkeypatch.delenv("MIXPREC_BACKEND", raising=False)
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    line = capsys.readouterr().out.strip()
    assert line.startswith("mixprec: backend single (auto: one process); world size 1 (1 node x 1 process); "
                           "process group none (one process); mixprec policy: mixed_precision='bf16'"), line
    assert line.endswith("; Linear: no gradient communication") and "\n" not in line
    assert "Backend: single\nProcess group backend: none (one process)\n" in repr(acc.state)
    acc.end_training()
    monkeypatch.setenv("MIXPREC_BACKEND", "zero2")
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    line = capsys.readouterr().out.strip()
    assert line.startswith("mixprec: backend zero2 (from env MIXPREC_BACKEND); world size 1 (1 node x 1 "
                           "process); process group gloo; mixprec policy:"), line
    assert line.endswith("; Linear: 1 gradient bucket(s) (cap 25 MB, first 1 MB)")
    assert "Backend: zero2\nProcess group backend: gloo\n" in repr(acc.state)
    acc.end_training()
