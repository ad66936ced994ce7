"""The zero3/fsdp parameter guard and the gathering context in one process (zero3 and fsdp
run in a single process too; tests/distributed/test_gathered_parameters.py has the
2-process checks on every backend)."""

import copy
import io

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Accelerator, UnshardedParameterError
from mixprec.engines.gathered import GuardedView, ShardedParameter


_MADE: list = []


@pytest.fixture(autouse=True)
def _end_training():
    """zero3/fsdp open a one-process group: end every Accelerator a test made, so no group
    outlives the test (a later test in this process may open its own)."""
    yield
    while _MADE:
        _MADE.pop().end_training()


def _accelerator(**kwargs):
    acc = Accelerator(**kwargs)
    _MADE.append(acc)
    return acc


def _prepared(backend="zero3", mixed_precision="no"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    acc = _accelerator(mixed_precision=mixed_precision, backend=backend, cpu=True, log_policy=False,
                       engine_options={"units": ["Linear"]})
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    return acc, model, opt


@pytest.mark.parametrize("backend", ["zero3", "fsdp"])
def test_read_outside_raises_naming_parameter_unit_and_fix(backend):
    acc, model, _ = _prepared(backend)
    w = model[2].weight
    assert type(w) is ShardedParameter and isinstance(w, nn.Parameter)
    for op in (lambda: w.norm(), lambda: w + 1, lambda: w.detach().sum(), lambda: w.data.clone(),
               lambda: w[0], lambda: w.sum().item(), lambda: torch.nn.functional.linear(torch.ones(1, 16), w),
               lambda: model.state_dict()["2.weight"].norm()):
        with pytest.raises(UnshardedParameterError) as info:
            op()
        message = str(info.value)
        assert "'2.weight'" in message and "unit '2'" in message, message
        assert "gathered_parameters" in message and "get_state_dict" in message
        assert info.value.params == ("2.weight",) and info.value.units == ("2",)
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # keys, no data read
    for op in (lambda: torch.save(model, io.BytesIO()), lambda: copy.deepcopy(model),
               lambda: torch.save(model.state_dict(), io.BytesIO())):
        with pytest.raises(UnshardedParameterError, match=r"parameter '0\.weight' of sharding unit '0'"):
            op()
    # metadata reads no data
    assert w.shape == (4, 16) and w.dtype == torch.float32 and w.requires_grad and w.numel() == 64
    assert w.grad is None and w.is_leaf and w.dim() == 2
    assert "not gathered" in repr(w) and "Linear(in_features=16, out_features=4" in str(model)
    model.zero_grad()
    with pytest.raises(UnshardedParameterError, match="detach parameter '2.weight'"):
        w.data = torch.zeros(4, 16)


def test_context_reads_writes_back_and_guards_views():
    acc, model, opt = _prepared("zero3")
    full = acc.get_state_dict(model)
    with acc.gathered_parameters(model):
        assert model[0].weight.norm().item() == full["0.weight"].norm().item()
        view = model[0].weight.detach()
        assert type(view) is GuardedView and view.equal(full["0.weight"])
        snapshot = copy.deepcopy(model)
        assert type(snapshot[0].weight) is nn.Parameter  # a plain full copy
        assert "Parameter containing" in repr(model[0].bias)
    with pytest.raises(UnshardedParameterError, match="'0.weight'"):
        view.sum()
    assert acc.engine.param_buffer_bytes() == 0
    # the copy runs on its own, without gathering the original's units
    out = snapshot(torch.randn(2, 8))
    assert out.shape == (2, 4) and acc.engine.param_buffer_bytes() == 0
    # modifier_rank=0 writes back into the fp32 masters; unchanged parameters keep theirs
    with mixprec.GatheredParameters(model[2].weight, modifier_rank=0), torch.no_grad():
        model[2].weight.mul_(0)
    after = acc.get_state_dict(model)
    assert after["2.weight"].eq(0).all() and after["0.weight"].equal(full["0.weight"])
    # without writeback edits are dropped
    with acc.gathered_parameters(model), torch.no_grad():
        model[2].bias.fill_(3.0)
    assert acc.get_state_dict(model)["2.bias"].equal(after["2.bias"])
    # nesting: the inner scope gathers nothing, the outer one frees
    with mixprec.summon_full_params(model):
        with acc.gathered_parameters(model[0]):
            pass
        with torch.no_grad():
            model[0].bias.add_(1.0)  # still gathered after the inner exit
    assert acc.get_state_dict(model)["0.bias"].equal(full["0.bias"] + 1.0)
    assert acc.engine.param_buffer_bytes() == 0
    # a forward inside the context leaves the held units gathered
    with acc.gathered_parameters(model):
        model(torch.randn(2, 8))
        assert model[2].weight.sum().item() == 0.0
    # optimizer state and training are unaffected
    acc.backward(model(torch.randn(4, 8)).square().mean())
    opt.step()


def test_bad_arguments_name_the_value():
    acc, model, _ = _prepared("zero3")
    with pytest.raises(ValueError, match="modifier_rank=1"):
        acc.gathered_parameters(model, modifier_rank=1)
    with pytest.raises(ValueError, match="rank0_only=True"):
        acc.gathered_parameters(model, rank0_only=True, writeback=True)
    with pytest.raises(TypeError, match="got int"):
        acc.gathered_parameters(3)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="prepared by a live Accelerator"):
        mixprec.GatheredParameters(other.parameters())
    with pytest.raises(NotImplementedError, match="offload_to_cpu=True"):
        mixprec.summon_full_params(model, offload_to_cpu=True)


def test_single_backend_writeback_reaches_low_precision_masters():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    acc = _accelerator(mixed_precision="bf16", backend="single", cpu=True, log_policy=False,
                       param_dtype=torch.bfloat16)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.weight.dtype == torch.bfloat16
    before = acc.get_state_dict(model)
    with acc.gathered_parameters(model, modifier_rank=0), torch.no_grad():
        model.bias.fill_(0.5)
    after = acc.get_state_dict(model)
    assert after["bias"].dtype == torch.float32 and after["bias"].eq(0.5).all()
    assert after["weight"].equal(before["weight"])  # unchanged: its fp32 bits kept
